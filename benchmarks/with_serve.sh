#!/usr/bin/env bash
# Start `kvhub serve REF` (both servers), run COMMAND with $SMALL and $LARGE set to their base URLs and $WORK to
# the run's directory (kv store, events.jsonl, server logs), then stop both servers.
#   bash benchmarks/with_serve.sh REF 'kvhub eval-serve --small $SMALL --large $LARGE --task turns' [kvhub serve options...]
# The servers get VLLM_ARGS (default: DTYPE, float32 unless set -- on a CPU without AVX-512 bf16 matmuls are emulated --, max model
# length 4096, block size 32, 4 sequences, eager mode); PORT_SMALL / PORT_LARGE choose the ports (8101 / 8102).
set -euo pipefail
cd "$(dirname "$0")/.."
REF=$1
COMMAND=$2
shift 2
KVHUB=${KVHUB:-.venv/bin/kvhub}
VLLM_ARGS=${VLLM_ARGS:---dtype ${DTYPE:-float32} --max-model-len 4096 --block-size 32 --max-num-seqs 4 --enforce-eager}
WORK=$(mktemp -d)
# shellcheck disable=SC2086  # VLLM_ARGS is a list of arguments
"$KVHUB" serve "$REF" --kvstore-dir "$WORK/kv" --events "$WORK/events.jsonl" --log-dir "$WORK/logs" --json \
  --port-small "${PORT_SMALL:-8101}" --port-large "${PORT_LARGE:-8102}" "$@" -- $VLLM_ARGS \
  > "$WORK/ready.json" 2> "$WORK/serve.stderr" &
SERVE=$!
trap 'kill -INT $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
until [ -s "$WORK/ready.json" ]; do
  kill -0 $SERVE 2>/dev/null || { cat "$WORK/serve.stderr" >&2; exit 1; }
  sleep 2
done
SMALL=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['small']['url'])" "$WORK/ready.json")
LARGE=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['large']['url'])" "$WORK/ready.json")
export SMALL LARGE WORK KVHUB
bash -c "$COMMAND"
echo "connector events: $WORK/events.jsonl; server logs: $WORK/logs" >&2
