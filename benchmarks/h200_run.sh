#!/usr/bin/env bash
# The GPU run behind docs/results.md: the engine's CUDA tests, then the offline throughput
# benchmark on a random Ouro-1.4B-shaped bf16 checkpoint (arms side by side in one process per
# setting). Runs on the device machine (python3 with torch 2.11, no registry): carry .whl (the
# msgspec cp312 wheel); results land in $OUT. Pass "all" to also run the attention and sampling
# packages' CUDA tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src "$PWD"/services/*/src | paste -sd:) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
tests=(tests/test_cuda_engine.py)
[ "${1:-}" = all ] && tests+=(packages/rlt-attention packages/rlt-sampling)
python3 -m pytest -q -p no:cacheprovider -m cuda "${tests[@]}" 2>&1 | tee "$OUT/cuda_tests.log" | tail -4
bench() { python3 benchmarks/offline_throughput.py --shape ouro-1.4b --device cuda --dtype bfloat16 \
  --checkpoint-dir /tmp/ckpt --prompt-len 512 --max-num-batched-tokens 1024 --prefill-chunk-size 512 "$@" 2>&1 | tail -8; }
MIX=trace:0.55,0.40,0.05
bench --num-requests 128 --output-len 128 --max-num-seqs 64 --json-out "$OUT/bench_c64.json" \
  --arm fixed@eager --arm fixed --arm $MIX@eager --arm $MIX --arm $MIX@no_refill
bench --num-requests 16 --output-len 64 --max-num-seqs 8 --json-out "$OUT/bench_c8.json" \
  --arm fixed@eager --arm fixed --arm $MIX
bench --num-requests 4 --output-len 64 --max-num-seqs 1 --max-num-batched-tokens 600 --json-out "$OUT/bench_c1.json" \
  --arm fixed@eager --arm fixed --arm $MIX
