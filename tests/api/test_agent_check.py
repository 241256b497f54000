"""scripts/agent_check.sh in the suite: one turn of Codex CLI and of Claude Code against ninfer-serve on the default
model. Needs node, npm and the npm registry; skipped without them. The script itself is strict (exit 0 and an
answer from each agent); this test also accepts a Claude Code turn whose only failure is the tiny model writing past
the answer limit, once every request it sent was answered."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_codex_and_claude_code_each_finish_a_turn():
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("node and npm are not installed")
    if subprocess.run(["npm", "view", "@openai/codex", "version"], capture_output=True, timeout=60).returncode:
        pytest.skip("the npm registry cannot be reached")
    run = subprocess.run(["bash", str(ROOT / "scripts" / "agent_check.sh")], capture_output=True, text=True,
                         timeout=1800, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out = run.stdout + run.stderr
    assert "PASS: codex" in out, out[-4000:]
    assert "POST /v1/responses" in out and "POST /v1/messages" in out
    claude = out.split("== claude", 1)[1]
    assert "-> 200" in claude and not any(f"-> {code}" in claude for code in (400, 401, 404, 413, 422, 500)), claude
    # The default 135M model, sampling, sometimes writes past the answer limit under Claude Code's ~12K-token system
    # prompt; Claude Code then reports that as an error after continuing the answer itself (each continuation
    # answered 200 above). That is the model's length, not the API: accepted, and said in the test output.
    if "PASS: claude" not in out:
        assert "output token maximum" in claude, claude[-4000:]
        print("claude: the default model's answer ran past the output limit (the API round trips succeeded)")
