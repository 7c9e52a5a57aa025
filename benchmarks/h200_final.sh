#!/usr/bin/env bash
# Short GPU re-run after host-side fixes: the engine's CUDA tests and the graph arms of the
# throughput benchmark (eager arms are in h200_run.sh). Same environment as h200_run.sh.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src "$PWD"/services/*/src | paste -sd:) PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_engine.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -2
bench() { python3 benchmarks/offline_throughput.py --shape ouro-1.4b --device cuda --dtype bfloat16 \
  --checkpoint-dir /tmp/ckpt --prompt-len 512 --max-num-batched-tokens 1024 --prefill-chunk-size 512 "$@" 2>&1 | tail -5; }
MIX=trace:0.55,0.40,0.05
bench --num-requests 128 --output-len 128 --max-num-seqs 64 --json-out "$OUT/bench_c64.json" --arm fixed --arm $MIX --arm $MIX@no_refill
bench --num-requests 16 --output-len 64 --max-num-seqs 8 --json-out "$OUT/bench_c8.json" --arm fixed --arm $MIX
