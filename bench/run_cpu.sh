#!/usr/bin/env bash
# CPU benchmark of lade-export on this machine (2 cores), SmolLM2-135M-Instruct.
#
#   bash bench/run_cpu.sh [--tune]
#
# 1. Builds (once) the float32, int4, int4-lade (this project's kernels: integer compute on
#    Q4_1/Q8_0 blocks; the build compiles them, with ONNX Runtime's headers fetched once),
#    int4-greedy (int8 activations, greedy only) and int8 artifacts under artifacts/ (delete
#    one to rebuild it with the current exporter).
# 2. With --tune: tunes a profile for float32 and for int4 on MT-Bench prompts 16..23,
#    validated on our own chat set (bench/prompts/chat.jsonl) — the shipped default
#    profiles come from such runs; the tuned files land in bench/results/tuned-*.toml.
# 3. Compares, per workload (MT-Bench, HumanEval, GSM8K: their first 16 prompts, which no
#    profile was tuned on; 256 new tokens max), in one interleaved run per workload:
#    float32 greedy and its default profile, int4 greedy and its default profile (ONNX
#    Runtime's kernels and the lade kernels), int8
#    greedy (int8 graphs refuse lookahead: see lade_export/export/quantize.py), transformers
#    greedy and prompt lookup (from a float32 HF directory), and llama.cpp greedy and
#    lookahead on the Q4_1 GGUF that ships the model (built by bench/build_llama_cpp.sh,
#    found through LADE_LLAMA_CPP or ~/.cache/lade-export/llama.cpp/bin).
# 4. Compares float32 and int4 greedy and their default profiles on the chat set (16 prompts).
# Results: bench/results/cpu-<workload>/ (summary.md/.csv, results.jsonl, speedup.png).
set -euo pipefail
cd "$(dirname "$0")/.."
TUNE=0
[ "${1:-}" = "--tune" ] && TUNE=1
LLAMA=${LADE_LLAMA_CPP:-$HOME/.cache/lade-export/llama.cpp/bin}
mkdir -p build bench/results
[ -d artifacts/smollm2 ] || lade-export build --out artifacts/smollm2
[ -d artifacts/smollm2-int4 ] || lade-export build --out artifacts/smollm2-int4 --precision int4
bash scripts/fetch_ort_headers.sh
[ -d artifacts/smollm2-int4-lade ] || lade-export build --out artifacts/smollm2-int4-lade --precision int4 --kernels lade
[ -d artifacts/smollm2-int8 ] || lade-export build --out artifacts/smollm2-int8 --precision int8
# int4 layers and an 8-bit head with int8 activations (llama.cpp's Q4_1 x Q8_1 arithmetic): greedy only.
[ -d artifacts/smollm2-int4-greedy ] || lade-export build --out artifacts/smollm2-int4-greedy --precision int4 \
  --accuracy-level 4 --head-bits 8 --profile greedy-only

if [ "$TUNE" = 1 ]; then
  for art in smollm2 smollm2-int4; do
    lade-export tune "artifacts/$art" --dataset mt_bench --skip 16 --limit 8 --max-new-tokens 256 \
      --validate-dataset bench/prompts/chat.jsonl --validate-limit 8 \
      --out "bench/results/tuned-$art.toml" | tee "bench/results/tune-$art.log"
  done
fi

PEERS=(--peer transformers-greedy --peer transformers-prompt-lookup)
if [ -x "$LLAMA/llama-completion" ]; then
  PEERS+=(--peer llama.cpp-greedy --peer llama.cpp-lookahead --llama-cpp "$LLAMA")
else
  echo "llama.cpp not built (bash bench/build_llama_cpp.sh): running without the llama.cpp peers" >&2
fi
for ds in mt_bench humaneval gsm8k; do
  lade-export compare artifacts/smollm2 --dataset "$ds" --limit 16 --max-new-tokens 256 --profile default \
    --also artifacts/smollm2-int4 --also artifacts/smollm2-int4-lade --also artifacts/smollm2-int4-greedy \
    --also artifacts/smollm2-int8 "${PEERS[@]}" \
    --title "SmolLM2-135M-Instruct, $ds, 2-core CPU" \
    --out "bench/results/cpu-$ds" | tee "bench/results/compare-$ds.log"
done
lade-export compare artifacts/smollm2 --dataset bench/prompts/chat.jsonl --limit 16 --max-new-tokens 256 \
  --profile default --also artifacts/smollm2-int4 --also artifacts/smollm2-int4-lade \
  --title "SmolLM2-135M-Instruct, own chat set, 2-core CPU" \
  --out bench/results/cpu-chat | tee bench/results/compare-chat.log
