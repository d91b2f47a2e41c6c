"""Transport-bound throughput of the shared-memory ring, multiprocessing.Queue
and one memcpy, side by side in one run. See shmpipe/bench/throughput.py.

    python benchmarks/throughput.py                 # 64 KiB, 1 MiB, 48 MB
    python benchmarks/throughput.py --sizes 4096 --seconds 0.5 --json out.json

The same as `shmpipe bench throughput ...` (this script runs the command line;
the benchmark itself never imports the command line).
"""

import sys

from shmpipe.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
