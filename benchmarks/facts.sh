#!/usr/bin/env bash
# Issue 10: do facts survive the handoff?  Long-context retrieval with the selective exact recompute,
# beside the built-in no-information control, on the demo mapper (scripts/demo.sh: legal-docs).
#   bash benchmarks/facts.sh [REF]        # writes docs/results/facts_*.json, recall_1k.json, ...
# Each eval prints (and stores as metrics) own / mapped / control / source / floor exact-answer
# accuracy with bootstrap intervals; per-item results are cached, so a rerun only adds what is missing.
# About 90 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
REF=${1:-Qwen2.5-Coder-0.5B-Instruct:Qwen2.5-Coder-1.5B-Instruct:legal-docs@latest}
KVHUB=${KVHUB:-.venv/bin/kvhub}
OUT=docs/results
run=(--exact-prefix 4 --exact-suffix 16 --dtype bfloat16 --device cpu --json)
# 1k tokens: every selector at 5% and 10% of the context, the map alone and the default handoff
"$KVHUB" eval "$REF" --task facts --context-tokens 1024 --limit 15 "${run[@]}" --variant exact_prefix=0 \
  --exact-budget 0 --exact-budget 0.05 --exact-budget 0.1 \
  --select source --select target --select deviation --select random > "$OUT/facts_1k.json"
# time to first token: handoff with the 10% source-selected recompute vs full prefill, interleaved
"$KVHUB" bench "$REF" --lengths 1024,4096 --repeats 2 --exact-prefix 4 --exact-suffix 16 \
  --exact-budget 0.1 --select source --dtype bfloat16 --device cpu --json > "$OUT/bench_selective.json"
# 4k tokens: the default handoff and the two attention selectors at 10%
"$KVHUB" eval "$REF" --task facts --context-tokens 4096 --limit 8 "${run[@]}" \
  --exact-budget 0 --exact-budget 0.1 --select source --select target > "$OUT/facts_4k.json"
# 512 and 2k tokens: the default handoff and the two attention selectors at 10%
"$KVHUB" eval "$REF" --task facts --context-tokens 512 --limit 15 "${run[@]}" \
  --exact-budget 0 --exact-budget 0.1 --select source --select target > "$OUT/facts_512.json"
"$KVHUB" eval "$REF" --task facts --context-tokens 2048 --limit 8 "${run[@]}" \
  --exact-budget 0 --exact-budget 0.1 --select source --select target > "$OUT/facts_2k.json"
# multi-turn recall and next-line code completion at 1k
"$KVHUB" eval "$REF" --task multiturn --task code --context-tokens 1024 --limit 8 "${run[@]}" \
  --exact-budget 0 --exact-budget 0.1 --select source --select target > "$OUT/recall_1k.json"
# no regression on short multiple-choice contexts
"$KVHUB" eval "$REF" --task hellaswag --limit 100 "${run[@]}" \
  --exact-budget 0 --exact-budget 0.1 --select source > "$OUT/hellaswag_selective.json"
"$KVHUB" eval "$REF" --task piqa --task arc_easy --limit 100 "${run[@]}" \
  --exact-budget 0 --exact-budget 0.1 --select source > "$OUT/piqa_arc_selective.json"
