#!/usr/bin/env bash
# One non-interactive turn of Codex CLI (Responses API) and Claude Code (Anthropic Messages API) against
# ninfer-serve on the default model. Starts the server behind a small logging proxy (which prints what each agent
# sent) and, while the model loads, installs both agents from npm (pinned versions once, into
# ~/.cache/ninfer/agent-check, reused after; "latest" into a temporary folder each run); then runs `codex exec` and
# `claude -p` and checks that each exits 0 with a non-empty answer. Exit status 0 when both pass.
#
#   scripts/agent_check.sh                # pinned agent versions
#   CODEX_VERSION=latest CLAUDE_VERSION=latest scripts/agent_check.sh
#
# Needs node and npm (and network access to the npm registry); nothing else is downloaded.
set -uo pipefail

CODEX_VERSION=${CODEX_VERSION:-0.169.0}
CLAUDE_VERSION=${CLAUDE_VERSION:-2.1.328}
MODEL_ID=${MODEL_ID:-smollm2-135m-instruct}
PROMPT=${PROMPT:-"Say hello in one short sentence."}
PYTHON=${PYTHON:-python3}
# the most an answer may take: Claude Code reports an answer cut at its limit as an error, so the limit sits above
# what the default model usually writes for the prompt (it often stops within 60 tokens; sampling, it sometimes
# runs on, and it writes a few dozen tokens a second on a CPU)
MAX_TOKENS=${MAX_TOKENS:-256}
AGENT_TIMEOUT=${AGENT_TIMEOUT:-600}  # seconds per agent: a CPU reads a coding agent's long system prompt slowly
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${AGENT_CHECK_DIR:-$(mktemp -d -t ninfer-agent-check.XXXXXX)}
mkdir -p "$WORK"

port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
SERVER_PORT=$(port)
PROXY_PORT=$(port)
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
    wait 2>/dev/null
    [ -z "${AGENT_CHECK_DIR:-}" ] && rm -rf "$WORK"
}
trap cleanup EXIT

echo "== starting ninfer-serve on 127.0.0.1:$SERVER_PORT (default model), logging proxy on :$PROXY_PORT"
(cd "$ROOT" && HF_HUB_OFFLINE=1 exec "$PYTHON" -m engine.serve --port "$SERVER_PORT" --model-id "$MODEL_ID" \
    --model-alias "claude-*=$MODEL_ID" --default-max-tokens "$MAX_TOKENS" --log-level warning) >"$WORK/server.log" 2>&1 &
PIDS+=($!)
mkdir -p "$WORK/bodies"
AGENT_PROXY_SAVE="$WORK/bodies" "$PYTHON" "$ROOT/scripts/agent_proxy.py" "$PROXY_PORT" "$SERVER_PORT" >>"$WORK/proxy.log" 2>&1 &
PIDS+=($!)
# pinned versions are installed once into the user's cache and reused; "latest" installs afresh each run
AGENTS="$WORK/npm"
case "$CODEX_VERSION$CLAUDE_VERSION" in
    *latest*) ;;
    *) AGENTS="${XDG_CACHE_HOME:-$HOME/.cache}/ninfer/agent-check/codex-$CODEX_VERSION-claude-$CLAUDE_VERSION" ;;
esac
BIN="$AGENTS/node_modules/.bin"
mkdir -p "$(dirname "$AGENTS")"
exec 9>"$AGENTS.lock"; flock 9  # one install at a time into the shared folder
if [ -x "$BIN/codex" ] && [ -x "$BIN/claude" ] && [ -e "$AGENTS/installed" ]; then
    echo "== @openai/codex@$CODEX_VERSION and @anthropic-ai/claude-code@$CLAUDE_VERSION from $AGENTS"
else
    echo "== installing @openai/codex@$CODEX_VERSION and @anthropic-ai/claude-code@$CLAUDE_VERSION into $AGENTS"
    rm -rf "$AGENTS"; mkdir -p "$AGENTS"
    if ! npm install --silent --no-audit --no-fund --prefix "$AGENTS" \
            "@openai/codex@$CODEX_VERSION" "@anthropic-ai/claude-code@$CLAUDE_VERSION" >"$WORK/npm.log" 2>&1; then
        cat "$WORK/npm.log"; echo "FAIL: npm install"; rm -rf "$AGENTS"; exit 1
    fi
    touch "$AGENTS/installed"  # written last: an install cut short is never reused
fi
exec 9>&-
echo "codex: $("$BIN/codex" --version 2>&1 | tail -1); claude: $("$BIN/claude" --version 2>&1 | tail -1)"
for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$PROXY_PORT/health" >/dev/null 2>&1 && break
    sleep 0.5
done
if ! curl -sf "http://127.0.0.1:$PROXY_PORT/health" >/dev/null; then
    cat "$WORK/server.log" "$WORK/proxy.log"; echo "FAIL: the server did not become ready"; exit 1
fi
curl -s "http://127.0.0.1:$PROXY_PORT/v1/models"; echo
: >"$WORK/proxy.log"  # from here on, only what the agents send

STATUS=0
run_agent() {  # name, command...
    local name=$1; shift
    echo "== $name"
    (cd "$WORK/project" && timeout "$AGENT_TIMEOUT" "$@") </dev/null >"$WORK/$name.out" 2>"$WORK/$name.err"
    local rc=$?
    echo "-- what $name sent:"; cat "$WORK/proxy.log"; : >"$WORK/proxy.log"
    echo "-- exit status $rc; answer:"; cat "$WORK/$name.out"
    if [ $rc -ne 0 ] || [ -z "$(tr -d '[:space:]' <"$WORK/$name.out")" ]; then
        echo "-- stderr:"; tail -20 "$WORK/$name.err"
        echo "FAIL: $name"; STATUS=1
    else
        echo "PASS: $name"
    fi
}

mkdir -p "$WORK/project" "$WORK/codex-home" "$WORK/home"
cat >"$WORK/codex-home/config.toml" <<EOF
model = "$MODEL_ID"
model_provider = "ninfer"

[model_providers.ninfer]
name = "NInfer"
base_url = "http://127.0.0.1:$PROXY_PORT/v1"
wire_api = "responses"
EOF
run_agent codex env HOME="$WORK/home" CODEX_HOME="$WORK/codex-home" \
    "$BIN/codex" exec --skip-git-repo-check --sandbox read-only "$PROMPT"

run_agent claude env HOME="$WORK/home" ANTHROPIC_BASE_URL="http://127.0.0.1:$PROXY_PORT" \
    ANTHROPIC_API_KEY=local ANTHROPIC_MODEL="$MODEL_ID" CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 \
    CLAUDE_CODE_MAX_OUTPUT_TOKENS="$MAX_TOKENS" \
    DISABLE_AUTOUPDATER=1 "$BIN/claude" -p "$PROMPT" --max-turns 1

[ $STATUS -eq 0 ] && echo "agent check: both agents passed" || echo "agent check: FAILED"
exit $STATUS
