#!/usr/bin/env bash
# Issue 20: do facts survive an escalation inside vLLM?  Measured the way a user reaches it: `kvhub serve`
# starts the two servers (the small model stores each prompt's KV, the large one maps it and recomputes
# the first 4 + 8% chosen by the small model's attention), then `kvhub eval-serve` sends every item over HTTP:
# the small server (source), the large server as its own tenant (own: no stored KV), as the small
# request's tenant (mapped: the escalation), the same with kv_transfer_params kvhub_control (the
# no-information control map, same recompute) and the last 32 tokens only (floor).
#   bash benchmarks/serve_facts.sh [REF] [extra kvhub serve options...]
# TASKS="gist-chat gist-document" scores the gist instead (the large model's own answer, teacher-forced
# through kvhub serve's logits processor; docs/eval-serve.md); TASKS=turns the turns after an escalation.
# Needs .venv-vllm (scripts/setup-vllm.sh) and the demo mapper (scripts/demo.sh).  Writes
# docs/results/serve_facts.json (override with OUT=..., TASKS="facts multiturn", LIMIT=items per task and length, LENGTHS="1024 2048",
# VLLM_ARGS: the servers' vllm options, benchmarks/with_serve.sh).
# On 2 AVX2 cores the 1.5B prefills 1k tokens in about a minute: LIMIT=4 at 1k takes about 20 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
REF=${1:-Qwen2.5-Coder-0.5B-Instruct:Qwen2.5-Coder-1.5B-Instruct:legal-docs@latest}
shift || true
OUT=${OUT:-docs/results/serve_facts.json}
lengths=""
for n in ${LENGTHS:-1024 2048}; do lengths+=" --context-tokens $n"; done
tasks=""
for t in ${TASKS:-facts multiturn}; do tasks+=" --task $t"; done
export OUT
bash benchmarks/with_serve.sh "$REF" "\"\$KVHUB\" eval-serve --small \"\$SMALL\" --large \"\$LARGE\" $tasks $lengths \
  --limit ${LIMIT:-12} --agreement-tokens ${AGREEMENT:-32} --timeout 1800 --output-path \"\$OUT\" && \
  cp \"\$WORK/events.jsonl\" \"\${OUT%.json}.events.jsonl\"" "$@"
echo "results: $OUT; connector events: ${OUT%.json}.events.jsonl" >&2
