#!/usr/bin/env bash
# ONNX Runtime's C/C++ API headers, for `lade-export build --kernels lade` (which compiles
# lade_export/kernels/block_quant_ops.cc against them). PyPI's onnxruntime wheels ship no
# headers; the npm registry's com.github.asus4.onnxruntime package (MIT) carries the official
# ONNX Runtime release headers inside its iOS framework. Usage:
#   bash scripts/fetch_ort_headers.sh [DEST]   (default ~/.cache/lade-export/ort-include)
# Or point $LADE_ORT_INCLUDE at any directory holding onnxruntime_cxx_api.h (an ONNX Runtime
# release archive's include/ folder, API version 29 or later).
set -euo pipefail
dest="${1:-$HOME/.cache/lade-export/ort-include}"
package="com.github.asus4.onnxruntime@0.4.9"   # ONNX Runtime 1.29 headers (C API version 29)
if [ -f "$dest/onnxruntime_cxx_api.h" ]; then
  echo "ONNX Runtime headers already in $dest"
  exit 0
fi
command -v npm >/dev/null || { echo "error: npm is needed to fetch $package" >&2; exit 2; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$package" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" --wildcards \
  'package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64_x86_64-simulator/onnxruntime.framework/Headers/*.h'
mkdir -p "$(dirname "$dest")"
staged="$dest.partial.$$"
rm -rf "$staged"
cp -r "$work/package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64_x86_64-simulator/onnxruntime.framework/Headers" "$staged"
rm -rf "$dest"
mv "$staged" "$dest"
echo "ONNX Runtime headers in $dest"
