#!/usr/bin/env bash
# The GPU runs on the device machine (python3 with torch 2.11, no registry), from the repo root;
# carry .whl (the msgspec cp312 wheel); results land in $OUT. One mode per call (each fits a
# 10-minute device command):
#   bash benchmarks/h200_run.sh tests              the engine's CUDA tests
#   bash benchmarks/h200_run.sh tests-all          ... plus the attention and sampling packages'
#   bash benchmarks/h200_run.sh table [ARGS...]    the offline-throughput acceptance table
#                                                  (benchmarks/h200_table.py ARGS, under 8 min)
#   bash benchmarks/h200_run.sh batch-invariance   batch-invariant mode: its tests on CUDA, then
#                                                  its invariance and cost (Ouro-1.4B shape)
set -uo pipefail
mode=${1:-table}
shift || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src "$PWD"/services/*/src | paste -sd:) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$mode" in
  tests|tests-all)
    tests=(tests/test_cuda_engine.py)
    [ "$mode" = tests-all ] && tests+=(packages/rlt-attention packages/rlt-sampling)
    python3 -m pytest -q -p no:cacheprovider -m cuda "${tests[@]}" 2>&1 | tee "$OUT/cuda_tests.log" | tail -4 ;;
  table)
    python3 benchmarks/h200_table.py --out "$OUT/table" "$@" ;;
  batch-invariance)
    python3 -m pytest -q -p no:cacheprovider tests/test_batch_invariance.py \
      packages/rlt-models/tests/test_batch_invariant_ops.py \
      packages/rlt-attention/tests/test_batch_invariant_attention.py 2>&1 | tee "$OUT/bi_tests.log" | tail -4
    python3 benchmarks/batch_invariance.py --device cuda --shape ouro-1.4b --dtype bfloat16 \
      --batch 1 --batch 8 --batch 32 --batch 128 --prompt-len 1024 --output-len 64 \
      --max-num-seqs 128 --max-num-batched-tokens 4096 --prefill-chunk-size 1024 \
      --json-out "$OUT/batch_invariance_h200.json" "$@" ;;
  *)
    echo "usage: $0 tests|tests-all|table|batch-invariance [args]" >&2; exit 2 ;;
esac
