#!/usr/bin/env bash
# Build the C++ host (examples/cpp/README.md) with CMake against the active Python
# environment's lade-export and pybind11, then run it on an artifact:
#
#   bash examples/cpp/run.sh ARTIFACT_DIR [MAX_NEW_TOKENS] [--token-budget T] [--kv-tokens K] [--no-batching]
#
# The build goes to examples/cpp/build/ (ignored by git).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ $# -lt 1 ]; then
  echo "usage: bash examples/cpp/run.sh ARTIFACT_DIR [MAX_NEW_TOKENS]" >&2; exit 2
fi
python=$(command -v python || command -v python3 || true)
for tool in cmake "${CXX:-c++}"; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found; install CMake and a C++17 compiler" >&2; exit 2; }
done
"$python" -c "import lade_export" 2>/dev/null || {
  echo "error: lade_export is not installed in the environment of ${python:-python} (activate it, or pip install lade-export)" >&2; exit 2; }
cmakedir=$("$python" -m pybind11 --cmakedir 2>/dev/null) || {
  echo "error: pybind11 is not installed in the environment of $python: pip install 'lade-export[cpp]'" >&2; exit 2; }
mkdir -p "$here/build"
cmake -S "$here" -B "$here/build" -DPython_EXECUTABLE="$python" -Dpybind11_DIR="$cmakedir" >"$here/build/log.txt" 2>&1 &&
  cmake --build "$here/build" >>"$here/build/log.txt" 2>&1 || {
  echo "error: the C++ host did not build (log: $here/build/log.txt; CMake needs Python's headers, e.g. python3-dev)" >&2
  exit 2; }
exec "$here/build/lade_host" "$@"
