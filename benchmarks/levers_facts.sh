#!/usr/bin/env bash
# Issue 10, item 3: do the fit's levers make the mapped keys carry a fact?  Two more legal-docs mappers
# of the demo pair, 32 calibration sequences each (the demo's has 64): uniform token weights, and
# attention weighting; both scored on passkey retrieval at 1k tokens beside the demo mapper's results
# (docs/results/facts_1k.json, same 15 items, same seed).  Writes docs/results/facts_1k_{uniform,attention}32.json.
# About 35 minutes on 2 idle CPU cores (fits: 13 + 7 min; evals: 7 min each).
set -euo pipefail
cd "$(dirname "$0")/.."
KVHUB=${KVHUB:-.venv/bin/kvhub}
DB=${DB:-$(mktemp -d)/kvhub.db}   # a store of its own: these mappers never become the default's `latest`
pair=(--src Qwen/Qwen2.5-Coder-0.5B-Instruct --dst Qwen/Qwen2.5-Coder-1.5B-Instruct --calib legal-docs
      --samples 32 --dtype bfloat16 --device cpu --db "$DB")
"$KVHUB" fit "${pair[@]}"                           # -> @v1, uniform
"$KVHUB" fit "${pair[@]}" --weighting attention     # -> @v2
REF=Qwen2.5-Coder-0.5B-Instruct:Qwen2.5-Coder-1.5B-Instruct:legal-docs
for v in 1:uniform32 2:attention32; do
  "$KVHUB" eval "$REF@v${v%%:*}" --db "$DB" --task facts --context-tokens 1024 --limit 15 --exact-prefix 4 \
    --exact-suffix 16 --exact-budget 0 --exact-budget 0.05 --exact-budget 0.1 --select target \
    --dtype bfloat16 --device cpu --json > "docs/results/facts_1k_${v#*:}.json"
done
