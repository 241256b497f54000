"""The FastAPI application: routes of the OpenAI-compatible API and the server's own health check."""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engine.metrics import RequestCounter
from engine.server import admin, errors, security, tokens
from engine.server.bodies import ThreadedBodyRoute
from engine.server.chat import chat_completions
from engine.server.completions import completions
from engine.server.images import vision_of
from engine.server.mcp_chat import chat_with_mcp
from engine.server.mcp_messages import messages_with_mcp
from engine.server.mcp_responses import responses_with_mcp
from engine.server.mcp_tools import mcp_entries
from engine.server.messages import MessagesRequest, count_tokens, messages, uses_mcp
from engine.server.responses import ResponsesRequest, responses
from engine.server.schemas import ChatCompletionRequest, CompletionRequest
from engine.server.state import ServerState


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="NInfer", summary="OpenAI-compatible local inference", version="0.1.0")
    errors.install(app)
    security.install(app, state)
    app.add_middleware(RequestCounter, metrics=state.metrics)  # outermost: security refusals are counted too
    app.include_router(admin.router(state))
    app.state.ninfer = state
    state.created = int(time.time())

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if state.loaded is not None:
            return {"status": "ok"}
        if state.load_error:
            return JSONResponse({"status": "error", "progress": round(state.load_progress, 3),
                                 "error": state.load_error}, status_code=503)
        body = {"status": "switching" if state.switching_to else "loading", "progress": round(state.load_progress, 3),
                "error": None}
        if state.switching_to:
            body["model"] = state.switching_to
        return JSONResponse(body, status_code=503, headers={"Retry-After": "2"})

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(state, m) for m in state.model_ids]}

    async def create_chat_completion(req: ChatCompletionRequest, request: Request):
        if mcp_entries(req.tools):
            return await chat_with_mcp(req, state, request)
        return await chat_completions(req, state, request)

    async def create_completion(req: CompletionRequest, request: Request):
        return await completions(req, state, request)

    async def create_response(req: ResponsesRequest, request: Request):
        if mcp_entries(req.tools) and state.settings.mcp_config:  # without --mcp-config: left out as hosted tools
            return await responses_with_mcp(req, state, request)
        return await responses(req, state, request)

    async def create_message(req: MessagesRequest, request: Request):
        if uses_mcp(req):
            return await messages_with_mcp(req, state, request)
        return await messages(req, state, request)

    async def count_message_tokens(req: MessagesRequest):
        return await count_tokens(req, state)

    # Each route once under /v1, and (for clients configured with a bare base URL) without it, out of the schema;
    # their bodies are read in a worker thread (engine.server.bodies).
    for path, handler in (("/chat/completions", create_chat_completion), ("/responses", create_response),
                          ("/messages", create_message), ("/messages/count_tokens", count_message_tokens)):
        app.router.add_api_route("/v1" + path, handler, methods=["POST"], route_class_override=ThreadedBodyRoute)
        app.router.add_api_route(path, handler, methods=["POST"], include_in_schema=False,
                                 route_class_override=ThreadedBodyRoute)
    app.router.add_api_route("/v1/completions", create_completion, methods=["POST"],
                             route_class_override=ThreadedBodyRoute)
    for path, handler, bare in tokens.routes(state):  # counting, tokenizing, rendering: nothing generated
        app.router.add_api_route(path, handler, methods=["POST"], route_class_override=ThreadedBodyRoute)
        if bare:
            app.router.add_api_route(path.removeprefix("/v1"), handler, methods=["POST"], include_in_schema=False,
                                     route_class_override=ThreadedBodyRoute)
    app.add_api_route("/models", list_models, methods=["GET"], include_in_schema=False)
    return app


def model_card(state: ServerState, model_id: str) -> dict:
    """One /v1/models entry: what the served model can do (context and output length are null while loading)."""
    loaded = state.loaded
    ctx = loaded.context_window if loaded is not None else None
    template = (getattr(loaded.tokenizer, "chat_template", None) or "") if loaded is not None else ""
    vision = vision_of(state) is not None
    modalities = ["text", "image"] if vision else ["text"]  # llama-server's router reports them in `architecture`
    return {"id": model_id, "object": "model", "created": state.created, "owned_by": "ninfer",
            "context_window": ctx, "max_model_len": ctx, "max_output_tokens": ctx,
            "weight_storage": getattr(loaded, "weight_storage", None) or None,  # "132 x Q5_0 -> int8, ..."
            "input_modalities": modalities, "architecture": {"input_modalities": list(modalities)},
            "capabilities": {"chat": bool(template), "tools": "tools" in template, "reasoning": "<think>" in template,
                             "vision": vision, "structured_output": True}}
