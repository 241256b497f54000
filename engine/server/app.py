"""The FastAPI application: routes of the OpenAI-compatible API and the server's own health check."""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engine.metrics import RequestCounter
from engine.server import admin, errors, security
from engine.server.chat import chat_completions
from engine.server.completions import completions
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

    @app.get("/health")
    async def health():
        if state.loaded is not None:
            return {"status": "ok"}
        status = "error" if state.load_error else "loading"
        return JSONResponse({"status": status, "progress": round(state.load_progress, 3),
                             "error": state.load_error}, status_code=503)

    @app.get("/v1/models")
    async def list_models():
        ctx = state.loaded.context_window if state.loaded is not None else None
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": state.created, "owned_by": "ninfer",
             "context_window": ctx, "max_model_len": ctx} for m in state.model_ids]}

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, request: Request):
        return await chat_completions(req, state, request)

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, request: Request):
        return await completions(req, state, request)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, request: Request):
        return await responses(req, state, request)

    return app
