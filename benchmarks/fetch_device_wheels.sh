#!/usr/bin/env bash
# Download into .whl/ the cp312 manylinux wheels that the GPU machine's image lacks, at uv.lock's
# versions (the image has torch, triton, numpy, transformers, tokenizers, ...; no registry).
# benchmarks/h200_run.sh installs them there; pass `.whl` in the device call's carry.
set -euo pipefail
cd "$(dirname "$0")/.."
names="msgspec fastapi starlette opentelemetry-api pydantic pydantic-core annotated-types
  typing-inspection uvicorn openai httpx2 httpcore2 truststore jiter sniffio anyio
  typing-extensions xgrammar apache-tvm-ffi pyzmq"
pins=$(python3 - $names <<'PY'
import sys, tomllib
versions = {p["name"]: p["version"] for p in tomllib.load(open("uv.lock", "rb"))["package"] if "version" in p}
print(" ".join(f"{n}=={versions[n]}" for n in sys.argv[1:]))
PY
)
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 --dest .whl $pins
ls .whl
