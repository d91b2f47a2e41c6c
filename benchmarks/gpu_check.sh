#!/bin/sh
# Everything shmpipe checks and measures on a machine with an NVIDIA GPU, in
# one go (a few minutes): builds the extensions in place, runs the CUDA tests
# of to_torch, benchmarks/gpu_feed.py (checks, then GB/s and stall fractions)
# and examples/torch_train.py on the GPU.
#
#     sh benchmarks/gpu_check.sh [OUTDIR]
#
# Needs python3 with a CUDA build of torch, NumPy, Cython, setuptools, pytest
# and pytest-timeout; nothing is downloaded. Writes gpu.json and
# gpu_check.log to OUTDIR ($OUT, else the current folder). Exit status: that
# of the first step that failed.
set -u
out="${1:-${OUT:-.}}"
mkdir -p "$out"
log="$out/gpu_check.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
step() {
    echo "== $*" | tee -a "$log"
    "$@" >"$out/step.out" 2>&1
    rc=$?
    cat "$out/step.out" >>"$log"
    tail -n 30 "$out/step.out"
    rm -f "$out/step.out"
    if [ $rc -ne 0 ]; then
        echo "== failed ($rc): $*" | tee -a "$log"
        [ $status -ne 0 ] || status=$rc
    fi
}
: >"$log"
step nvidia-smi -L
step python3 -c "import sys, numpy, torch; print(sys.version); print('numpy', numpy.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
step python3 setup.py -q build_ext --inplace
step python3 -m pytest -q -p no:cacheprovider -rs tests/test_torch.py
step python3 benchmarks/gpu_feed.py --json "$out/gpu.json"
step python3 examples/torch_train.py --workers 4 --epochs 2
exit $status
