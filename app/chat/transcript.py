"""The chat transcript as HTML for a QTextBrowser: one table per message (Qt's rich text has no CSS boxes), markdown
and code highlighting from app/chat/render.py, actions as ninfer: links, and the model that wrote each answer once
the conversation holds answers of a model other than the one loaded now; plus the chat header's line of the sampling
values in force (the conversation's own, then the mode's). Qt-free."""
from __future__ import annotations

import html

from app.chat import render, versions
from app.chat.images import thumb_size
from app.chat.tool_render import tool_notice_html, tool_result_html
from app.chat.store import Message


def sampling_text(sampling: dict | None) -> str:
    if not sampling:
        return ""
    names = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
             ("presence_penalty", "presence"), ("frequency_penalty", "frequency"))
    parts = []
    for key, label in names:
        value = sampling.get(key)
        if value is None or (key in ("min_p", "frequency_penalty") and not value):
            continue
        parts.append(f"{label} {value:g}" if isinstance(value, (int, float)) else f"{label} {value}")
    return " · ".join(parts)


OWN_NAMES = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("max_tokens", "max tokens"))


def header_text(sampling: dict | None, own: dict | None, has_modes: bool = True) -> str:
    """The chat header's sampling line: the conversation's own values ("This chat: temperature 0.3 · max tokens
    77"), then what the mode gives the rest (the mode's values the conversation overrides left out)."""
    own = {k: v for k, v in (own or {}).items() if v is not None}
    mode = sampling_text({k: v for k, v in (sampling or {}).items() if k not in own}) if has_modes else \
        "this server has no mode switch"
    if not own:
        return mode
    mine = " · ".join(f"{label} {own[key]:g}" for key, label in OWN_NAMES if isinstance(own.get(key), (int, float)))
    return f"This chat: {mine}" + (f"  —  {'mode: ' if has_modes else ''}{mode}" if mode else "")


def models_shown(messages: list[Message], current: str | None) -> bool:
    """Whether answers name their model: once the conversation holds an answer of a model other than the one loaded
    now (after a switch), every answer with a recorded model says which one wrote it."""
    return any(m.role == "assistant" and m.model and m.model != current for m in messages)


def transcript_html(messages: list[Message], streaming: Message | None, expanded: set[int], t: dict,
                    copied: tuple[int, int | None] | None = None, current_model: str | None = None,
                    busy: bool = False) -> str:
    """``streaming``: the answer being written (shown with a cursor, without actions); ``expanded``: ids of the
    messages whose reasoning is shown; ``t``: the transcript colours (render.LIGHT / render.DARK); ``copied``:
    (message index, code block or None for the whole message) just copied, said in place of its Copy link;
    ``current_model``: the model loaded now (answers of others name theirs, see ``models_shown``); ``busy``: a turn
    is going on (streaming, or waiting on a tool call between its answers): no Regenerate or version links yet."""
    if not messages:
        tip = ("Ask anything. Answers stream from the model through its OpenAI-compatible API; the same API "
               "serves your editor or agent (see the Server tab).")
        return (f'<div style="color:{t["muted"]};margin:40px 30px;text-align:center">'
                f'<p style="font-size:large">Start a conversation</p><p>{html.escape(tip)}</p></div>')
    last_assistant = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
    named = models_shown(messages, current_model)
    out = [f'<div style="color:{t["text"]}">']
    for i, m in enumerate(messages):
        out.append(message_html(i, m, t, last_assistant=i == last_assistant, streaming=m is streaming,
                                expanded=m.id in expanded, copied=copied[1] if copied and copied[0] == i else -1,
                                named=named, busy=busy))
    out.append("</div>")
    return "".join(out)


