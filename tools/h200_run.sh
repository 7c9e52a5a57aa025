#!/usr/bin/env bash
# The GPU runs on the device machine (python3 with torch 2.11, no registry), from the repo root;
# carry .whl: cp312 wheels of what the image lacks, at uv.lock's versions (msgspec, fastapi,
# starlette, opentelemetry-api, pydantic, pydantic-core, annotated-types, typing-inspection,
# uvicorn, openai, httpx2, httpcore2, truststore, jiter, sniffio, anyio, typing-extensions,
# xgrammar, apache-tvm-ffi, pyzmq, and transformers 5.24.0, whose HrmText / Dory classes the
# image's 5.17 may lack; `bash tools/fetch_device_wheels.sh` downloads them), and
# .whlpd for `pd` (tools/repack_nixl_wheel.py), .whlray for `ray-serve` (`bash
# tools/fetch_device_wheels.sh ray`: ray repacked slim and what Ray Serve needs). Results
# land in $OUT. One mode per call (each fits a 10-minute device command):
#   bash tools/h200_run.sh fp8-kv                  split-KV kernel tests, the product-order sweep
#                                                  (fp8_kv_attention_sweep.py: keys by rows, vector),
#                                                  then 128 requests bf16 / fp8 KV / both with
#                                                  the sweep's best configurations exported
#   bash tools/h200_run.sh fp8-c1                  the fp8 GEMV kernels' tests, the GEMV sweep at
#                                                  one row (fp8_gemv_sweep.py), then one request
#                                                  bf16 / fp8 weights, fixed and the 2.5-loop mix
#   bash tools/h200_run.sh tests                   the engine's CUDA tests
#   bash tools/h200_run.sh tests-all               every CUDA-marked test of the repository, then
#                                                  the kernel suites that run on CUDA when present
#   bash tools/h200_run.sh cmd COMMAND...          COMMAND with the wheels and PYTHONPATH set up
#   bash tools/h200_run.sh table [ARGS...]         the offline-throughput acceptance table
#                                                  (benchmarks/h200_table.py ARGS, under 8 min)
#   bash tools/h200_run.sh speculative [ARGS...]   speculation's CUDA tests (SPEC_TESTS=0 skips
#                                                  them), then benchmarks/speculative_decoding.py
#                                                  ARGS on the Ouro-1.4B shape in bf16
#   bash tools/h200_run.sh speculative-table a|b   issue 21's measurements in two calls: (a) the
#                                                  CUDA tests of speculation, the split-KV
#                                                  kernels, the small-batch GEMV and the engine,
#                                                  then the c1 grid (K x D x alpha) and the
#                                                  depth mix; (b) concurrencies 4/16/32 and the
#                                                  default disable limit at 32, then the bundled
#                                                  model's real acceptance
#   bash tools/h200_run.sh fp8 a|b                 issue 22 in two calls: (a) every CUDA-marked test,
#                                                  then the kernel suites that run on CUDA when it
#                                                  is there (attention, models, tick and round
#                                                  kernels), then fp8 weights at one request
#                                                  (fixed and the 2.5-loop mix, beside bf16); (b)
#                                                  the GEMV sweep, then fp8 KV and fp8 weights
#                                                  + KV at 128 requests beside bf16; (c) the fp8
#                                                  kernels' tests, the attention sweep (its
#                                                  best key step is exported as
#                                                  RLT_FP8_SPLIT_DECODE; GEMV_SWEEP=1 adds the
#                                                  GEMV sweep), c1 and c128 side by
#                                                  side, then speculation at 32 requests with
#                                                  the default disable limit
#   bash tools/h200_run.sh families [ARGS...]      issue 38: decode tok/s of each family's
#                                                  release shape (random bf16 weights; Ouro-1.4B,
#                                                  Nanbeige4.2-3B, HRM-Text-1B and Dory-4B by
#                                                  default) at 1 / 32 / 128 requests, its
#                                                  bandwidth floor at 1 request and layer passes
#                                                  per second, and for HRM-Text and Dory
#                                                  transformers' own generate at 1 and 32
#                                                  requests beside rlt (--no-transformers: rlt
#                                                  alone) (benchmarks/family_speed.py ARGS, ~8
#                                                  min, no run past BUDGET_S=530 s; files in
#                                                  $OUT/families.tgz, the table families.md)
#   bash tools/h200_run.sh huginn [ARGS...]        issue 39 item 8 (~7 min): Huginn-0125's CUDA
#                                                  tests (HUGINN_TESTS=0 skips them), then its
#                                                  release shape (random bf16, recurrent block
#                                                  at std 0.002: workload.py) at 1,024 in / 128
#                                                  out, max_model_loops 32: fixed 32 steps, the
#                                                  trace's exits (uniform on 4..20) and live
#                                                  latent_diff exits (threshold LATENT=0.03) at
#                                                  1 / 32 / 8 requests (last_exited); fixed and
#                                                  trace at 128 (ring:8, fp8 KV); fixed at 32
#                                                  with ring:8 (the same memory as last_exited);
#                                                  the bandwidth floor, KV bytes per token and
#                                                  requests per layout (family_speed.py ARGS;
#                                                  $OUT/huginn.json / .md / -h200.png, the runs
#                                                  in huginn.tgz; no run past BUDGET_S=540 s
#                                                  from the start, tests included)
#   bash tools/h200_run.sh pdl-loop [ARGS...]      one fused decode loop with and without
#                                                  programmatic dependent launch, side by side
#                                                  (benchmarks/kernel_bench.py --sections pdl
#                                                  ARGS, ~1 min)
#   bash tools/h200_run.sh batch-invariance        batch-invariant mode: its tests on CUDA, then
#                                                  its invariance and cost (Ouro-1.4B shape)
#   bash tools/h200_run.sh served                  issue 23: served against offline throughput at
#                                                  C = 1/32/128, a 512-request burst, front-end and
#                                                  core CPU seconds, --api-server-count 2, and the
#                                                  start-up to healthy, cold and warm
#                                                  (benchmarks/serving_arms.py --arms
#                                                  serve,serve_api2 --offline ARGS)
#   bash tools/h200_run.sh served-ab               issue 23's scheduling A/B in one call (~7 min):
#                                                  per arm the offline engine and its own `rlt
#                                                  serve`, C = 32 (64 requests), C = 128 (256)
#                                                  and a 384-request burst; ARMS (JSON) replaces
#                                                  the arms: base (today's rule), auto
#                                                  (--prefill-step-decode-ticks auto), delay
#                                                  (--scheduler-delay-factor 0.5); extra ARGS go
#                                                  to benchmarks/serving_arms.py
#   bash tools/h200_run.sh ray-serve [ARGS...]     issue 24: `rlt ray serve --replicas 1` (one GPU
#                                                  replica) against `rlt serve`, the same `rlt
#                                                  bench serve` runs: 1,024 in / 128 out, C = 32
#                                                  (128 requests) and 128 (384), twice each,
#                                                  B / A per C (benchmarks/serving_arms.py ARGS,
#                                                  ~6 min; --arms serve,ray,serve re-runs A;
#                                                  --arms serve,ray,ray_process adds the
#                                                  replica's engine core in its own process);
#                                                  carry .whl and .whlray
#   bash tools/h200_run.sh scoring                 issue 25: prompt-scoring throughput (full depth, exit
#                                                  depth) against plain prefill, Ouro-1.4B shape
#                                                  (benchmarks/prompt_scoring.py ARGS)
#   bash tools/h200_run.sh serving-sweep           issue 10's request-rate sweep: `rlt serve` at
#                                                  fixed depth 4 and with the trace exit policy's
#                                                  2.5-loop mix (side by side on 2 GPUs, else one
#                                                  after the other)
#   bash tools/h200_run.sh pd                      NIXL tests on CUDA, then VRAM-to-VRAM KV transfer
#                                                  and 1P1D against 2 replicas: P and D on two GPUs
#                                                  (nvidia-h200-x2), else both on one at 0.45 each;
#                                                  carry .whlpd (slim NIXL wheels) too
#   bash tools/h200_run.sh pd-transfer             rlt-pd's tests, then KV transfers on the GPU(s)
#                                                  at NIXL progress-thread delays $DELAYS (0,100)
#                                                  side by side (pd_transfer.py --quick); carry
#                                                  .whlpd
#   bash tools/h200_run.sh flash-attn [STEPS]      flash-attn 2 built from its sdist (head dim 128,
#                                                  forward only, sm_90; 9 files: 3.7 min on 2 cores),
#                                                  its adapter tests on CUDA, then Triton vs
#                                                  flash-attn (tools/build_flash_attn.sh
#                                                  STEPS, default build test bench); carry .fa
#                                                  (the sdist, 8 MiB) too
set -uo pipefail
mode=${1:-table}
shift || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl $(ls .whlpd/*.whl .whlray/*.whl 2>/dev/null) || exit 1
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src "$PWD"/services/*/src | paste -sd:) PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$mode" in
  tests|tests-all)
    tests=(tests/test_cuda_engine.py)
    [ "$mode" = tests-all ] && tests=(tests packages services)
    python3 -m pytest -q -p no:cacheprovider -m cuda "${tests[@]}" 2>&1 | tee "$OUT/cuda_tests.log" | tail -4
    # tests-all: also the kernel suites that run compiled on CUDA when it is there
    [ "$mode" = tests ] || python3 -m pytest -q -p no:cacheprovider -m "not cuda" \
      packages/rlt-attention/tests packages/rlt-models/tests tests/test_speculative_kernels.py \
      tests/test_tick_kernels.py 2>&1 | tee "$OUT/kernel_tests.log" | tail -3 ;;
  table)
    python3 benchmarks/h200_table.py --out "$OUT/table" "$@" ;;
  cmd)  # any command, with the wheels and PYTHONPATH above
    "$@" ;;
  speculative)
    [ "${SPEC_TESTS:-1}" = 0 ] || python3 -m pytest -q -p no:cacheprovider tests/test_cuda_speculative.py tests/test_speculative_kernels.py \
      2>&1 | tee "$OUT/spec_tests.log" | tail -25
    python3 benchmarks/speculative_decoding.py --shape ouro-1.4b --device cuda --dtype bfloat16 \
      --out "$OUT/speculative.json" "$@" ;;
  speculative-table)
    b=(python3 benchmarks/speculative_decoding.py --shape ouro-1.4b --device cuda --dtype bfloat16)
    if [ "${1:-a}" = a ]; then
      python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_speculative.py \
        tests/test_cuda_engine.py packages/rlt-attention/tests/test_split_decode.py \
        packages/rlt-models/tests/test_small_batch_linear.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -3
      python3 -m pytest -q -p no:cacheprovider tests/test_speculative_kernels.py 2>&1 \
        | tee -a "$OUT/cuda_tests.log" | tail -1
      "${b[@]}" --concurrency 1 --drafts 2,3,4,8 --draft-loops 1,2 --alphas 0.6,0.8,0.9 --no-real \
        --out "$OUT/spec_c1.json" >"$OUT/spec_c1.log" 2>&1
      "${b[@]}" --concurrency 1 --drafts 3,4 --draft-loops 1 --alphas 0.9 --mix \
        --out "$OUT/spec_mix.json" >"$OUT/spec_mix.log" 2>&1
    else
      "${b[@]}" --concurrency 1 --drafts 2,3,4,8 --draft-loops 1,2 --alphas 0.6,0.8,0.9 --no-real \
        --out "$OUT/spec_c1.json" >"$OUT/spec_c1.log" 2>&1
      "${b[@]}" --concurrency 4,16,32 --drafts 3 --draft-loops 1 --alphas 0.9 --no-real \
        --out "$OUT/spec_sweep.json" >"$OUT/spec_sweep.log" 2>&1
      "${b[@]}" --concurrency 32 --drafts 3 --draft-loops 1 --alphas 0.9 --no-real \
        --disable-batch-size default --repeats 2 --step-log --out "$OUT/spec_c32_default.json" >/dev/null 2>&1
      python3 benchmarks/speculative_decoding.py --heldout --device cuda --dtype bfloat16 \
        --num-prompts 12 --output-len 48 --draft-loops 1,2 --out "$OUT/acceptance_h200.json" \
        >/dev/null 2>&1
    fi
    tail -2 "$OUT"/*.log ;;
  fp8)
    b=(python3 benchmarks/offline_throughput.py --shape ouro-1.4b --checkpoint-dir /tmp/rlt-bench-checkpoints
       --device cuda --dtype bfloat16 --prompt-len 1024 --output-len 128 --prefill-chunk-size 1024)
    mix=trace:0.55,0.40,0.05
    if [ "${1:-a}" = a ]; then
      timeout "${TEST_S:-300}" python3 -m pytest -q -p no:cacheprovider -m cuda tests packages services \
        2>&1 | tee "$OUT/cuda_tests.log" | tail -3
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m "not cuda" packages/rlt-attention/tests \
        packages/rlt-models/tests tests/test_speculative_kernels.py tests/test_tick_kernels.py 2>&1 \
        | tee "$OUT/kernel_tests.log" | tail -3
      "${b[@]}" --num-requests 4 --max-num-seqs 1 --max-num-batched-tokens 1100 --arm fixed \
        --arm fixed@fp8 --arm $mix --arm $mix@fp8 --json-out "$OUT/fp8_c1.json" >"$OUT/fp8_c1.log" 2>&1
    elif [ "$1" = c ]; then
      python3 -m pytest -q -p no:cacheprovider packages/rlt-attention/tests/test_fp8_kv.py \
        packages/rlt-attention/tests/test_split_decode.py packages/rlt-models/tests/test_fp8_linear.py \
        packages/rlt-models/tests/test_small_batch_linear.py 2>&1 | tee "$OUT/fp8_tests.log" | tail -2
      python3 benchmarks/fp8_kv_attention_sweep.py --out "$OUT/fp8_kv_attention_sweep.json" \
        >"$OUT/fp8_kv_attention_sweep.log" 2>&1
      export RLT_FP8_SPLIT_DECODE=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['summary']['env'])" \
        "$OUT/fp8_kv_attention_sweep.json")
      echo "RLT_FP8_SPLIT_DECODE=$RLT_FP8_SPLIT_DECODE" | tee "$OUT/fp8_split_env.txt"
      [ "${GEMV_SWEEP:-0}" = 0 ] || python3 benchmarks/fp8_gemv_sweep.py --rows 1,4 \
        --out "$OUT/fp8_gemv_sweep.json" >"$OUT/fp8_gemv_sweep.log" 2>&1
      "${b[@]}" --num-requests 4 --max-num-seqs 1 --max-num-batched-tokens 1100 --arm fixed \
        --arm fixed@fp8 --arm $mix --arm $mix@fp8 --json-out "$OUT/fp8_c1.json" >"$OUT/fp8_c1.log" 2>&1
      "${b[@]}" --num-requests 256 --max-num-seqs 128 --max-num-batched-tokens 4096 --arm fixed \
        --arm fixed@kv_fp8 --arm fixed@fp8@kv_fp8 --json-out "$OUT/fp8_c128.json" >"$OUT/fp8_c128.log" 2>&1
      timeout "${SPEC_S:-150}" python3 benchmarks/speculative_decoding.py --shape ouro-1.4b --device cuda \
        --dtype bfloat16 --concurrency 32 --drafts 3 --draft-loops 1 --alphas 0.9 --no-real \
        --disable-batch-size default --repeats 2 --out "$OUT/spec_c32_default.json" >"$OUT/spec_c32.log" 2>&1
      tail -n 4 "$OUT/spec_c32.log" "$OUT/fp8_kv_attention_sweep.log"
    else
      python3 benchmarks/fp8_gemv_sweep.py --rows 1,4,16 --out "$OUT/fp8_gemv_sweep.json" \
        >"$OUT/fp8_gemv_sweep.log" 2>&1
      "${b[@]}" --num-requests 256 --max-num-seqs 128 --max-num-batched-tokens 4096 --arm fixed \
        --arm fixed@kv_fp8 --arm fixed@fp8@kv_fp8 --json-out "$OUT/fp8_c128.json" >"$OUT/fp8_c128.log" 2>&1
    fi
    tail -n 14 "$OUT"/fp8_*.log ;;
  fp8-c1)  # issue 22 at one request: the fp8 GEMV kernels' tests, the GEMV sweep at one row,
    # then bf16 against fp8 weights at one request (fixed depth and the 2.5-loop mix)
    python3 -m pytest -q -p no:cacheprovider packages/rlt-models/tests/test_fp8_gemv.py \
      packages/rlt-models/tests/test_fp8_linear.py packages/rlt-models/tests/test_small_batch_linear.py \
      packages/rlt-models/tests/test_kernel_choice_cache.py 2>&1 | tee "$OUT/fp8_gemv_tests.log" | tail -2
    python3 benchmarks/fp8_gemv_sweep.py --rows 1 --out "$OUT/fp8_gemv_rows1.json" \
      >"$OUT/fp8_gemv_rows1.log" 2>&1
    tail -n 12 "$OUT/fp8_gemv_rows1.log"
    python3 benchmarks/offline_throughput.py --shape ouro-1.4b --checkpoint-dir /tmp/rlt-bench-checkpoints \
      --device cuda --dtype bfloat16 --prompt-len 1024 --output-len 128 --prefill-chunk-size 1024 \
      --num-requests 4 --max-num-seqs 1 --max-num-batched-tokens 1100 --arm fixed --arm fixed@fp8 \
      --arm trace:0.55,0.40,0.05 --arm trace:0.55,0.40,0.05@fp8 --json-out "$OUT/fp8_c1.json" \
      >"$OUT/fp8_c1.log" 2>&1
    tail -n 8 "$OUT/fp8_c1.log" ;;
  fp8-kv)  # the split-KV product orders: CUDA tests, the sweep, then 128 requests with its best
    python3 -m pytest -q -p no:cacheprovider packages/rlt-attention/tests/test_fp8_kv.py \
      packages/rlt-attention/tests/test_split_decode.py 2>&1 | tee "$OUT/split_tests.log" | tail -2
    python3 benchmarks/fp8_kv_attention_sweep.py --products keys_by_rows,vector --out "$OUT/kv_sweep.json" \
      >"$OUT/kv_sweep.log" 2>&1
    tail -n 1 "$OUT/kv_sweep.log"
    get() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['summary'][sys.argv[2]])" "$OUT/kv_sweep.json" "$1"; }
    export RLT_FP8_SPLIT_DECODE=$(get env)
    bf16_env=$(get bf16_env)
    [ -z "$bf16_env" ] || export RLT_SPLIT_DECODE=$bf16_env
    echo "RLT_FP8_SPLIT_DECODE=$RLT_FP8_SPLIT_DECODE RLT_SPLIT_DECODE=${RLT_SPLIT_DECODE:-}" | tee "$OUT/split_env.txt"
    [ "${ENGINE:-1}" = 0 ] || python3 benchmarks/offline_throughput.py --shape ouro-1.4b \
      --checkpoint-dir /tmp/rlt-bench-checkpoints --device cuda --dtype bfloat16 --prompt-len 1024 \
      --output-len 128 --prefill-chunk-size 1024 --num-requests 256 --max-num-seqs 128 \
      --max-num-batched-tokens 4096 --arm fixed --arm fixed@kv_fp8 --arm fixed@fp8@kv_fp8 \
      --json-out "$OUT/fp8_c128.json" >"$OUT/fp8_c128.log" 2>&1
    tail -n 6 "$OUT/fp8_c128.log" ;;
  families)
    timeout "${FAMILIES_S:-550}" python3 benchmarks/family_speed.py --out "$OUT/families" \
      --budget-s "${BUDGET_S:-530}" "$@" 2>&1 | tee "$OUT/families.log" | tail -24
    rc=${PIPESTATUS[0]}
    cp "$OUT/families/families.md" "$OUT/families.md"
    tar czf "$OUT/families.tgz" -C "$OUT" families && rm -rf "$OUT/families"
    exit $rc ;;
  huginn)
    start=$SECONDS trace=trace:uniform:4-20 latent=latent_diff:${LATENT:-0.03}
    [ "${HUGINN_TESTS:-1}" = 0 ] || timeout 150 python3 -m pytest -q -p no:cacheprovider \
      tests/test_cuda_huginn.py 2>&1 | tee "$OUT/huginn_cuda_tests.log" | tail -3
    timeout $(( ${BUDGET_S:-540} + 20 - (SECONDS - start) )) python3 benchmarks/family_speed.py \
      --out "$OUT/huginn" --shapes huginn-3.5b --no-transformers --waves 1 --run-timeout-s 300 \
      --budget-s $(( ${BUDGET_S:-540} - (SECONDS - start) )) --arm fixed --arm $trace --arm $latent \
      --engine-args="--max-model-loops 32 --warmup-prompt-len 64" \
      --concurrency "1,32,128/ring:8@kv_fp8=fixed+$trace,32/ring:8=fixed,8" "$@" 2>&1 \
      | tee "$OUT/huginn.log" | tail -24
    rc=${PIPESTATUS[0]}
    cp "$OUT/huginn/families.json" "$OUT/huginn.json"; cp "$OUT/huginn/families.md" "$OUT/huginn.md"
    python3 benchmarks/plots.py huginn --record "$OUT/huginn.json" --out "$OUT/huginn-h200.png" \
      || echo "no plot here: uv run --with matplotlib python benchmarks/plots.py huginn --record huginn.json"
    tar czf "$OUT/huginn.tgz" -C "$OUT" huginn && rm -rf "$OUT/huginn"
    exit $rc ;;
  pdl-loop)
    python3 benchmarks/kernel_bench.py --sections pdl --batch-sizes 1,2,4,8,16,32,128 \
      --out "$OUT/dependent_launch_loop.json" "$@" ;;
  batch-invariance)  # BI_TESTS=0: the benchmark only
    [ "${BI_TESTS:-1}" = 0 ] || python3 -m pytest -q -p no:cacheprovider tests/test_batch_invariance.py \
      packages/rlt-models/tests/test_batch_invariant_ops.py \
      packages/rlt-attention/tests/test_batch_invariant_attention.py 2>&1 | tee "$OUT/bi_tests.log" | tail -4
    python3 benchmarks/batch_invariance.py --device cuda --shape ouro-1.4b --dtype bfloat16 \
      --batch 1 --batch 8 --batch 32 --batch 128 --prompt-len 1024 --output-len 64 \
      --max-num-seqs 128 --max-num-batched-tokens 4096 --prefill-chunk-size 1024 \
      --json-out "$OUT/batch_invariance_h200.json" "$@" ;;
  served)
    ckdir=/tmp/rlt-bench-checkpoints
    python3 benchmarks/offline_throughput.py --shape ouro-1.4b --device cuda \
      --checkpoint-dir $ckdir --write-checkpoint-only || exit 1
    python3 benchmarks/serving_arms.py $ckdir/ouro-1.4b --out "$OUT/served_vs_offline.json" \
      --arms serve,serve_api2 --offline --cold-start --dtype bfloat16 --log-level info \
      --points 1:8,32:96,128:384 --burst 512 --warmup 0 "$@" 2>&1 \
      | tee "$OUT/served_vs_offline.log" | tail -8 ;;
  served-ab)
    ckdir=/tmp/rlt-bench-checkpoints
    arms=${ARMS:-'{"base": {}, "auto": {"prefill_step_decode_ticks": "auto"}, "delay": {"scheduler_delay_factor": 0.5}}'}
    python3 benchmarks/offline_throughput.py --shape ouro-1.4b --device cuda \
      --checkpoint-dir $ckdir --write-checkpoint-only || exit 1
    names=$(python3 -c "import json, sys; print(','.join(n + ':serve' for n in json.loads(sys.argv[1])))" "$arms")
    python3 benchmarks/serving_arms.py $ckdir/ouro-1.4b --out "$OUT/served_ab.json" \
      --arms "$names" --arm-options "$arms" --offline --dtype bfloat16 --log-level info \
      --points 32:64,128:256 --burst 384 "$@" 2>&1 | tee "$OUT/served_ab.log" | tail -8 ;;
  ray-serve)
    ckdir=/tmp/rlt-bench-checkpoints
    export PATH=/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0
    python3 -c "import ray, grpc, google.protobuf as p, aiohttp; print('ray', ray.__version__,
      'grpcio', grpc.__version__, 'protobuf', p.__version__, 'aiohttp', aiohttp.__version__)" || exit 1
    mkdir -p "$OUT/logs"
    python3 benchmarks/offline_throughput.py --shape ouro-1.4b --checkpoint-dir $ckdir \
      --device cuda --dtype bfloat16 --write-checkpoint-only >"$OUT/logs/checkpoint.log" 2>&1 \
      || { tail -20 "$OUT/logs/checkpoint.log"; exit 1; }
    timeout ${RAY_SERVE_S:-420} python3 benchmarks/serving_arms.py $ckdir/ouro-1.4b \
      --arms serve,ray --device cuda --dtype bfloat16 --repeats 2 --warmup 32 \
      --out "$OUT/ray_vs_serve.json" --log-dir "$OUT/logs" "$@" 2>&1 | tee "$OUT/ray_vs_serve.log"
    rc=${PIPESTATUS[0]}
    ray stop --force >/dev/null 2>&1  # whatever Ray left on this machine
    (cd /tmp/ray/session_latest/logs 2>/dev/null && grep -h "Error\|cannot be loaded" *.err *.log \
      2>/dev/null | grep -v "_head\b" | sort | uniq -c | sort -rn | head -20) >"$OUT/logs/ray_errors.txt"
    tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
    exit $rc ;;
  scoring)
    python3 benchmarks/prompt_scoring.py --shape ouro-1.4b --device cuda --dtype bfloat16 \
      --out "$OUT/prompt_scoring.json" "$@" 2>&1 | tee "$OUT/prompt_scoring.log" | tail -5 ;;
  serving-sweep)
    ckdir=/tmp/rlt-bench-checkpoints; ck=$ckdir/ouro-1.4b; rates=${RATES:-4,8,16,32,inf}
    python3 benchmarks/offline_throughput.py --shape ouro-1.4b --device cuda \
      --checkpoint-dir $ckdir --write-checkpoint-only || exit 1
    # one depth list for every request (the server makes up request ids): token 0 at full
    # depth, then 2/3/4 loops with probabilities 0.55/0.40/0.05 (mean 2.5), as in h200_table.py
    python3 -c "import json, random; r = random.Random(1); json.dump({'*': [4] + r.choices(
      [2, 3, 4], weights=[0.55, 0.40, 0.05], k=4095)}, open('/tmp/mix25.json', 'w'))"
    arm() {  # NAME GPU PORT [serve flags]: serve, warm up, sweep, stop
      local name=$1 gpu=$2 port=$3; shift 3
      CUDA_VISIBLE_DEVICES=$gpu python3 -m rlt.cli serve --model $ck --dtype bfloat16 \
        --max-num-seqs 128 --max-num-batched-tokens 4096 --prefill-chunk-size 1024 \
        --log-level warning --port $port "$@" >"$OUT/serve-$name.log" 2>&1 &
      local server=$!
      until curl -sf localhost:$port/health >/dev/null; do
        kill -0 $server || { tail -20 "$OUT/serve-$name.log"; return 1; }; sleep 1
      done
      local b=(python3 -m rlt.cli bench serve --port $port --dataset-name random
        --random-input-len 512 --random-output-len 128 --ignore-eos --disable-tqdm)
      "${b[@]}" --num-prompts 16 --request-rate inf >/dev/null 2>&1
      "${b[@]}" --num-prompts ${NUM_PROMPTS:-200} --sweep-request-rates $rates --save-result \
        --result-dir /tmp/sweep-$name >"$OUT/bench-$name.log" 2>&1
      kill -INT $server; timeout 60 tail --pid=$server -f /dev/null || kill -KILL $server
    }
    fixed=(--exit-threshold 1.0)  # every token at full depth (the default threshold exits early)
    mix=(--exit-policy trace --exit-trace /tmp/mix25.json)
    arms=${ARMS:-fixed,mix}  # ARMS=fixed or ARMS=mix re-runs one arm
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && [ "$arms" = fixed,mix ]; then  # one GPU each
      arm fixed 0 8100 "${fixed[@]}" & a=$!; arm mix 1 8101 "${mix[@]}" & b=$!; wait $a $b
    else  # one after the other on the one GPU
      [[ $arms == *fixed* ]] && arm fixed 0 8100 "${fixed[@]}"
      [[ $arms == *mix* ]] && arm mix 0 8101 "${mix[@]}"
    fi
    [ "$arms" = fixed,mix ] || { tar czf "$OUT/sweeps.tgz" -C /tmp sweep-$arms; exit; }
    python3 benchmarks/plots.py serving-sweeps --sweep "fixed depth (4 loops)" /tmp/sweep-fixed \
      --sweep "trace mix (2.5 loops)" /tmp/sweep-mix --out "$OUT/h200-serving-sweep.png" \
      --title "rlt serve on H200: random Ouro-1.4B shape, 512 in / 128 out"
    tar czf "$OUT/sweeps.tgz" -C /tmp sweep-fixed sweep-mix
    tail -n 8 "$OUT/bench-fixed.log" "$OUT/bench-mix.log" ;;
  pd)
    python3 -m pytest -q -p no:cacheprovider tests/test_pd_endpoints.py tests/test_pd_processes.py \
      packages/rlt-pd/tests/test_nixl_transport.py 2>&1 | tee "$OUT/pd_tests.log" | tail -3
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then devices=cuda:0,cuda:1 share=0.9
    else devices=cuda:0 share=0.45; fi
    python3 benchmarks/pd_transfer.py --device $devices --out "$OUT/pd_transfer_h200.json"
    ckdir=/tmp/rlt-bench-checkpoints
    python3 benchmarks/offline_throughput.py --shape ouro-1.4b --device cuda \
      --checkpoint-dir $ckdir --write-checkpoint-only || exit 1
    points=$(IFS=,; for rate in ${RATES:-4,8,16,32}; do printf 'r%s:%s,' $rate ${NUM_PROMPTS:-100}; done)
    python3 benchmarks/serving_arms.py $ckdir/ouro-1.4b --arms pd,replicas --device $devices \
      --dtype bfloat16 --exit-threshold none --input-len 512 --output-len 64 --points "$points" \
      --warmup 4 --out "$OUT/pd_serving_h200.json" --engine-json "{\"max_num_seqs\": 64, \
      \"max_num_batched_tokens\": 4096, \"prefill_chunk_size\": 1024, \"gpu_memory_utilization\": $share}" ;;
  pd-transfer)
    python3 -m pytest -q -p no:cacheprovider packages/rlt-pd/tests 2>&1 | tee "$OUT/pd_tests.log" \
      | tail -3
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then devices=cuda:0,cuda:1; else devices=cuda:0; fi
    python3 benchmarks/pd_transfer.py --device $devices --quick --tables contiguous \
      --progress-delay-us "${DELAYS:-0,100}" --out "$OUT/pd_transfer_delay_h200.json" ;;
  flash-attn)
    bash tools/build_flash_attn.sh "$@" ;;
  *)
    echo "usage: $0 tests|tests-all|table|families|huginn|batch-invariance|serving-sweep|pd|ray-serve|flash-attn [args]" >&2
    exit 2 ;;
esac
