"""Markdown-ish text to the simple HTML a QTextBrowser shows, with code highlighting (Qt-free).

Covers what chat answers use: fenced code blocks (highlighted; an unterminated fence while streaming is shown as code
so far), inline code, bold, italic, headings, bullet and numbered lists, block quotes, links. Everything else is
escaped text. The colours come from a theme dict so light and dark palettes both read well.
"""
from __future__ import annotations

import html
import json
import re
from typing import Any

LIGHT = {"text": "#1f2328", "muted": "#656d76", "accent": "#4f46e5", "code_bg": "#f3f4f6", "code_border": "#e5e7eb",
         "user_bg": "#eef2ff", "assistant_bg": "#ffffff", "reasoning_bg": "#f8fafc", "tool_bg": "#fff7ed",
         "error": "#b42318", "keyword": "#8250df", "string": "#0a7f3f", "comment": "#6e7781", "number": "#b35900",
         "builtin": "#0550ae"}
DARK = {"text": "#e6edf3", "muted": "#8d96a0", "accent": "#a5b4fc", "code_bg": "#161b22", "code_border": "#30363d",
        "user_bg": "#1e2540", "assistant_bg": "#0d1117", "reasoning_bg": "#12161d", "tool_bg": "#2a1f12",
        "error": "#ff7b72", "keyword": "#d2a8ff", "string": "#7ee787", "comment": "#8b949e", "number": "#ffa657",
        "builtin": "#79c0ff"}

KEYWORDS = {
    "python": "and as assert async await break class continue def del elif else except False finally for from global "
              "if import in is lambda None nonlocal not or pass raise return True try while with yield match case",
    "js": "async await break case catch class const continue default delete do else export extends false finally for "
          "function if import in instanceof let new null return super switch this throw true try typeof undefined var "
          "void while yield interface type enum implements",
    "c": "auto break case char const continue default do double else enum extern float for goto if int long register "
         "return short signed sizeof static struct switch typedef union unsigned void volatile while bool true false "
         "class public private protected namespace template typename using virtual new delete nullptr fn let mut impl "
         "pub use mod match struct trait self Self func package var go defer",
    "shell": "if then else elif fi for while do done case esac in function return export local echo cd set unset",
    "sql": "select from where insert into values update set delete create table index join left right inner outer on "
           "group by order having limit and or not null as distinct primary key",
}
BUILTINS = {"python": "print len range int str float list dict set tuple open isinstance enumerate zip map filter sum "
                      "min max sorted abs any all super self cls"}
ALIASES = {"py": "python", "python3": "python", "javascript": "js", "ts": "js", "typescript": "js", "jsx": "js",
           "tsx": "js", "json": "js", "cpp": "c", "c++": "c", "java": "c", "rust": "c", "rs": "c", "go": "c",
           "csharp": "c", "cs": "c", "bash": "shell", "sh": "shell", "zsh": "shell", "console": "shell",
           "powershell": "shell", "ps1": "shell", "bat": "shell", "cmd": "shell", "toml": "shell", "yaml": "shell",
           "yml": "shell", "ini": "shell"}
HASH_COMMENT = {"python", "shell"}

_TOKEN = re.compile(r'''(?P<string>"""[\s\S]*?(?:"""|$)|\'\'\'[\s\S]*?(?:\'\'\'|$)|"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?|`(?:\\.|[^`\\])*`?)'''
                    r'''|(?P<comment>\#[^\n]*|//[^\n]*|/\*[\s\S]*?(?:\*/|$)|--[^\n]*)'''
                    r'''|(?P<number>\b\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?\b|\b0[xX][0-9a-fA-F]+\b)'''
                    r'''|(?P<word>[A-Za-z_][A-Za-z0-9_]*)''')


def language(tag: str) -> str:
    tag = (tag or "").strip().lower()
    return ALIASES.get(tag, tag)


