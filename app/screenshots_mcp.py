"""A tool call in the chat window, on a real X screen (run by scripts/screen_check.sh when the reference MCP
filesystem server is installed: ``npm install -g @modelcontextprotocol/server-filesystem``):

    python -m app.screenshots_mcp OUT_DIR

Configures ``mcp-server-filesystem`` over a small demo folder in the app's mcp.json, starts the embedded model,
picks the server under Tools with "Call a tool first", sends a question, saves the approval bar
(mcp-approval-WxH.png), approves, and saves the answer with the call and its result opened
(mcp-tool-call-WxH.png). NINFER_HOME and HOME should point at empty folders.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

from app.screenshots import _until, run_session, screen_saver, start_embedded

QUESTION = "Which directories may you read? Use a tool."
READ_ONLY = ("list_", "read_", "get_", "search_", "directory_tree")  # the filesystem server's tools that change nothing


def _demo_folder(work: Path) -> Path:
    folder = work / "notes"
    folder.mkdir()
    (folder / "todo.md").write_text("- ship the MCP tools\n- write the docs\n")
    (folder / "ideas.txt").write_text("A tray icon that shows the decode speed.\n")
    return folder


async def drive(app, controller, out: Path, work: Path) -> None:
    from PySide6.QtCore import QPoint, Qt
    from PySide6.QtTest import QTest

    command = shutil.which("mcp-server-filesystem")
    if command is None:
        raise SystemExit("mcp-server-filesystem is not installed: npm install -g @modelcontextprotocol/server-filesystem")
    save = screen_saver(app, out)

    await start_embedded(controller, 4096)
    chat = controller.window.chat
    chat.tools.path.parent.mkdir(parents=True, exist_ok=True)
    chat.tools.path.write_text(json.dumps({"mcpServers": {"files": {"command": command,
                                                                   "args": [str(_demo_folder(work))]}}}))
    chat.show_tools([])
    QTest.mouseClick(chat.tools_toggle, Qt.MouseButton.LeftButton)
    for box in (chat.tools_bar.boxes["files"], chat.tools_bar.require):
        QTest.mouseClick(box, Qt.MouseButton.LeftButton, pos=QPoint(8, box.height() // 2))
    chat.max_tokens = 96
    QTest.keyClicks(chat.input, QUESTION)
    QTest.mouseClick(chat.send_button, Qt.MouseButton.LeftButton)
    def succeeded() -> bool:
        return any(m.role == "tool" and not m.stats.get("failed") for m in chat.messages)

    for _ in range(16):  # as a careful user: read-only calls approved, anything that writes denied; else Regenerate
        await _until(lambda: not chat.busy or chat.approval.isVisible(), 300, "a call or the answer")
        if chat.approval.isVisible():
            reads = any(f"<b>{verb}" in chat.approval.label.text() for verb in READ_ONLY)
            if reads and not succeeded():
                await save("mcp-approval")
                QTest.mouseClick(chat.approval.approve_button, Qt.MouseButton.LeftButton)
            else:
                QTest.mouseClick(chat.approval.deny_button, Qt.MouseButton.LeftButton)
            await asyncio.sleep(0.3)
        elif succeeded():
            break
        else:
            QTest.mouseClick(chat.regen_button, Qt.MouseButton.LeftButton)
            await asyncio.sleep(0.5)
    while chat.busy:  # (out of tries: what the last one gave)
        if chat.approval.isVisible():
            QTest.mouseClick(chat.approval.deny_button, Qt.MouseButton.LeftButton)
        await asyncio.sleep(0.3)
    result = next((m for m in chat.messages if m.role == "tool" and not m.stats.get("failed")), None) or \
        next((m for m in chat.messages if m.role == "tool"), None)
    if result is not None:  # the first result opened, as a click on its line does
        chat.expanded ^= {result.id}
    chat.render()
    await save("mcp-tool-call")


def main(argv: list[str] | None = None) -> int:
    return run_session(drive, argv, work=True)


if __name__ == "__main__":
    sys.exit(main())
