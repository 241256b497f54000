"""Reading a chat model's output: reasoning, tool calls, and the request's `tools` / `tool_choice`.

Typical use for one choice (feed the detokenized text deltas; whole-text functions give the same result):

    splitter = ReasoningSplitter(starts_in_reasoning=...)       # reasoning.py
    calls = ToolCallStreamer(offered_tools(req.tools, req.tool_choice))   # toolcalls.py
    reasoning, content = splitter.feed(delta)
    events = calls.feed(content)      # ("content", text), ("tool_call" / "tool_args" / "tool_end", index, ...)
    ... at the end: splitter.flush(), then calls.feed(<its content>) + calls.flush()

Pure Python: nothing here touches the engine.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from engine.server.errors import shown
from engine.server.reasoning import ReasoningSplitter, split_reasoning
from engine.server.schemacheck import schema_problems
from engine.server.callevents import ToolCall, new_call_id
from engine.server.toolcalls import ParsedOutput, StreamEvent, ToolCallStreamer, parse_tool_calls

__all__ = ["ParsedOutput", "ReasoningSplitter", "StreamEvent", "ToolCall", "ToolCallStreamer", "new_call_id",
           "offered_tools", "parse_tool_calls", "required_tool", "split_reasoning", "tool_names_for", "validate_tools"]

TOOL_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
TOOL_CHOICE_MODES = ("none", "auto", "required")


def _tool_name(tool: Any) -> str | None:
    if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
        name = tool["function"].get("name")
        return name if isinstance(name, str) else None
    return None


def chosen_name(tool_choice: Any) -> str | None:
    """The function a tool_choice object names: {"type": "function", "function": {"name": ...}} (or the flat
    {"type": "function", "name": ...}); None for the string modes."""
    if not isinstance(tool_choice, dict):
        return None
    holder = tool_choice.get("function") if isinstance(tool_choice.get("function"), dict) else tool_choice
    name = holder.get("name")
    return name if isinstance(name, str) else None


def tool_names_for(tools: list[dict] | None, tool_choice: str | dict | None = None) -> set[str]:
    """Names whose calls count in the output: the offered tools, only the named one for a named tool_choice, none
    for tool_choice "none" or when no tools are offered (then everything stays content)."""
    if not tools or tool_choice == "none":
        return set()
    named = chosen_name(tool_choice)
    if named is not None:
        return {named}
    return {name for name in map(_tool_name, tools) if name}


def offered_tools(tools: list[dict] | None, tool_choice: str | dict | None = None) -> dict[str, dict]:
    """tool_names_for's names, each with its parameters schema (the parser reads XML parameters by their type)."""
    names = tool_names_for(tools, tool_choice)
    out = {}
    for tool in tools or []:
        name = _tool_name(tool)
        if name in names:
            params = tool["function"].get("parameters")
            out[name] = params if isinstance(params, dict) else {}
    return out


def required_tool(tool_choice: str | dict | None) -> str | Literal[True] | None:
    """True when some tool call is mandatory ("required"), the function's name when tool_choice names one, None when
    the model may answer in text ("auto", "none", absent)."""
    if tool_choice == "required":
        return True
    return chosen_name(tool_choice)


def validate_tools(tools: Any, tool_choice: Any = None) -> list[str]:
    """Problems with a request's tools and tool_choice, as messages for a 400 answer; empty when all is well."""
    problems: list[str] = []
    names: list[str] = []
    if tools is not None and not isinstance(tools, list):
        return ["tools must be a list of {\"type\": \"function\", \"function\": {...}} objects"]
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            problems.append(f"{where} must be an object")
            continue
        if tool.get("type") != "function":
            problems.append(f"{where}.type must be \"function\" (got {shown(tool.get('type'))})")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            problems.append(f"{where}.function must be an object with a name")
            continue
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
            problems.append(f"{where}.function.name must be 1 to 128 letters, digits, '_' or '-' (got {shown(name)})")
        elif name in names:
            problems.append(f"{where}.function.name {name!r} is used by more than one tool")
        else:
            names.append(name)
        if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
            problems.append(f"{where}.function.description must be a string")
        if "parameters" in fn and fn["parameters"] is not None and not isinstance(fn["parameters"], dict):
            problems.append(f"{where}.function.parameters must be a JSON Schema object")
        elif isinstance(fn.get("parameters"), dict):
            problems += schema_problems(fn["parameters"], f"{where}.function.parameters")
    if tool_choice is None or tool_choice in TOOL_CHOICE_MODES:
        if tool_choice == "required" and not tools:
            problems.append("tool_choice \"required\" needs at least one tool in tools")
    elif isinstance(tool_choice, dict):
        named = chosen_name(tool_choice)
        if tool_choice.get("type", "function") != "function" or named is None:
            problems.append("tool_choice must be \"none\", \"auto\", \"required\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        elif named not in names:
            problems.append(f"tool_choice names the function {shown(named)}, which is not among the tools")
    else:
        problems.append(f"tool_choice must be \"none\", \"auto\", \"required\" or a function object "
                        f"(got {shown(tool_choice)})")
    return problems