def highlight(code: str, lang: str, theme: dict[str, str]) -> str:
    """Escaped HTML of ``code`` with keywords, builtins, strings, comments and numbers coloured."""
    lang = language(lang)
    keywords = set(KEYWORDS.get(lang, "").split())
    if lang in ("sql",):
        keywords |= {k.upper() for k in keywords}
    builtins = set(BUILTINS.get(lang, "").split())
    known = lang in KEYWORDS
    out, pos = [], 0
    for m in _TOKEN.finditer(code):
        kind, text = m.lastgroup, m.group()
        if kind == "comment":
            hash_ok = text.startswith("#") and (lang in HASH_COMMENT or not known)
            dash_ok = text.startswith("--") and lang == "sql"
            slash_ok = text.startswith("/") and lang not in HASH_COMMENT
            if not (hash_ok or dash_ok or slash_ok):
                continue  # e.g. "#include" in C is not a comment, "--flag" in a shell line neither
        if kind == "string" and text.startswith("`") and lang not in ("js", "shell"):
            continue
        color = None
        if kind == "word":
            color = theme["keyword"] if text in keywords else theme["builtin"] if text in builtins else None
        else:
            color = theme[kind]
        if color is None:
            continue
        out.append(html.escape(code[pos:m.start()]))
        style = f"color:{color}" + (";font-style:italic" if kind == "comment" else "")
        out.append(f'<span style="{style}">{html.escape(text)}</span>')
        pos = m.end()
    out.append(html.escape(code[pos:]))
    return "".join(out)


def code_block(code: str, lang: str, theme: dict[str, str], copy_href: str | None = None,
               copied: bool = False) -> str:
    """A highlighted block; with ``copy_href`` its header has a Copy link ("Copied ✓" right after a copy)."""
    copy = ""
    if copy_href:
        copy = (f'<span style="color:{theme["muted"]}">Copied ✓</span>' if copied else
                f'<a href="{html.escape(copy_href, quote=True)}" style="color:{theme["accent"]};'
                f'text-decoration:none">Copy code</a>')
    head = html.escape(lang) + ("&nbsp;&nbsp;·&nbsp;&nbsp;" if lang and copy else "") + copy
    label = f'<div style="color:{theme["muted"]};font-size:small">{head}</div>' if head else ""
    return (f'<table width="100%" cellspacing="0" cellpadding="8" style="margin:6px 0" bgcolor="{theme["code_bg"]}">'
            f'<tr><td style="border:1px solid {theme["code_border"]}">{label}<pre style="margin:0;'
            f'white-space:pre-wrap;font-family:monospace">{highlight(code.rstrip(chr(10)), lang, theme)}</pre></td></tr></table>')


_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_BOLD = re.compile(r"\*\*(.+?)\*\*|__(.+?)__")
_ITALIC = re.compile(r"(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?!\w)|(?<![\w_])_(?!\s)(.+?)(?<!\s)_(?!\w)")
_LINK = re.compile(r"\[([^\]]+)\]\((https?://[^)\s]+)\)")
_URL = re.compile(r"(?<![\"'=>])\b(https?://[^\s<]+[^\s<.,;:!?)\]'\"])")


def inline(text: str, theme: dict[str, str]) -> str:
    """Inline markdown of one line of text -> HTML (the text is escaped first)."""
    codes: list[str] = []

    def keep_code(m):
        codes.append(f'<code style="background-color:{theme["code_bg"]};font-family:monospace">'
                     f'{html.escape(m.group(1))}</code>')
        return f"\x00{len(codes) - 1}\x00"

    text = _INLINE_CODE.sub(keep_code, text)
    links: list[str] = []

    def keep_link(m):
        links.append(f'<a href="{html.escape(m.group(2), quote=True)}" style="color:{theme["accent"]}">'
                     f'{html.escape(m.group(1))}</a>')
        return f"\x01{len(links) - 1}\x01"

    text = _LINK.sub(keep_link, text)
    text = html.escape(text, quote=False)
    text = _URL.sub(lambda m: f'<a href="{m.group(1)}" style="color:{theme["accent"]}">{m.group(1)}</a>', text)
    text = _BOLD.sub(lambda m: f"<b>{m.group(1) or m.group(2)}</b>", text)
    text = _ITALIC.sub(lambda m: f"<i>{m.group(1) or m.group(2)}</i>", text)
    text = re.sub("\x01(\\d+)\x01", lambda m: links[int(m.group(1))], text)
    return re.sub("\x00(\\d+)\x00", lambda m: codes[int(m.group(1))], text)


_FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+#.-]*)\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_BULLET = re.compile(r"^\s*[-*+]\s+(.*)$")
_NUMBERED = re.compile(r"^\s*(\d+)[.)]\s+(.*)$")


def code_blocks(text: str) -> list[str]:
    """The fenced code blocks of ``text``, in order (what each block's Copy link copies)."""
    blocks, lines, i = [], text.replace("\r\n", "\n").split("\n"), 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        i += 1
        if fence:
            body = []
            while i < len(lines) and not lines[i].strip().startswith(fence.group(1)):
                body.append(lines[i])
                i += 1
            blocks.append("\n".join(body).rstrip("\n"))
            i += 1
    return blocks


