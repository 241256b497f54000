"""The MCP servers of an ``mcp.json`` (Qt-free): read, validate, write.

The file has the shape other apps use (Claude Desktop, Cursor, VS Code's ``mcpServers``)::

    {"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"],
                  "env": {"DEBUG": "1"}},
        "search": {"url": "http://127.0.0.1:9000/mcp", "headers": {"Authorization": "Bearer ..."}}}}

A server is either a command started as a subprocess that speaks MCP over its stdin/stdout (``command``, ``args``,
``env``, ``cwd``) or a streamable HTTP endpoint (``url``, ``headers``). ``"disabled": true`` keeps an entry without
offering it; keys this version does not use are kept as they are when the file is written again. Every problem is
reported at once, each naming the server and the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import NInferError
from engine.userfiles import write_replacing

MAX_BYTES = 1 << 20  # an mcp.json larger than this is not a configuration
STDIO_TYPES = ("stdio",)
HTTP_TYPES = ("http", "streamable-http", "streamable_http", "streamableHttp")
KNOWN = {"command", "args", "env", "cwd", "url", "headers", "type", "disabled"}


class McpConfigError(NInferError):
    """An mcp.json that cannot be used; the message lists every problem."""


@dataclass
class ServerConfig:
    name: str
    command: str | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    disabled: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not use, written back unchanged

    @property
    def transport(self) -> str:
        return "http" if self.url else "stdio"

    def describe(self) -> str:
        """One line for lists: the command line or the URL."""
        if self.url:
            return self.url
        return " ".join([self.command or ""] + [a if " " not in a else json.dumps(a) for a in self.args])

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        if self.url:
            out["url"] = self.url
            if self.headers:
                out["headers"] = dict(self.headers)
        else:
            out["command"] = self.command
            out["args"] = list(self.args)
            if self.env:
                out["env"] = dict(self.env)
            if self.cwd:
                out["cwd"] = self.cwd
        if self.disabled:
            out["disabled"] = True
        return out

    def key(self) -> str:
        """What a session depends on: a change of any of it means a new session."""
        return json.dumps(self.to_json(), sort_keys=True)


def _strings(value: Any, where: str, problems: list[str]) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        problems.append(f"{where} must be a list of strings, e.g. [\"--port\", \"9000\"]")
        return []
    return list(value)


def _mapping(value: Any, where: str, problems: list[str], example: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        problems.append(f"{where} must be an object of strings, e.g. {example}")
        return {}
    return dict(value)


def parse_server(name: str, entry: Any, problems: list[str]) -> ServerConfig | None:
    """One ``mcpServers`` entry; what is wrong with it is added to ``problems`` (then None)."""
    where = f"server \"{name}\""
    before = len(problems)
    if not name.strip():
        problems.append("a server has an empty name: give each server a name")
    if not isinstance(entry, dict):
        problems.append(f"{where} must be an object with \"command\" (a program to start) or \"url\"")
        return None
    kind = entry.get("type")
    if kind is not None and kind not in STDIO_TYPES + HTTP_TYPES:
        reason = ("uses the SSE transport, which this version does not connect to: use the server's streamable "
                  "HTTP endpoint (usually .../mcp) as \"url\"") if kind == "sse" else \
            f"has \"type\": {json.dumps(kind)}: use \"stdio\" (a command) or \"http\" (a url)"
        problems.append(f"{where} {reason}")
    command, url = entry.get("command"), entry.get("url")
    if command is not None and url is not None:
        problems.append(f"{where} has both \"command\" and \"url\": keep one (a command to start, or an URL)")
    elif command is None and url is None:
        problems.append(f"{where} needs \"command\" (a program to start) or \"url\" (a streamable HTTP endpoint)")
    if command is not None and (not isinstance(command, str) or not command.strip()):
        problems.append(f"{where}: \"command\" must be the program to start, e.g. \"npx\" or \"python\"")
    if url is not None and (not isinstance(url, str) or not url.strip().lower().startswith(("http://", "https://"))):
        problems.append(f"{where}: \"url\" must start with http:// or https:// (got {json.dumps(url)})")
    cwd = entry.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        problems.append(f"{where}: \"cwd\" must be a folder path")
    disabled = entry.get("disabled", False)
    if not isinstance(disabled, bool):
        problems.append(f"{where}: \"disabled\" must be true or false")
    server = ServerConfig(
        name=name, command=command.strip() if isinstance(command, str) else None,
        args=_strings(entry.get("args"), f"{where}: \"args\"", problems),
        env=_mapping(entry.get("env"), f"{where}: \"env\"", problems, "{\"API_KEY\": \"...\"}"),
        cwd=cwd if isinstance(cwd, str) and cwd else None,
        url=url.strip() if isinstance(url, str) else None,
        headers=_mapping(entry.get("headers"), f"{where}: \"headers\"", problems,
                         "{\"Authorization\": \"Bearer ...\"}"),
        disabled=disabled is True, extra={k: v for k, v in entry.items() if k not in KNOWN})
    return server if len(problems) == before else None


def parse(data: Any, source: str = "mcp.json") -> dict[str, ServerConfig]:
    """``{"mcpServers": {...}}`` -> {name: ServerConfig}, in the file's order; McpConfigError lists every problem."""
    if not isinstance(data, dict):
        raise McpConfigError(f"{source} must hold a JSON object with \"mcpServers\".",
                             "Write {\"mcpServers\": {}} and add servers to it.")
    servers_in = data.get("mcpServers", {})
    if not isinstance(servers_in, dict):
        raise McpConfigError(f"{source}: \"mcpServers\" must be an object of servers by name.",
                             "Write it as {\"mcpServers\": {\"name\": {\"command\": \"...\"}}}.")
    problems: list[str] = []
    servers = {}
    for name, entry in servers_in.items():
        server = parse_server(name, entry, problems)
        if server is not None:
            servers[name] = server
    if problems:
        raise McpConfigError(f"{source} has problems: " + "; ".join(problems) + ".",
                             "Fix them in MCP servers… or in the file.")
    return servers


def load(path: Path | str) -> dict[str, ServerConfig]:
    """The servers of the file at ``path`` (none when it does not exist)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise McpConfigError(f"Cannot read {path}: {e.strerror or e}.", "Check the file's permissions.") from None
    if size > MAX_BYTES:
        raise McpConfigError(f"{path} is {size:,} bytes, more than an MCP configuration ({MAX_BYTES:,} at most).",
                             "Point to the right file, or remove what is not a server from it.")
    try:
        data = json.loads(path.read_text(encoding="utf-8") or "{}")
    except OSError as e:
        raise McpConfigError(f"Cannot read {path}: {e.strerror or e}.", "Check the file's permissions.") from None
    except ValueError as e:
        raise McpConfigError(f"{path} is not valid JSON ({e}).", "Fix the file, or delete it to start again.") \
            from None
    return parse(data, str(path))


def dump(servers: dict[str, ServerConfig]) -> str:
    return json.dumps({"mcpServers": {name: s.to_json() for name, s in servers.items()}}, indent=2,
                      ensure_ascii=False) + "\n"


def save(path: Path | str, servers: dict[str, ServerConfig]) -> None:
    """Writes the file atomically (keys of other apps' files inside each server kept)."""
    write_replacing(Path(path), dump(servers))
