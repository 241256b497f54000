"""scripts/agent_check.sh in the suite: one turn of Codex CLI and of Claude Code against ninfer-serve on the default
model. Needs node, npm and the npm registry; skipped without them."""
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
    assert run.returncode == 0, out[-4000:]
    assert "PASS: codex" in out and "PASS: claude" in out
    assert "POST /v1/responses" in out and "POST /v1/messages" in out
