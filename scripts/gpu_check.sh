#!/usr/bin/env bash
# The GPU checks, for an offline GPU host with this checkout (no install; the source tree is imported):
# the GPU test tier, the step benchmark (bench_gpu.py) and, when the demo target is at $DSPARK_TARGET, the
# real-pair benchmark against transformers' compiled generate. Logs and JSON go to ${OUT:-gpu-out}.
# usage: OUT=dir [DSPARK_TARGET=dir] bash scripts/gpu_check.sh [quick]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -P -m pytest -q -rs tests/gpu 2>&1 | tee "$out/gpu_tests.log" | tail -15
models=(8b 0.6b); [ "${1:-}" = quick ] && models=(0.6b)
python3 bench/bench_gpu.py --models "${models[@]}" --json "$out/bench_gpu.json" 2>&1 | tee "$out/bench_gpu.log" | tail -40
if [ -n "${DSPARK_TARGET:-}" ] && [ -f "$DSPARK_TARGET/config.json" ]; then
    python3 bench/bench_pair.py --target "$DSPARK_TARGET" --accept-batch 64 --speed-prompts 8 --hf-baseline \
        --json "$out/bench_pair.json" 2>&1 | tee "$out/bench_pair.log" | tail -20
fi
