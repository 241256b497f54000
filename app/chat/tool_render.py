"""An MCP tool's result in the transcript (Qt-free HTML): collapsed to one line (▸ Result of server__tool, its size
and time) unless expanded by its link (ninfer:result/N); a failed call (the server crashed, the call timed out, the
result was not MCP, the user denied it) shows its message at once, in the error colour."""
from __future__ import annotations

import html

from app.chat.store import Message

PREVIEW_CHARS = 80


def tool_result_html(i: int, m: Message, t: dict, expanded: bool) -> str:
    link = f'style="color:{t["accent"]};text-decoration:none"'
    name = html.escape(m.stats.get("tool") or "tool")
    took = m.stats.get("seconds")
    meta = f" · {took:.2f} s" if isinstance(took, (int, float)) else ""
    if m.stats.get("failed"):
        body = (f'<p style="margin:2px 0;color:{t["error"]}">⚠ <b>{name}</b>: '
                f'{html.escape(m.content)}</p>')
    else:
        arrow, n = "▾" if expanded else "▸", len(m.content)
        preview = " ".join(m.content.split())
        preview = preview[:PREVIEW_CHARS] + ("…" if len(preview) > PREVIEW_CHARS else "")
        body = (f'<p style="margin:2px 0"><a href="ninfer:result/{i}" {link}>{arrow} Result of {name}</a>'
                f'<span style="color:{t["muted"]};font-size:small"> ({n:,} character{"" if n == 1 else "s"}{meta})'
                f'{"" if expanded else "  " + html.escape(preview)}</span></p>')
        if expanded:
            body += (f'<pre style="margin:2px 0 0 0;white-space:pre-wrap;font-family:monospace">'
                     f'{html.escape(m.content)}</pre>')
    return (f'<table width="100%" cellspacing="0" cellpadding="6" style="margin:2px 4px" bgcolor="{t["tool_bg"]}">'
            f'<tr><td>{body}</td></tr></table>')


def tool_notice_html(text: str, t: dict) -> str:
    """Why some tools are off for this answer (a server that cannot be started or listed, a broken mcp.json)."""
    return f'<p style="color:{t["error"]};font-size:small">⚠ {html.escape(text)}</p>'
