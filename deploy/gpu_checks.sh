#!/usr/bin/env bash
# The checks a lent GPU runs first (docs/kernels.md, "Verified and not verified"), as one command that ends inside a
# lent machine's 10-minute command limit: the GPU test selection, the kernels against SDPA (split-K, paged and sparse
# paged decode at 32K, 128K and 1M keys, then prefill at 16K), long-context serving of a 1.24B Llama shape against
# transformers, and a Hugging Face model served by the torch backend against transformers' continuous batching
# (hf-serve). Each step has its own time limit (together 540 s) and writes what it measured as it goes (the
# benchmarks into $OUT/benchmarks.md, a copy of docs/benchmarks.md: merge its sections back; a section cut short says
# "Partial"); a step that fails or runs out of time is said, and the script exits 1 after the others ran.
# The limits are sized from the first full run (2026-11-29, H200): the 31 GPU tests did not end in 130 s, a 16K
# prefill case with --check took 2 minutes, building the 1.24B model on the CPU 30 s a norm, and transformers'
# continuous batching at C = 16 over 90 s (it reused a manager sized for C = 1: fixed, sharp/benchmarks/hfserve.py).
#
# On the GPU machine, from the checkout, with `make wheelhouse-gpu` (build/wheelhouse-gpu: sharp's wheel and what the
# CUDA image lacks, for its CPython 3.12) carried:
#   OUT=/some/dir bash deploy/gpu_checks.sh
# GPU_PYTHON picks the interpreter (default python3, the image's, with its CUDA torch and Triton); WHEELHOUSE the
# wheels (default build/wheelhouse-gpu). Installs into /tmp/site and runs the tests from the checkout against it.
set -uo pipefail

out=${OUT:-build/gpu-checks}
py=${GPU_PYTHON:-python3}
wheels=${WHEELHOUSE:-build/wheelhouse-gpu}

"$py" -c "import sys, torch; torch.cuda.is_available() or sys.exit('gpu_checks: no CUDA device is visible to torch')" || exit 2
compgen -G "$wheels/sharp_attention-*.whl" >/dev/null || {
    echo "gpu_checks: $wheels has no sharp wheel (make wheelhouse-gpu here, then carry $wheels)" >&2
    exit 2
}
mkdir -p "$out"
"$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheels"/*.whl || exit 1
# Fixed 64×64 prefill tiles: the tuner compiles every candidate per problem class (minutes at 16K), a run of its own
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 SHARP_TRITON_AUTOTUNE=0
cp docs/benchmarks.md "$out/benchmarks.md"
"$py" -c "import torch; print(torch.cuda.get_device_name(), 'torch', torch.__version__)" | tee "$out/log"

failed=0
step() {  # step SECONDS NAME COMMAND...: run it under its limit, its output into the log
    local limit=$1 name=$2 rc
    shift 2
    echo "== $name (limit ${limit}s)" | tee -a "$out/log"
    timeout "$limit" "$@" 2>&1 | tee -a "$out/log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "== $name: exit $rc$([ "$rc" -eq 124 ] && echo ' (time limit: what it wrote so far is kept)')" | tee -a "$out/log"
        failed=1
    fi
}

bench=("$py" -P -c "import sys; from sharp.benchmarks import main; sys.exit(main())")
step 160 "test-gpu" "$py" -P -m pytest -q -m gpu -n 8 -p no:cacheprovider --durations 8 tests/test_gpu.py
# decode first (issue 81's sparse rows), then the section after each prefill case; the prefill's errors against the
# fp32 reference are test-gpu's (test_long_prefill_matches_the_reference), not timed here
step 130 "kernels" "${bench[@]}" kernels --lengths 16384 --head-dims 128 \
    --decode-lengths 32768 131072 1048576 --write "$out/benchmarks.md"
step 130 "long-context" "${bench[@]}" long-context --shapes llama-1b --prompt 32768 --repeats 1 \
    --write "$out/benchmarks.md"
# a Hugging Face model (SmolLM2's shape) on the torch backend against transformers' continuous batching (issue 78)
step 120 "hf-serve" "${bench[@]}" hf-serve --repeats 1 --concurrency 1 64 --ttft 32768 --write "$out/benchmarks.md"
exit "$failed"