def _list_goes_on(lines: list[str], i: int, kind: str) -> bool:
    """Whether the first line after the blank line(s) from i is another item of a list of this kind."""
    j = i + 1
    while j < len(lines) and not lines[j].strip():
        j += 1
    return j < len(lines) and bool((_BULLET if kind == "ul" else _NUMBERED).match(lines[j]))


def markdown(text: str, theme: dict[str, str], code_link: str | None = None, copied: int | None = None) -> str:
    """Markdown-ish ``text`` -> HTML for QTextBrowser. With ``code_link`` each code block links
    ``{code_link}/{block number}`` to copy it; block ``copied`` says it was just copied."""
    out: list[str] = []
    para: list[str] = []
    list_kind: str | None = None
    lines = text.replace("\r\n", "\n").split("\n")
    i = 0
    blocks = 0

    def flush_para():
        if para:
            out.append("<p style=\"margin:4px 0\">" + "<br>".join(inline(p, theme) for p in para) + "</p>")
            para.clear()

    def close_list():
        nonlocal list_kind
        if list_kind:
            out.append(f"</{list_kind}>")
            list_kind = None

    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:
            flush_para()
            close_list()
            marker, lang = fence.group(1), fence.group(2)
            body = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(marker):
                body.append(lines[i])
                i += 1
            href = f"{code_link}/{blocks}" if code_link else None
            out.append(code_block("\n".join(body), lang, theme, href, copied == blocks))
            blocks += 1
            i += 1  # the closing fence (or past the end while streaming)
            continue
        if not line.strip():
            flush_para()
            if not (list_kind and _list_goes_on(lines, i, list_kind)):  # a blank line between items: one list
                close_list()
        elif m := _HEADING.match(line):
            flush_para()
            close_list()
            level = min(len(m.group(1)) + 2, 6)  # h3..h6: headings inside a chat message stay modest
            out.append(f"<h{level} style=\"margin:6px 0 2px 0\">{inline(m.group(2), theme)}</h{level}>")
        elif (m := _BULLET.match(line)) or (m2 := _NUMBERED.match(line)):
            flush_para()
            kind = "ul" if m else "ol"
            if list_kind != kind:
                close_list()
                out.append(f"<{kind} style=\"margin:2px 0\">")
                list_kind = kind
            item = m.group(1) if m else m2.group(2)
            out.append(f"<li>{inline(item, theme)}</li>")
        elif line.lstrip().startswith(">"):
            flush_para()
            close_list()
            out.append(f'<blockquote style="color:{theme["muted"]};margin:4px 12px">'
                       f'{inline(line.lstrip()[1:].strip(), theme)}</blockquote>')
        else:
            if list_kind and line.startswith((" ", "\t")):
                out[-1] = out[-1][:-5] + "<br>" + inline(line.strip(), theme) + "</li>"
            else:
                close_list()
                para.append(line)
        i += 1
    flush_para()
    close_list()
    return "".join(out)


def tool_calls_html(calls: list[dict[str, Any]], theme: dict[str, str]) -> str:
    parts = []
    for call in calls:
        fn = call.get("function", {})
        args = fn.get("arguments", "")
        try:
            args = json.dumps(json.loads(args), indent=2, ensure_ascii=False)
        except (TypeError, ValueError):
            pass
        parts.append(f'<table width="100%" cellspacing="0" cellpadding="6" style="margin:4px 0" '
                     f'bgcolor="{theme["tool_bg"]}"><tr><td><b>Tool call</b> '
                     f'<code style="font-family:monospace">{html.escape(fn.get("name", "?"))}</code>'
                     f'<pre style="margin:2px 0 0 0;white-space:pre-wrap;font-family:monospace">{html.escape(args)}</pre></td></tr></table>')
    return "".join(parts)


def stats_text(stats: dict[str, Any]) -> str:
    """"42 tokens · TTFT 0.31 s · 12.5 tok/s" (whatever is known)."""
    parts = []
    if stats.get("tokens") is not None:
        n = stats["tokens"]
        parts.append(f"{n:,} token{'' if n == 1 else 's'}")
    if stats.get("ttft") is not None:
        parts.append(f"TTFT {stats['ttft']:.2f} s")
    if stats.get("tok_s"):
        parts.append(f"{stats['tok_s']:.1f} tok/s")
    if stats.get("finish") and stats["finish"] not in ("stop",):
        parts.append({"length": "cut at max tokens", "stopped": "stopped", "tool_calls": "tool calls"}.get(
            stats["finish"], stats["finish"]))
    return " · ".join(parts)