def message_html(i: int, m: Message, t: dict, *, last_assistant: bool, streaming: bool, expanded: bool,
                 copied: int | None = -1, named: bool = False, busy: bool = False) -> str:
    """One message as a table: who (with ``named``, an answer's model), its stats, reasoning (collapsed unless
    ``expanded``), tool calls, the text and its actions (links the chat view handles: ninfer:copy/N, copycode/N/B,
    edit/N, regen/N, reasoning/N, version/N/K). ``copied``: None when the message was just copied, B when its code
    block B was, else -1."""
    if m.role == "tool":
        return tool_result_html(i, m, t, expanded)
    link = f'style="color:{t["accent"]};text-decoration:none"'
    copy = (f'<span style="color:{t["muted"]}">Copied ✓</span>' if copied is None
            else f'<a href="ninfer:copy/{i}" {link}>Copy</a>')
    if m.role == "user":
        bg, who = t["user_bg"], "You"
        actions = [copy, f'<a href="ninfer:edit/{i}" {link}>Edit</a>']
        n = versions.branch_count(m)
        if n > 1:
            k = m.stats.get("branch", n - 1)
            prev = f'<a href="ninfer:branch/{i}/{k - 1}" {link}>‹</a>' if k > 0 else "‹"
            after = f'<a href="ninfer:branch/{i}/{k + 1}" {link}>›</a>' if k < n - 1 else "›"
            actions.append(f"{prev}&nbsp;edit {k + 1} of {n}&nbsp;{after}")
    else:
        bg, who = t["assistant_bg"], "Assistant"
        actions = [copy]
        if last_assistant and not (streaming or busy):
            actions.append(f'<a href="ninfer:regen/{i}" {link}>Regenerate</a>')
        n = versions.count(m)
        if n > 1 and not (streaming or busy):
            k = m.stats.get("version", n - 1)
            prev = f'<a href="ninfer:version/{i}/{k - 1}" {link}>‹</a>' if k > 0 else "‹"
            after = f'<a href="ninfer:version/{i}/{k + 1}" {link}>›</a>' if k < n - 1 else "›"
            actions.append(f"{prev}&nbsp;version {k + 1} of {n}&nbsp;{after}")
    body = []
    if m.stats.get("left_out"):
        n = m.stats["left_out"]
        body.append(f'<p style="color:{t["muted"]};font-size:small">⚠ The {n} oldest message{"s" if n > 1 else ""} '
                    f'of this conversation {"were" if n > 1 else "was"} left out of this answer\'s prompt to fit the '
                    f'model\'s context.</p>')
    if m.stats.get("tool_notice"):
        body.append(tool_notice_html(m.stats["tool_notice"], t))
    if m.reasoning:
        shown = expanded
        arrow = "▾" if shown else "▸"
        words = len(m.reasoning.split())
        body.append(f'<p style="margin:2px 0"><a href="ninfer:reasoning/{i}" {link}>{arrow} Reasoning '
                    f'({words} words)</a></p>')
        if shown:
            body.append(f'<table width="100%" cellpadding="6" bgcolor="{t["reasoning_bg"]}"><tr><td '
                        f'style="color:{t["muted"]}">{render.markdown(m.reasoning, t)}</td></tr></table>')
    if m.tool_calls:
        body.append(render.tool_calls_html(m.tool_calls, t))
    if m.images:
        body.append(images_html(i, m, t))
    if streaming:
        body.append(render.markdown(m.content + "▍", t))  # the cursor follows the text, even inside code
    elif m.content:
        body.append(render.markdown(m.content, t, f"ninfer:copycode/{i}", copied if copied != -1 else None))
    if m.stats.get("error"):
        body.append(f'<p style="color:{t["error"]}">⚠ {html.escape(m.stats["error"])}</p>')
    stats = render.stats_text(m.stats) if m.role == "assistant" and not streaming else ""
    meta = f'<span style="color:{t["muted"]};font-size:small">&nbsp;&nbsp;{html.escape(stats)}</span>'
    if named and m.role == "assistant" and m.model:  # the model that wrote this answer
        meta = f'&nbsp;<span style="color:{t["accent"]};font-size:small">· {html.escape(m.model)}</span>' + meta
    acts = (f'<p style="margin:4px 0 0 0;font-size:small">{" &nbsp;·&nbsp; ".join(actions)}</p>'
            if not streaming else "")
    return (f'<table width="100%" cellspacing="0" cellpadding="10" style="margin:6px 4px" bgcolor="{bg}">'
            f'<tr><td><b>{who}</b>{meta}{"".join(body)}{acts}</td></tr></table>')


def images_html(i: int, m: Message, t: dict) -> str:
    """A message's images as thumbnails (drawn by the chat's browser from ninfer-image:KEY), each a link that opens
    it bigger (ninfer:image/N/K)."""
    out = []
    for k, im in enumerate(m.images):
        w, h = thumb_size(im.width, im.height)
        title = html.escape(f"{im.name} ({im.width} x {im.height}): click to open it bigger", quote=True)
        out.append(f'<a href="ninfer:image/{i}/{k}" title="{title}"><img src="ninfer-image:{im.key}" width="{w}" '
                   f'height="{h}" alt="{html.escape(im.name, quote=True)}"></a>')
    return (f'<p style="margin:6px 0;color:{t["muted"]}">' + "&nbsp;&nbsp;".join(out) + "</p>")
