#!/usr/bin/env bash
# ONNX Runtime's C/C++ API headers for `lade-export build --kernels lade`, fetched ahead of a
# build (the build itself fetches them when they are missing): a thin wrapper around
# lade_export.kernels.fetch_headers, which downloads the npm registry's
# com.github.asus4.onnxruntime@0.4.9 tarball (ONNX Runtime 1.29's headers), checks its pinned
# sha512 and keeps only the headers. Usage:
#   bash scripts/fetch_ort_headers.sh [DEST]   (default ~/.cache/lade-export/ort-include)
set -euo pipefail
python -c 'import sys
from lade_export.errors import LadeError
from lade_export.kernels import fetch_headers
try:
    print("ONNX Runtime headers in", fetch_headers(sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else None))
except LadeError as err:
    sys.exit(f"error: {err}")' "${1:-}"
