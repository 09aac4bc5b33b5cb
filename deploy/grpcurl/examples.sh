#!/usr/bin/env bash
# The grpcurl calls of the README, runnable against a DeltaServe scheduler.
#
#   deploy/grpcurl/examples.sh                      # TARGET defaults to localhost:50051
#   TARGET=127.0.0.1:6000 deploy/grpcurl/examples.sh
#   kubectl port-forward svc/deltaserve 50051:50051 & deploy/grpcurl/examples.sh
#
# Environment:
#   TARGET         HOST:PORT of the scheduler's public API (default localhost:50051)
#   WORKER_TARGET  HOST:PORT of one worker service (optional): also query its Health and Info,
#                  e.g. after `kubectl port-forward pod/deltaserve-worker-0 50052:50052`
#   WORKER_TOKEN_FILE  a file holding the Worker protocol's token (the scheduler's
#                  --worker-token-file, not a worker's sha256: digest) (optional): without it the worker's
#                  Info must be refused UNAUTHENTICATED (as `deltaserve serve`'s worker does);
#                  e.g. <(kubectl get secret deltaserve-worker-token -o jsonpath='{.data.token}' | base64 -d)
#   API_KEY_FILE   a file whose first line is an API key of the scheduler's --api-key-file
#   CACERT         the CA of the scheduler's --tls-cert: TLS instead of plaintext
#   GRPCURL        the grpcurl binary (default: `grpcurl` on PATH, else .venv/bin/grpcurl)
#
# Server reflection means no .proto file is needed. Exits non-zero at the first call that fails
# unexpectedly.
set -euo pipefail

TARGET="${TARGET:-localhost:50051}"
WORKER_TARGET="${WORKER_TARGET:-}"
WORKER_TOKEN_FILE="${WORKER_TOKEN_FILE:-}"
API_KEY_FILE="${API_KEY_FILE:-}"
CACERT="${CACERT:-}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
GEN=deltaserve.v1.Generation

find_grpcurl() {
  if [[ -n "${GRPCURL:-}" ]]; then echo "$GRPCURL"
  elif command -v grpcurl > /dev/null; then command -v grpcurl
  elif [[ -x "$REPO/.venv/bin/grpcurl" ]]; then echo "$REPO/.venv/bin/grpcurl"
  else echo "examples.sh: grpcurl not found: put it on PATH, set GRPCURL, or run make install" >&2
       exit 2
  fi
}
GRPCURL="$(find_grpcurl)"

# step TITLE: a header before each call.
step() { printf '\n### %s\n' "$*"; }
# How to reach TARGET: plaintext or TLS, with an API key or none.
CONNECT=(-plaintext)
if [[ -n "$CACERT" ]]; then CONNECT=(-cacert "$CACERT"); fi
if [[ -n "$API_KEY_FILE" ]]; then CONNECT+=(-H "authorization: Bearer $(head -n1 "$API_KEY_FILE")"); fi
# call [grpcurl args...]: a call to TARGET (the method comes last).
call() { "$GRPCURL" "${CONNECT[@]}" "${@:1:$#-1}" "$TARGET" "${@: -1}"; }
# token_ids FILE-OR-STDIN: the ids of every "tokenIds" array of a response stream, as one list
# (a stream may carry a step's tokens in one message or, when the reader lagged, several in one).
token_ids() { tr -d ' \n' | grep -o '"tokenIds":\[[0-9,]*\]' | sed 's/.*\[//; s/\]//' | paste -sd, -; }

step "services (reflection)"
"$GRPCURL" "${CONNECT[@]}" "$TARGET" list

step "the Generation service, with its documentation"
"$GRPCURL" "${CONNECT[@]}" "$TARGET" describe "$GEN"

step "health: liveness (service \"\") and readiness ($GEN)"
call -d '{"service": ""}' grpc.health.v1.Health/Check
call -d "{\"service\": \"$GEN\"}" grpc.health.v1.Health/Check

