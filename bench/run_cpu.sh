#!/usr/bin/env bash
# Issue #3 benchmark on this machine (2 CPU cores): tune a profile per workload on prompts
# 16..23, then compare greedy, the tuned and the default profile and both transformers peers
# on the first 16 prompts of each workload (256 new tokens max), interleaved prompt by prompt.
# Usage: bash bench/run_cpu.sh [ARTIFACT_DIR]   (builds build/smollm2 if missing)
set -euo pipefail
cd "$(dirname "$0")/.."
ART=${1:-build/smollm2}
[ -d "$ART" ] || lade-export build --out "$ART" --profile default --profile small --profile paper
mkdir -p bench/results
for ds in mt_bench humaneval gsm8k; do
  lade-export tune "$ART" --dataset "$ds" --skip 16 --limit 8 --max-new-tokens 256 \
    --out "bench/results/tuned-$ds.toml" | tee "bench/results/tune-$ds.log"
done
for ds in mt_bench humaneval gsm8k; do
  lade-export compare "$ART" --dataset "$ds" --limit 16 --max-new-tokens 256 \
    --profile "bench/results/tuned-$ds.toml" --profile default \
    --peer transformers-greedy --peer transformers-prompt-lookup \
    --title "SmolLM2-135M-Instruct, $ds, 2-core CPU, ONNX Runtime fp32" \
    --out "bench/results/cpu-$ds" | tee "bench/results/compare-$ds.log"
done
