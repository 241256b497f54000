"""scripts/agent_check.sh in the suite: one turn of Codex CLI and of Claude Code against ninfer-serve on the default
model. Needs node, npm and the npm registry; skipped without them. The script itself is strict (exit 0 and an
answer from each agent); this test also accepts an agent's turn whose only failure is the tiny model writing past
the answer limit (the API saying so is the API working), once every request that agent sent was answered."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
# The answer limit for both agents. What is checked is the round trips, not the answer's length: Claude Code asks
# again up to three times when an answer stops at the limit, so 256 tokens (the script's default) cost four
# 256-token answers of decoding on a CPU, some 25 s, for the same requests and replies.
MAX_TOKENS = 64


@pytest.mark.subprocess
def test_codex_and_claude_code_each_finish_a_turn(cpp_kernels):
    # cpp_kernels: the C++ library built here first, so the server the script starts loads it from the kernel cache
    # instead of building it within the script's two minutes of waiting for the server (and being killed mid-build)
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("node and npm are not installed")
    if subprocess.run(["npm", "view", "@openai/codex", "version"], capture_output=True, timeout=60).returncode:
        pytest.skip("the npm registry cannot be reached")
    run = subprocess.run(["bash", str(ROOT / "scripts" / "agent_check.sh")], capture_output=True, text=True,
                         timeout=1800, env={**os.environ, "HF_HUB_OFFLINE": "1", "MAX_TOKENS": str(MAX_TOKENS)})
    out = run.stdout + run.stderr
    assert "POST /v1/responses" in out and "POST /v1/messages" in out, out[-4000:]
    codex, claude = out.split("== codex", 1)[1].split("== claude", 1)
    # The default 135M model, sampling, sometimes writes past the answer limit under a coding agent's long system
    # prompt (or loops on a phrase until it). Each agent then reports the cut answer as an error: Codex as a
    # Responses answer whose status is incomplete for max_output_tokens, Claude Code as its output token maximum.
    # That is the model's length, not the API: accepted, once every request the agent sent was answered 200, and said
    # in the test output.
    for name, section, limit_words in (("codex", codex, "reason: max_output_tokens"),
                                       ("claude", claude, "output token maximum")):
        assert "-> 200" in section, section[-4000:]
        assert not any(f"-> {code}" in section for code in (400, 401, 404, 413, 422, 500)), section[-4000:]
        if f"PASS: {name}" not in section:
            assert limit_words in section, section[-4000:]
            print(f"{name}: the default model's answer ran past the output limit (the API round trips succeeded)")
