"""Whether a tool's parameters schema is a JSON Schema at all: the keywords it uses have the types the JSON Schema
specification gives them ("type" a type name, "properties" an object of schemas, "required" a list of names, ...).

Checked for every offered tool, whatever tool_choice says (a strict server refuses a malformed schema even when no
call is forced). Keywords this check does not know are left alone: the schema may use any extension.
"""
from __future__ import annotations

from typing import Any

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
MAX_DEPTH = 64
_SCHEMA = ("not", "additionalProperties", "additionalItems", "contains", "propertyNames", "if", "then", "else",
           "unevaluatedProperties", "unevaluatedItems", "contentSchema")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")
_NUMBERS = ("minimum", "maximum", "multipleOf")
_STRINGS = ("$ref", "$id", "$schema", "pattern", "format", "title", "description", "$anchor", "$comment")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def schema_problems(schema: Any, where: str, limit: int = 5) -> list[str]:
    """Up to `limit` problems with `schema` (each naming its path, e.g. tools[0].function.parameters.properties.x);
    empty when the schema is well formed."""
    problems: list[str] = []
    stack = [(schema, where, 0)]
    while stack and len(problems) < limit:
        node, path, depth = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            problems.append(f"{path} must be a JSON Schema (an object or true/false), not {type(node).__name__}")
            continue
        if depth > MAX_DEPTH:
            problems.append(f"{path} nests schemas deeper than {MAX_DEPTH} levels")
            continue
        problems += _keyword_problems(node, path)
        children = [(node[k], f"{path}.{k}") for k in _SCHEMA if k in node]
        if "items" in node:  # a schema, or (older drafts) a list of them
            items = node["items"]
            children += ([(s, f"{path}.items[{i}]") for i, s in enumerate(items)] if isinstance(items, list)
                         else [(items, f"{path}.items")])
        for k in _SCHEMA_MAP:
            if isinstance(node.get(k), dict):
                children += [(s, f"{path}.{k}.{name}") for name, s in node[k].items()]
        for k in _SCHEMA_LIST:
            if isinstance(node.get(k), list):
                children += [(s, f"{path}.{k}[{i}]") for i, s in enumerate(node[k])]
        stack.extend((s, p, depth + 1) for s, p in reversed(children))
    return problems[:limit]


def _keyword_problems(node: dict, path: str) -> list[str]:
    out = []
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "type" in node and (not kinds or not all(isinstance(k, str) and k in TYPES for k in kinds)):
        out.append(f"{path}.type must be one of {', '.join(TYPES)} (or a list of them), not {_shown(kind)}")
    for k in _SCHEMA_MAP:
        if k in node and not isinstance(node[k], dict):
            out.append(f"{path}.{k} must be an object of schemas")
    for k in _SCHEMA_LIST:
        if k in node and (not isinstance(node[k], list) or not node[k]):
            out.append(f"{path}.{k} must be a non-empty list of schemas")
    required = node.get("required")
    if "required" in node and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        out.append(f"{path}.required must be a list of property names")
    if "enum" in node and not isinstance(node["enum"], list):
        out.append(f"{path}.enum must be a list")
    for k in _COUNTS:
        if k in node and not (isinstance(node[k], int) and not isinstance(node[k], bool) and node[k] >= 0):
            out.append(f"{path}.{k} must be a whole number >= 0")
    for k in _NUMBERS:
        if k in node and not _number(node[k]):
            out.append(f"{path}.{k} must be a number")
    for k in ("exclusiveMinimum", "exclusiveMaximum"):  # a number, or (draft 4) a boolean
        if k in node and not (_number(node[k]) or isinstance(node[k], bool)):
            out.append(f"{path}.{k} must be a number")
    for k in _STRINGS:
        if k in node and not isinstance(node[k], str):
            out.append(f"{path}.{k} must be a string")
    return out


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"
