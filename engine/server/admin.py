"""The server's own routes: ``GET /metrics`` (Prometheus) and ``GET|PUT /ninfer/v1/settings`` (mode and sampling
defaults, switched live).

Only the settings that requests read at request time can change while the server runs (``LIVE_KEYS``); every other
setting is fixed at startup and a PUT naming one is refused with the flag to restart with. New values go through the
same validation as at startup (``settings_from_mapping``), and the effective defaults are rebuilt with
``sampling_defaults``, so an explicit sampling value still wins over the mode's preset, exactly as on the command line.
"""
from __future__ import annotations

import asyncio
import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.config.loading import BY_NAME, ConfigError, settings_from_mapping
from engine.server.bodyjson import check_size, loads
from engine.server.errors import APIError, invalid_text_at, invalid_text_message, json_type, shown
from engine.server.schemas import INT32_MAX
from engine.server.state import ServerState

SETTINGS_PATH = "/ninfer/v1/settings"
SOURCE = "api:PUT " + SETTINGS_PATH
# Read per request (engine/server/generation.py, chat.py), so a change applies to the next request.
LIVE_KEYS = ("mode", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "greedy",
             "default_max_tokens", "default_reasoning_effort")


_NUMBER = {"type": ["number", "null"]}
_PUT_SCHEMA = {  # the JSON types of the body (read by hand); each value's range is the config machinery's check
    "type": "object", "additionalProperties": False, "minProperties": 1,
    "properties": {"mode": {"type": "string", "enum": ["chat", "agent"]}, "temperature": _NUMBER, "top_p": _NUMBER,
                   "top_k": {"type": ["integer", "null"], "maximum": INT32_MAX}, "min_p": _NUMBER,
                   "presence_penalty": _NUMBER,
                   "frequency_penalty": _NUMBER, "greedy": {"type": "boolean"},
                   "default_max_tokens": {"type": "integer", "minimum": 1, "maximum": INT32_MAX},
                   "default_reasoning_effort": {"type": "string",
                                                "enum": ["auto", "none", "low", "medium", "high"]}},
}


def _json_problem(key: str, value: object) -> str | None:
    """What is wrong with a PUT value's JSON type or size (the config machinery, made for flags and TOML, would
    read "5" as 5 and "yes" as true); None when it may go on to the setting's own checks."""
    expected = _PUT_SCHEMA["properties"][key]
    kinds = expected.get("type", "string")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    fits = {"string": isinstance(value, str), "boolean": isinstance(value, bool), "null": value is None,
            "integer": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool)}
    if not any(fits[k] for k in kinds):
        return f"must be {' or '.join(_KIND_NAMES[k] for k in kinds)}, not {json_type(value)}"
    if fits["integer"] and "integer" in kinds and abs(value) > INT32_MAX:
        return f"must be at most {INT32_MAX}"
    return None


_KIND_NAMES = {"string": "a string", "boolean": "true or false", "null": "null", "integer": "a whole number",
               "number": "a number"}


def settings_view(state: ServerState) -> dict:
    """The answer of GET (and PUT): the mode, the effective sampling defaults and every non-secret setting."""
    s = state.settings
    ctx = state.loaded.context_window if state.loaded is not None else None
    shown = [f.name for f in dataclasses.fields(s) if f.name in BY_NAME and not BY_NAME[f.name].secret]
    return {
        "mode": s.mode,
        "sampling": dict(state.defaults),
        "greedy": bool(s.greedy),
        "model_ids": list(state.model_ids),
        "context_window": ctx,
        "live_keys": list(LIVE_KEYS),
        "settings": {name: getattr(s, name) for name in shown},
        "sources": {name: s.source(name) for name in shown},
    }


def _problem_text(e: ConfigError) -> str:
    # without the "[source]" prefix and the startup advice ("fix it, or remove it to use the default ...")
    return "; ".join(p.split("] ", 1)[-1].split("; fix it", 1)[0] for p in e.problems)


def updated_settings(state: ServerState, changes: object):
    """The settings with ``changes`` (setting name -> value) applied; raises APIError(400) naming the field."""
    if not isinstance(changes, dict):
        raise APIError(400, "The body must be a JSON object of settings, e.g. {\"mode\": \"agent\"}.",
                       code="invalid_request")
    if not changes:
        raise APIError(400, f"No settings given; the ones that can change while running are "
                            f"{', '.join(LIVE_KEYS)}.", code="invalid_request")
    where = invalid_text_at(changes)
    if where is not None:
        raise APIError(400, invalid_text_message(where), code="invalid_request", param=where)
    values = {}
    for key, raw in changes.items():
        if key not in LIVE_KEYS:
            if key in BY_NAME:
                raise APIError(400, f"{key} cannot be changed while running; restart with {BY_NAME[key].flag}. "
                                    f"Live settings: {', '.join(LIVE_KEYS)}.", code="invalid_request", param=key)
            raise APIError(400, f"{shown(key)} is not a setting that can be changed; the live settings are "
                                f"{', '.join(LIVE_KEYS)}.", code="invalid_request", param=key)
        problem = _json_problem(key, raw)
        if problem:
            raise APIError(400, f"Invalid {key}: {problem}.", code="invalid_request", param=key)
        try:  # one key at a time, so the error names the field that is wrong
            checked = settings_from_mapping({key: raw}, SOURCE)
        except ConfigError as e:
            raise APIError(400, f"Invalid {key}: {_problem_text(e)}.", code="invalid_request", param=key) from None
        except (ArithmeticError, TypeError, ValueError):  # e.g. a 400-digit integer for a float setting
            raise APIError(400, f"Invalid {key}: {shown(raw)} is not an acceptable value.", code="invalid_request",
                           param=key) from None
        values[key] = getattr(checked, key)
    sources = {**state.settings.sources, **{key: SOURCE for key in values}}
    return dataclasses.replace(state.settings, **values, sources=sources)


def _read_settings_body(raw: bytes):
    check_size(raw)
    return loads(raw)


def router(state: ServerState) -> APIRouter:
    r = APIRouter()

    @r.get("/metrics", include_in_schema=False)
    async def metrics():
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @r.get(SETTINGS_PATH)
    async def get_settings():
        return settings_view(state)

    @r.put(SETTINGS_PATH, openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": _PUT_SCHEMA}}}})
    async def put_settings(request: Request):
        raw = await request.body() or b"null"
        try:  # the bounds and number rules of the API routes' bodies, off the event loop as theirs are
            changes = await asyncio.to_thread(_read_settings_body, raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise APIError(400, f"The request body is not valid JSON: {e}.", code="invalid_request") from None
        state.apply_settings(updated_settings(state, changes))
        return JSONResponse(settings_view(state))

    return r
