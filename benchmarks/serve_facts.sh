#!/usr/bin/env bash
# Issue 20: do facts survive an escalation inside vLLM?  Measured the way a user reaches it: `kvhub serve`
# starts the two servers (the small model stores each prompt's KV, the large one maps it and recomputes
# the first 4 + 8% chosen by its own attention), then `kvhub eval-serve` sends every item over HTTP:
# the small server (source), the large server as its own tenant (own: no stored KV), as the small
# request's tenant (mapped: the escalation), the same with kv_transfer_params kvhub_control (the
# no-information control map, same recompute) and the last 32 tokens only (floor).
#   bash benchmarks/serve_facts.sh [REF] [extra kvhub serve options...]
# TASKS="gist-chat gist-document" scores the gist instead (the large model's own answer, teacher-forced
# through kvhub serve's logits processor; docs/eval-serve.md).
# Needs .venv-vllm (scripts/setup-vllm.sh) and the demo mapper (scripts/demo.sh).  Writes
# docs/results/serve_facts.json (override with OUT=..., TASKS="facts multiturn", LIMIT=items per task and length, LENGTHS="1024 2048",
# DTYPE=float32: on a CPU without AVX-512 bf16 matmuls are emulated and several times slower than fp32).
# On 2 AVX2 cores the 1.5B prefills 1k tokens in about a minute: LIMIT=4 at 1k takes about 20 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
REF=${1:-Qwen2.5-Coder-0.5B-Instruct:Qwen2.5-Coder-1.5B-Instruct:legal-docs@latest}
shift || true
KVHUB=${KVHUB:-.venv/bin/kvhub}
OUT=${OUT:-docs/results/serve_facts.json}
LIMIT=${LIMIT:-12}
WORK=$(mktemp -d)
"$KVHUB" serve "$REF" --kvstore-dir "$WORK/kv" --events "$WORK/events.jsonl" --log-dir "$WORK/logs" --json \
  --port-small "${PORT_SMALL:-8101}" --port-large "${PORT_LARGE:-8102}" "$@" \
  -- --dtype "${DTYPE:-float32}" --max-model-len 4096 --block-size 32 --max-num-seqs 4 --enforce-eager \
  > "$WORK/ready.json" 2> "$WORK/serve.stderr" &
SERVE=$!
trap 'kill -INT $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
until [ -s "$WORK/ready.json" ]; do
  kill -0 $SERVE 2>/dev/null || { cat "$WORK/serve.stderr" >&2; exit 1; }
  sleep 2
done
small=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['small']['url'])" "$WORK/ready.json")
large=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['large']['url'])" "$WORK/ready.json")
lengths=()
for n in ${LENGTHS:-1024 2048}; do lengths+=(--context-tokens "$n"); done
tasks=()
for t in ${TASKS:-facts multiturn}; do tasks+=(--task "$t"); done
"$KVHUB" eval-serve --small "$small" --large "$large" "${tasks[@]}" "${lengths[@]}" \
  --limit "$LIMIT" --agreement-tokens "${AGREEMENT:-32}" --timeout 1800 --output-path "$OUT"
cp "$WORK/events.jsonl" "${OUT%.json}.events.jsonl"
echo "results: $OUT; connector events: ${OUT%.json}.events.jsonl; server logs: $WORK/logs" >&2
