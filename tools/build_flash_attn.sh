#!/usr/bin/env bash
# Build flash-attn 2 from its PyPI sdist, restricted to what rlt's flash_attn backend uses, then
# (optionally) run rlt's flash-attn tests and benchmark on CUDA. Runs from the repo root; the
# sdist lies in .fa/ (git-ignored: carry it), fetched on a machine with a registry by
#   FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE python3 -m pip --python .venv/bin/python download \
#     --no-deps --no-binary=:all: --no-build-isolation -d .fa flash-attn==2.8.3.post2
# (its metadata step imports torch, hence the venv's python; nothing is compiled there).
#
#   bash tools/build_flash_attn.sh [build] [test] [bench]    (default: all three)
#
# build: unpack csrc/flash_attn, csrc/cutlass/include and the flash_attn Python package into
#   $FA_BUILD/src, patch them (below) and compile the extension `flash_attn_2_cuda` with
#   torch.utils.cpp_extension (ninja, MAX_JOBS jobs) into $FA_BUILD/build; the importable result
#   is $FA_BUILD/site (flash_attn/ + flash_attn_2_cuda.so): put it on PYTHONPATH. A second run
#   with the same sdist and options rebuilds nothing (ninja) while $FA_BUILD survives (the
#   default, build/flash-attn, is git-ignored and not carried: it lasts while the device machine
#   stays warm). 9 translation units; 3.7 min with 2 jobs on a 2-core CPU (nvcc 13.0).
# What is built: forward kernels only (flash_fwd_* and flash_fwd_split_*, the split-KV path
#   that paged KV always takes), head dim 128, $FA_DTYPES (bf16 fp16), causal and not, for
#   $FA_ARCH (9.0: sm_90, FA2's sm80-style kernels). Disabled through FA2's own macros:
#   backward, dropout, alibi, softcap, local windows, head dims that are not a multiple of 32;
#   through two switches this script adds: appending new keys/values inside
#   flash_attn_with_kvcache (k=/v=; rlt stores them itself) and the "even M/N" kernel variants
#   (the general kernel serves those shapes too). HEADDIM_SWITCH / FP16_SWITCH and run_mha_bwd
#   are patched so only kernels that are compiled are referenced (else: undefined symbols at
#   import); an unsupported head dim or dtype is a RuntimeError naming this build.
# test: rlt-attention's flash-attn tests (CUDA + the CPU adapter tests), log in $OUT.
# bench: benchmarks/kernel_bench.py --sections attention,prefill (Triton vs flash-attn, Ouro-1.4B).
# test and bench need rlt's dependencies importable (tools/h200_run.sh flash-attn sets
# them up from .whl). Environment: OUT (default /tmp/fa_out), FA_BUILD (build/flash-attn),
# FA_SDIST (newest .fa/flash_attn-*.tar.gz), FA_DTYPES ("bf16 fp16"; "bf16" builds half the
# kernels), FA_ARCH (9.0), MAX_JOBS (nproc), PYTHON (python3).
set -uo pipefail
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test bench)
OUT=${OUT:-/tmp/fa_out}
FA_BUILD=${FA_BUILD:-$PWD/build/flash-attn}
FA_DTYPES=${FA_DTYPES:-bf16 fp16}
FA_ARCH=${FA_ARCH:-9.0}
PYTHON=${PYTHON:-python3}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
# torch finds CUDA through `which nvcc`, which can be a wrapper script outside the toolkit
[ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
mkdir -p "$OUT" "$FA_BUILD"
site=$FA_BUILD/site
repo=$PWD
has() { [[ " ${steps[*]} " == *" $1 "* ]]; }

if has build; then
  FA_SDIST=${FA_SDIST:-$(ls -t "$repo"/.fa/flash_attn-*.tar.gz 2>/dev/null | head -1)}
  [ -f "$FA_SDIST" ] || { echo "no flash-attn sdist in .fa/ (carry .fa; see this script's header)" >&2; exit 1; }
  start=$(date +%s)
  # what the compile needs besides torch: nvcc, a host C++ compiler, ninja, Python's headers
  "$PYTHON" - <<'EOF' || exit 1
import os, shutil, subprocess, sysconfig
from torch.utils import cpp_extension
header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
missing = [n for n in ("c++", "ninja") if shutil.which(n) is None]
missing += [] if os.path.exists(header) else [header]
nvcc = os.path.join(cpp_extension.CUDA_HOME or "", "bin", "nvcc")
missing += [] if os.path.exists(nvcc) else [f"nvcc (CUDA_HOME={cpp_extension.CUDA_HOME})"]
if missing:
    raise SystemExit(f"cannot build flash-attn here, missing: {', '.join(missing)}")
print(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.splitlines()[-1])
EOF
  # Unpack + patch once per (sdist, dtypes): re-extracting would touch every source and make
  # ninja rebuild everything.
  stamp="$(basename "$FA_SDIST") dtypes=$FA_DTYPES"
  if [ "$(cat "$FA_BUILD/src/.stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$FA_BUILD/src" && mkdir -p "$FA_BUILD/src"
    top=$(tar tzf "$FA_SDIST" | head -1 | cut -d/ -f1)
    tar xzf "$FA_SDIST" -C "$FA_BUILD/src" --strip-components=1 \
      "$top/csrc/flash_attn" "$top/csrc/cutlass/include" "$top/flash_attn" "$top/LICENSE" || exit 1
    FA_DTYPES=$FA_DTYPES "$PYTHON" - "$FA_BUILD/src/csrc/flash_attn" <<'EOF' || exit 1
import os, re, sys
from pathlib import Path

root = Path(sys.argv[1])


def patch(path, old, new, count=1):
    path = root / path
    text = path.read_text()
    found = text.count(old)
    if found != count:
        sys.exit(f"patch failed: {path} holds {found} copies of {old[:60]!r}, expected {count}")
    path.write_text(text.replace(old, new))


# Head dim 128 only: the switch instantiates one kernel family and refuses the rest.
switch = (root / "src/static_switch.h").read_text()
old = re.search(r"#define HEADDIM_SWITCH\(HEADDIM, \.\.\.\).*?\}\(\)\n", switch, re.S)
if old is None:
    sys.exit("patch failed: no HEADDIM_SWITCH in static_switch.h")
patch("src/static_switch.h", old.group(0), r"""#define HEADDIM_SWITCH(HEADDIM, ...)                                     \
  [&] {                                                                  \
    TORCH_CHECK(HEADDIM > 96 && HEADDIM <= 128, "this flash-attn build "  \
                "(rlt, tools/build_flash_attn.sh) has head dim 128 only, got ", HEADDIM); \
    constexpr static int kHeadDim = 128;                                 \
    return __VA_ARGS__();                                                \
  }()
""")
if os.environ["FA_DTYPES"].split() == ["bf16"]:
    old = re.search(r"#define FP16_SWITCH\(COND, \.\.\.\).*?\}\(\)\n", switch, re.S)
    patch("src/static_switch.h", old.group(0), r"""#define FP16_SWITCH(COND, ...)                                           \
  [&] {                                                                  \
    TORCH_CHECK(!(COND), "this flash-attn build (rlt) has bfloat16 only"); \
    using elem_type = cutlass::bfloat16_t;                               \
    return __VA_ARGS__();                                                \
  }()
""")
# Two switches of our own, in FA2's style: no append-KV kernels, no even-M/N kernels.
patch("src/static_switch.h", "#define FP16_SWITCH", r"""#ifdef FLASHATTENTION_DISABLE_APPEND_KV
  #define APPEND_KV_SWITCH(COND, CONST_NAME, ...) \
  [&] {                                           \
    constexpr static bool CONST_NAME = false;     \
    return __VA_ARGS__();                         \
  }()
#else
  #define APPEND_KV_SWITCH BOOL_SWITCH
#endif

#ifdef FLASHATTENTION_DISABLE_EVEN_MN
  #define EVEN_MN_SWITCH(COND, CONST_NAME, ...)   \
  [&] {                                           \
    constexpr static bool CONST_NAME = false;     \
    return __VA_ARGS__();                         \
  }()
#else
  #define EVEN_MN_SWITCH BOOL_SWITCH
#endif

#define FP16_SWITCH""")
patch("src/flash_fwd_launch_template.h", "BOOL_SWITCH(is_even_MN, IsEvenMNConst,",
      "EVEN_MN_SWITCH(is_even_MN, IsEvenMNConst,", count=2)
patch("src/flash_fwd_launch_template.h", "BOOL_SWITCH(params.knew_ptr != nullptr, Append_KV,",
      "APPEND_KV_SWITCH(params.knew_ptr != nullptr, Append_KV,")
patch("flash_api.cpp", "    at::Tensor k, v, k_padded, v_padded;\n", """    at::Tensor k, v, k_padded, v_padded;
    #ifdef FLASHATTENTION_DISABLE_APPEND_KV
        TORCH_CHECK(!k_.has_value(), "This flash attention build does not append k/v to the cache.");
    #endif
""")
# No backward kernels are compiled: run_mha_bwd must not reference them.
patch("flash_api.cpp", """void run_mha_bwd(Flash_bwd_params &params, cudaStream_t stream) {
    FP16_SWITCH(!params.is_bf16, [&] {
        HEADDIM_SWITCH(params.d, [&] {
            BOOL_SWITCH(params.is_causal, Is_causal, [&] {
                run_mha_bwd_<elem_type, kHeadDim, Is_causal>(params, stream);
            });
        });
    });
}""", """void run_mha_bwd(Flash_bwd_params &params, cudaStream_t stream) {
#ifdef FLASHATTENTION_DISABLE_BACKWARD
    TORCH_CHECK(false, "This flash attention build does not support backward.");
#else
    FP16_SWITCH(!params.is_bf16, [&] {
        HEADDIM_SWITCH(params.d, [&] {
            BOOL_SWITCH(params.is_causal, Is_causal, [&] {
                run_mha_bwd_<elem_type, kHeadDim, Is_causal>(params, stream);
            });
        });
    });
#endif
}""")
print("patched", root)
EOF
    echo "$stamp" > "$FA_BUILD/src/.stamp"
  fi
  echo "== building flash_attn_2_cuda ($FA_DTYPES, head dim 128, arch $FA_ARCH, MAX_JOBS=$MAX_JOBS)"
  TORCH_CUDA_ARCH_LIST=$FA_ARCH FA_DTYPES=$FA_DTYPES "$PYTHON" - "$FA_BUILD" <<'EOF' 2>&1 | tee "$OUT/fa_build.log"
import os, shutil, sys, time
from pathlib import Path

import torch
from torch.utils import cpp_extension

build_root = Path(sys.argv[1])
src = build_root / "src" / "csrc" / "flash_attn"
sources = [src / "flash_api.cpp"]
for dtype in os.environ["FA_DTYPES"].split():
    for causal in ("", "_causal"):
        for kind in ("fwd", "fwd_split"):
            sources.append(src / "src" / f"flash_{kind}_hdim128_{dtype}{causal}_sm80.cu")
defines = [
    f"-DFLASHATTENTION_DISABLE_{name}"
    for name in ("BACKWARD", "DROPOUT", "ALIBI", "SOFTCAP", "UNEVEN_K", "LOCAL",
                 "APPEND_KV", "EVEN_MN")
]
nvcc = [
    "-O3",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "--use_fast_math",
    *defines,
]  # no -std: torch's cpp_extension adds the standard its headers need
out = build_root / "build"
out.mkdir(parents=True, exist_ok=True)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, nvcc from {cpp_extension.CUDA_HOME}")
print(f"{len(sources)} sources:", " ".join(s.name for s in sources), flush=True)
started = time.perf_counter()
module = cpp_extension.load(
    name="flash_attn_2_cuda",
    sources=[str(s) for s in sources],
    extra_cflags=["-O3", *defines],
    extra_cuda_cflags=nvcc,
    extra_include_paths=[str(src), str(src / "src"), str(src.parent / "cutlass" / "include")],
    build_directory=str(out),
    with_cuda=True,
    verbose=True,
)
print(f"compiled and loaded in {time.perf_counter() - started:.0f} s: {module.__file__}")
site = build_root / "site"
shutil.rmtree(site, ignore_errors=True)
shutil.copytree(build_root / "src" / "flash_attn", site / "flash_attn")
shutil.copy2(module.__file__, site / "flash_attn_2_cuda.so")
print(f"site: {site}")
EOF
  rc=${PIPESTATUS[0]}
  echo "== build: rc=$rc, $(( $(date +%s) - start )) s (log: $OUT/fa_build.log)"
  [ "$rc" = 0 ] || exit "$rc"
fi

export PYTHONPATH=$site:$(ls -d "$repo"/packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}
"$PYTHON" -c "import flash_attn, flash_attn_2_cuda; print('flash_attn', flash_attn.__version__, \
'from', flash_attn.__file__)" || exit 1

if has test; then
  "$PYTHON" -m pytest -q -p no:cacheprovider -rs packages/rlt-attention/tests/test_flash_attn_backend.py \
    packages/rlt-attention/tests/test_selection.py 2>&1 | tee "$OUT/fa_tests.log" | tail -15
fi
if has bench; then
  "$PYTHON" benchmarks/kernel_bench.py --sections attention,prefill \
    --out "$OUT/flash_attn_bench.json" 2>&1 \
    | tee "$OUT/fa_bench.log"
fi
