"""Transport-bound throughput of the shared-memory ring, multiprocessing.Queue
and one memcpy, side by side in one run. See shmpipe/bench/throughput.py.

    python benchmarks/throughput.py                 # 64 KiB, 1 MiB, 48 MB
    python benchmarks/throughput.py --sizes 4096 --seconds 0.5 --json out.json
"""

import sys

from shmpipe.bench.throughput import main

if __name__ == "__main__":
    sys.exit(main())
