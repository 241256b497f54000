"""Reading a Responses API request as Codex CLI sends it: the input items become chat messages, the tools chat
function tools, and the model's calls map back to the output item of their kind.

Tools: `function`; `namespace` (a named group of function and custom tools: each is offered to the model as
NAMESPACE__NAME, and its calls come back with `namespace` set); `custom` (free-form text input: offered as a
function with one string argument `input`; a regex grammar `format` constrains that string when the call is forced,
a lark grammar is shown to the model in the description); `local_shell` (a function `local_shell` taking the
command as a list of words). Hosted tools the server cannot run (web_search, file_search, image_generation,
code_interpreter, computer use, ...; `mcp` without --mcp-config) are left out of the prompt and listed in
`omitted_tools`. Input may hold the `mcp_call` and `mcp_list_tools` items of an earlier answer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.mcp.names import exposed_name
from engine.server.errors import APIError, shown
from engine.server.images import image_part
from engine.server.omitted import hosted_tool_name

LOCAL_SHELL = "local_shell"
_LOCAL_SHELL_PARAMS = {"type": "object", "properties": {
    "command": {"type": "array", "items": {"type": "string"}, "description": "The command and its arguments."},
    "workdir": {"type": "string", "description": "The directory to run it in."},
    "timeout_ms": {"type": "integer", "description": "Time limit in milliseconds."}}, "required": ["command"]}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")


@dataclass
class Offered:
    kind: str  # "function", "custom" or "local_shell"
    name: str  # the tool's own name
    namespace: str | None = None
    lark: bool = False  # a custom tool whose input follows a lark grammar (shown to the model, not enforced)


@dataclass
class ResponseTools:
    chat: list[dict] = field(default_factory=list)  # chat function tools, as the model sees them
    offered: dict[str, Offered] = field(default_factory=dict)  # model-facing name -> what it stands for
    omitted: list[str] = field(default_factory=list)  # hosted tool types left out

    def model_name(self, name: Any, namespace: Any = None) -> str:
        if not isinstance(name, str) or not (namespace is None or isinstance(namespace, str)):
            raise APIError(400, "A call's name and namespace must be strings.", param="input")
        return joined(namespace, name) if namespace else name

    def output_item(self, call_id: str, name: str, arguments: str, item_id: str) -> dict:
        """The output item of a parsed call (name as the model wrote it, arguments a JSON object as text)."""
        tool = self.offered.get(name, Offered("function", name))
        extra = {"namespace": tool.namespace} if tool.namespace else {}
        if tool.kind == "custom":
            args = json.loads(arguments or "{}")
            text = args.get("input") if isinstance(args.get("input"), str) else arguments
            return {"type": "custom_tool_call", "id": item_id, "call_id": call_id, "name": tool.name, "input": text,
                    "status": "completed", **extra}
        if tool.kind == LOCAL_SHELL:
            args = json.loads(arguments or "{}")
            command = args.get("command")
            command = ["bash", "-lc", command] if isinstance(command, str) else list(command or [])
            action = {"type": "exec", "command": [str(c) for c in command], "env": {},
                      "working_directory": args.get("workdir"), "timeout_ms": args.get("timeout_ms")}
            return {"type": "local_shell_call", "id": item_id, "call_id": call_id, "status": "completed",
                    "action": action}
        return {"type": "function_call", "id": item_id, "call_id": call_id, "name": tool.name,
                "arguments": arguments, "status": "completed", **extra}


def joined(namespace: str, name: str) -> str:
    return namespace + name if namespace.endswith("_") else f"{namespace}__{name}"


def _custom_function(t: dict, where: str) -> dict:
    fmt = t.get("format") if isinstance(t.get("format"), dict) else {}
    text_schema: dict[str, Any] = {"type": "string", "description": "The whole input, as free-form text."}
    description = (t.get("description") or "").strip()
    if fmt.get("type") == "grammar":
        definition = str(fmt.get("definition", ""))
        if fmt.get("syntax") == "regex":
            text_schema["pattern"] = definition
        else:
            description += f"\nThe input must follow this {fmt.get('syntax', 'lark')} grammar:\n{definition}"
    elif fmt.get("type") not in (None, "text"):
        raise APIError(400, f"{where}.format.type must be text or grammar, not {shown(fmt.get('type'))}.",
                       param=f"{where}.format")
    return {"name": t.get("name"), "description": description.strip(),
            "parameters": {"type": "object", "properties": {"input": text_schema}, "required": ["input"]}}


def _lark(t: dict) -> bool:
    fmt = t.get("format") if isinstance(t.get("format"), dict) else {}
    return fmt.get("type") == "grammar" and fmt.get("syntax", "lark") != "regex"


def _function(t: dict) -> dict:
    return {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}


def read_tools(tools: list[dict] | None) -> ResponseTools:
    out = ResponseTools()

    def offer(fn: dict, tool: Offered, where: str) -> None:
        if not isinstance(fn.get("name"), str) or not isinstance(tool.name, str):
            raise APIError(400, f"{where}.name must be a string: the tool's name.", param=f"{where}.name")
        out.chat.append({"type": "function", "function": fn})
        out.offered[fn["name"]] = tool

    for i, t in enumerate(tools or []):
        where = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "function":
            offer(_function(t), Offered("function", t.get("name")), where)
        elif kind == "custom":
            offer(_custom_function(t, where), Offered("custom", t.get("name"), lark=_lark(t)), where)
        elif kind == LOCAL_SHELL:
            offer({"name": LOCAL_SHELL, "description": "Runs a command on the user's computer and returns its "
                   "output.", "parameters": _LOCAL_SHELL_PARAMS}, Offered(LOCAL_SHELL, LOCAL_SHELL), where)
        elif kind == "namespace":
            ns = t.get("name")
            if not isinstance(ns, str) or not ns:
                raise APIError(400, f"{where}.name must name the namespace.", param=f"{where}.name")
            note = (t.get("description") or "").strip()
            for j, sub in enumerate(t.get("tools") or []):
                sub_kind = sub.get("type") if isinstance(sub, dict) else None
                if sub_kind not in ("function", "custom"):
                    raise APIError(400, f"{where}.tools[{j}] has type {shown(sub_kind)}; a namespace holds function "
                                        f"and custom tools.", param=f"{where}.tools[{j}].type")
                fn = _function(sub) if sub_kind == "function" else _custom_function(sub, f"{where}.tools[{j}]")
                if not isinstance(sub.get("name"), str):
                    raise APIError(400, f"{where}.tools[{j}].name must be a string.", param=f"{where}.tools[{j}].name")
                fn["name"] = joined(ns, sub["name"])
                if note:
                    fn["description"] = f"{fn.get('description', '')} ({ns}: {note})".strip()
                offer(fn, Offered(sub_kind, sub["name"], ns, lark=_lark(sub)), f"{where}.tools[{j}]")
        elif isinstance(kind, str):
            out.omitted.append(hosted_tool_name(kind, f"{where}.type"))
        else:
            raise APIError(400, f"{where} must be an object with a type.", param=where)
    return out


def read_tool_choice(choice: Any, tools: ResponseTools) -> Any:
    """Responses tool_choice -> chat tool_choice."""
    if not isinstance(choice, dict):
        return choice
    kind = choice.get("type")
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        name = tools.model_name(choice["name"], choice.get("namespace"))
        if tools.offered.get(name, Offered("function", name)).lark:
            raise APIError(400, f"tool_choice forces the custom tool {shown(choice['name'])}, whose input follows a "
                                f"lark grammar: a forced call's input cannot be held to a lark grammar here. Use "
                                f"tool_choice \"auto\" (the grammar is shown to the model), or give the tool a regex "
                                f"format, which a forced call does follow.", param="tool_choice")
        return {"type": "function", "function": {"name": name}}
    if kind == LOCAL_SHELL:
        return {"type": "function", "function": {"name": LOCAL_SHELL}}
    if kind == "allowed_tools":
        return "required" if choice.get("mode") == "required" else "auto"
    return "auto"  # a hosted tool: it was left out, so the model may answer as it likes


def _text(content: Any, where: str) -> str:
    content = _content(content, where, images=False)
    return content if isinstance(content, str) else ""


def _content(content: Any, where: str, images: bool = True) -> str | list[dict]:
    """A message's (or a call output's) text, or chat content parts when it holds an input_image (`images`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            key = "refusal" if kind == "refusal" else "text"
            text = part.get(key, "")
            if not isinstance(text, str):
                raise APIError(400, f"{where}[{j}].{key} must be a string, not {type(text).__name__}.",
                               param=f"{where}[{j}].{key}")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image" and images:
            parts.append(_input_image(part, f"{where}[{j}]"))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise APIError(400, f"{where}[{j}] is an {kind} part, which is not accepted here (images go in user "
                                f"messages and call outputs; files and audio are not read). Send text.",
                           param=f"{where}[{j}]")
        else:
            raise APIError(400, f"{where}[{j}] has type {shown(kind)}; content parts may be input_text, output_text "
                                f"or input_image.", param=f"{where}[{j}]")
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _input_image(part: dict, where: str) -> dict:
    """An input_image part ({"image_url": "<data: or http(s) URL>", "detail": ...}) as engine.server.images reads
    it; `detail` is accepted and ignored (the model's processor sizes every image alike)."""
    if part.get("file_id") is not None:
        raise APIError(400, f"{where} names a file_id: this server stores no files, so images by file id are not "
                            f"supported. Send the image in image_url as a data:image/...;base64,... URI.",
                       param=f"{where}.file_id")
    url = part.get("image_url")
    if not isinstance(url, str):
        raise APIError(400, f"{where}.image_url must be a string: a data:image/...;base64,... URI (or an http(s) URL "
                            f"where the server fetches them).", param=f"{where}.image_url")
    return image_part(url, where, kind="input_image part")


def _output(item: dict, where: str) -> str | list[dict]:
    output = item.get("output")
    if isinstance(output, (str, list)):
        return _content(output, where + ".output")
    return json.dumps(output)


def read_input(instructions: str | None, items: str | list[dict], tools: ResponseTools) -> list[dict]:
    """Responses input -> chat messages: calls become assistant tool_calls, their outputs tool messages, reasoning
    is attached to the next assistant message as reasoning_content (kept or dropped by the template)."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    reasoning: list[str] = []

    def call(call_id: Any, name: str, arguments: str) -> None:
        entry = {"id": str(call_id or ""), "type": "function", "function": {"name": name, "arguments": arguments}}
        last = messages[-1] if messages else None
        if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
            last["tool_calls"].append(entry)
        else:
            messages.append(assistant({"content": "", "tool_calls": [entry]}))

    def assistant(message: dict) -> dict:
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return {"role": "assistant", **message}

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object.", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant.",
                               param=f"{where}.role")
            if role == "assistant":
                messages.append(assistant({"content": _text(item.get("content"), f"{where}.content")}))
            else:
                messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "reasoning":
            text = _text(item.get("content") or item.get("summary") or [], f"{where}.content")
            if text:  # only encrypted_content (another provider's): nothing this model can read
                reasoning.append(text)
        elif kind == "function_call":
            call(item.get("call_id") or item.get("id"), tools.model_name(item.get("name"), item.get("namespace")),
                 item.get("arguments") or "{}")
        elif kind == "custom_tool_call":
            call(item.get("call_id") or item.get("id"), tools.model_name(item.get("name"), item.get("namespace")),
                 json.dumps({"input": item.get("input") or ""}, ensure_ascii=False))
        elif kind == "local_shell_call":
            action = item.get("action") or {}
            args = {"command": action.get("command") or []}
            args.update({k: v for k, v in (("workdir", action.get("working_directory")),
                                           ("timeout_ms", action.get("timeout_ms"))) if v is not None})
            call(item.get("call_id") or item.get("id"), LOCAL_SHELL, json.dumps(args, ensure_ascii=False))
        elif kind == "mcp_call":  # a server-side MCP call of an earlier answer: the call and its output
            call(item.get("id"), exposed_name(str(item.get("server_label")), str(item.get("name"))),
                 item.get("arguments") or "{}")
            messages.append({"role": "tool", "tool_call_id": str(item.get("id") or ""),
                             "content": str(item.get("output") or "")})
        elif kind == "mcp_list_tools":
            continue  # the tools are offered again with the request's own mcp tools
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or item.get("id") or ""),
                             "content": _output(item, where)})
        else:
            raise APIError(400, f"{where} has type {shown(kind)}; supported: message, reasoning, function_call, "
                                f"function_call_output, custom_tool_call, custom_tool_call_output, local_shell_call, "
                                f"local_shell_call_output, mcp_call, mcp_list_tools.", param=f"{where}.type")
    return messages