step "Tokenize"
call -d '{"text": "Hello world"}' "$GEN/Tokenize"

step "GetModelInfo"
call "$GEN/GetModelInfo"

step "GetServerStatus"
call "$GEN/GetServerStatus"

step "Generate: a text prompt, one message per step (server stream)"
call -d '{"text": "Once upon a time", "stopping": {"max_tokens": 3}}' "$GEN/Generate"

step "Generate: token ids, seeded sampling, top-2 logprobs"
seeded='{"request_id": "demo-1", "token_ids": [5, 17, 300],
         "sampling": {"temperature": 0.8, "top_p": 0.9, "seed": 42},
         "stopping": {"max_tokens": 2, "ignore_eos": true}, "logprobs": 2}'
first="$(call -d "$seeded" "$GEN/Generate")"
echo "$first"
step "the same seed again: the same tokens"
again="$(call -d "${seeded/demo-1/demo-2}" "$GEN/Generate")"
if [[ "$(token_ids <<< "$first")" != "$(token_ids <<< "$again")" ]]; then
  echo "examples.sh: seed 42 gave different tokens: $(token_ids <<< "$first") vs" \
       "$(token_ids <<< "$again")" >&2
  exit 1
fi
echo "same tokens: $(token_ids <<< "$again")"

step "Abort: a long request in the background, aborted once it streams"
long_out="$(mktemp)"
trap 'rm -f "$long_out"' EXIT
call -d '{"request_id": "demo-long", "token_ids": [5, 6, 7],
          "stopping": {"max_tokens": 1000, "ignore_eos": true}}' "$GEN/Generate" > "$long_out" &
long_pid=$!
for _ in $(seq 200); do   # up to 20 s for the first message
  grep -q '"requestId"' "$long_out" && break
  kill -0 "$long_pid" 2> /dev/null || break
  sleep 0.1
done
call -d '{"request_ids": ["demo-long", "no-such-id"]}' "$GEN/Abort"
wait "$long_pid"
echo "the long stream ended with:"
grep '"finishReason"' "$long_out"

step "an invalid request: INVALID_ARGUMENT naming the field, the value and the range"
if call -d '{"text": "hi", "sampling": {"top_p": 1.5}}' "$GEN/Generate" 2>&1; then
  echo "examples.sh: top_p=1.5 was accepted" >&2
  exit 1
fi

if [[ -n "$WORKER_TARGET" ]]; then
  step "worker $WORKER_TARGET: health (\"deltaserve.v1.Worker\" = model loaded; open for probes)"
  # No reflection without the worker token: the Check call is described by health.proto here.
  "$GRPCURL" -plaintext -import-path "$REPO/deploy/grpcurl" -proto health.proto \
    -d '{"service": "deltaserve.v1.Worker"}' "$WORKER_TARGET" grpc.health.v1.Health/Check
  if [[ -n "$WORKER_TOKEN_FILE" ]]; then
    step "worker $WORKER_TARGET: Health and Info with the worker token"
    WORKER_AUTH=(-H "authorization: Bearer $(head -n1 "$WORKER_TOKEN_FILE")")
    "$GRPCURL" -plaintext "${WORKER_AUTH[@]}" "$WORKER_TARGET" deltaserve.v1.Worker/Health
    "$GRPCURL" -plaintext "${WORKER_AUTH[@]}" "$WORKER_TARGET" deltaserve.v1.Worker/Info
  else
    step "worker $WORKER_TARGET: Info without the worker token (refused unless the worker runs without one)"
    # (worker.proto from the repo: reflection, too, needs the token)
    if out="$("$GRPCURL" -plaintext -import-path "$REPO/proto" -proto dswire/v1/worker.proto \
              "$WORKER_TARGET" deltaserve.v1.Worker/Info 2>&1)"; then
      echo "$out"
    else
      echo "$out"
      grep -q "Code: Unauthenticated" <<< "$out"
    fi
  fi
fi

step "done"
