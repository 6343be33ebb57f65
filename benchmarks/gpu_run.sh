#!/usr/bin/env bash
# One device-machine run: GPU correctness tests, then the engine benchmark for the given
# shapes. Usage (on the GPU machine, repo root): bash benchmarks/gpu_run.sh [tests] [SHAPE...]
# Wheels the machine lacks travel in .whl/ (see docs/benchmarks-engine.md).
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for arg in "$@"; do
  if [ "$arg" = tests ]; then
    python3 -m pytest -q -x -p no:cacheprovider tests/kernels tests/engine/test_gpu_engine.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  else
    python3 benchmarks/engine_bench.py --shape "$arg" ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" | grep -v "^WARNING"
  fi
done
cp benchmarks/results/engine.jsonl "$OUT/" 2>/dev/null || true
