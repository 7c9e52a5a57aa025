#!/usr/bin/env bash
# The offline table (Ouro-1.4B shape, random bf16, 1,024 in / 128 out, fixed depth, LAST_EXITED)
# of two commits side by side on one GPU: each commit's own benchmarks/offline_throughput.py
# over its own src, on one checkpoint, rows interleaved (c1 A, c1 B, c32 A, ...; then c1 again
# in the other order) so that drift hits both. Issue 40's "no behaviour change" check.
#   bash tools/offline_ab.sh pack A B    # here: .runs/snap/{A,B}.tar.gz (git archive, less
#                                        # results, figures and the bundled weights)
#   run(command="bash tools/offline_ab.sh run A B", carry=[".whl", ".runs/snap"])  # device
# One line per run on stdout (also $OUT/ab.txt); each run's JSON and log in $OUT/ab.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
action=$1 a=$2 b=$3
if [ "$action" = pack ]; then
  mkdir -p .runs/snap
  for rev in "$a" "$b"; do
    git archive "$rev" | tar t | grep -v -E '/$|^benchmarks/results/|^docs/.*\.(png|svg)$|\.safetensors$' \
      | xargs git archive "$rev" | gzip > ".runs/snap/$rev.tar.gz"
  done
  ls -l .runs/snap
  exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for rev in "$a" "$b"; do mkdir -p "/tmp/ab/$rev" && tar xzf ".runs/snap/$rev.tar.gz" -C "/tmp/ab/$rev"; done
export PYTHONUNBUFFERED=1
mkdir -p /tmp/ab/out
run() {  # REV ROW REQUESTS SEQS TOKENS
  local tree=/tmp/ab/$1 json=/tmp/ab/out/$2-$1.json
  ( cd "$tree" && PYTHONPATH=/tmp/site:$(ls -d "$tree"/packages/*/src "$tree"/services/*/src | paste -sd:) \
    timeout 150 python3 benchmarks/offline_throughput.py --shape ouro-1.4b --device cuda \
    --dtype bfloat16 --checkpoint-dir /tmp/ab/checkpoints --seed 0 --prompt-len 1024 \
    --output-len 128 --prefill-chunk-size 1024 --num-requests "$3" --max-num-seqs "$4" \
    --max-num-batched-tokens "$5" --arm fixed --json-out "$json" > "/tmp/ab/out/$2-$1.log" 2>&1 )
  local rc=$?
  echo "$(date +%T) $2 $1 rc=$rc $(python3 -c "import json; r = json.load(open('$json'))['results'][0]
print({k: r[k] for k in ('decode_output_tokens_per_s', 'output_tokens_per_s')})" 2>&1 | tail -1)" | tee -a "$OUT/ab.txt"
}
SECONDS=0
for row in "c1 4 1 1100" "c32 64 32 2048" "c128 256 128 4096"; do
  set -- $row
  run "$a" "$@"; run "$b" "$@"
done
[ $SECONDS -lt 420 ] && { run "$b" c1-again 4 1 1100; run "$a" c1-again 4 1 1100; }
tar czf "$OUT/ab.tgz" -C /tmp/ab/out .
