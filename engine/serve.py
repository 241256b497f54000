"""`ninfer-serve`: load a model and serve the OpenAI-compatible API (health answers 503 while the model loads)."""
from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

from engine.config.loading import ConfigError, Settings, format_settings, is_loopback, load_settings
from engine.config.engine_config import EngineConfig
from engine.errors import NInferError

log = logging.getLogger("ninfer.serve")


def served_model_ids(settings: Settings, path: Path) -> list[str]:
    if settings.model_id:
        return list(settings.model_id)
    from engine.model.default import DEFAULT_MODEL_ID, default_model_path
    if not settings.model or path == default_model_path():
        return [DEFAULT_MODEL_ID]
    return [path.stem if path.is_file() else path.name]


def load_in_background(state, settings: Settings, on_failure=None) -> threading.Thread:
    """Loads the engine on a thread and puts it into the server state; records the error if loading fails."""
    def work():
        from engine.build import build_engine
        try:
            loaded = build_engine(settings.model, EngineConfig.from_settings(settings),
                                  progress=lambda f, _msg: setattr(state, "load_progress", f))
            loaded.engine.start()
            state.loaded = loaded
            from engine.library import usage
            usage.record(loaded.path)  # the library's "last used", as in the app
            log.info("ready: %s on %s, context %d tokens, %d KV pages, loaded in %.1f s",
                     loaded.path.name, loaded.device, loaded.context_window, loaded.engine.pool.num_pages,
                     loaded.load_seconds)
        except NInferError as e:
            state.load_error = str(e)
            log.error("%s", e)
            if on_failure:
                on_failure()
        except Exception as e:  # an unexpected failure: keep the traceback in the log
            state.load_error = f"{type(e).__name__}: {e}"
            log.exception("loading the model failed")
            if on_failure:
                on_failure()

    thread = threading.Thread(target=work, name="ninfer-load", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    try:
        settings, warnings = load_settings(argv)
    except ConfigError as e:
        print(f"ninfer-serve: {e}\n{e.remedy}", file=sys.stderr)
        return 2
    for w in warnings:
        print(f"ninfer-serve: warning: {w}", file=sys.stderr)
    if settings.print_config:
        from engine.ledger import ModelShape
        print(format_settings(settings, model_shape=lambda: ModelShape.from_path(settings.model)))
        return 0
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.insecure_no_auth and settings.api_key is None and not is_loopback(settings.host):
        print(f"ninfer-serve: WARNING: --insecure-no-auth: the API on {settings.host}:{settings.port} is open to "
              f"anyone who can reach this machine over the network, with no key. Use it only on a trusted network; "
              f"set --api-key (or NINFER_API_KEY) otherwise.", file=sys.stderr)
    try:
        from engine.model.loader import resolve_model_path
        path = resolve_model_path(settings.model)
    except NInferError as e:
        print(f"ninfer-serve: {e}", file=sys.stderr)
        return 2

    import uvicorn

    from engine.server.app import create_app
    from engine.server.protocol import APIErrorsProtocol
    from engine.server.state import ServerState

    state = ServerState(settings, served_model_ids(settings, path))
    try:
        from engine.server.mcp_tools import server_tools
        if server_tools(state) is not None:
            log.info("MCP tools for chat requests: %s", ", ".join(state.mcp.servers) or "none")
    except NInferError as e:  # a missing or malformed --mcp-config: before anything loads
        print(f"ninfer-serve: {e}", file=sys.stderr)
        return 2
    server = uvicorn.Server(uvicorn.Config(create_app(state), host=settings.host, port=settings.port,
                                           log_level=settings.log_level, timeout_graceful_shutdown=5,
                                           http=APIErrorsProtocol))
    log.info("serving %s as %s on http://%s:%d/v1", path, ", ".join(state.model_ids), settings.host, settings.port)
    load_in_background(state, settings, on_failure=lambda: setattr(server, "should_exit", True))
    server.run()
    if state.loaded is not None:
        state.loaded.engine.shutdown()
    if state.mcp is not None:
        state.mcp.close()  # its stdio servers end with it
    return 1 if state.load_error else 0


if __name__ == "__main__":
    sys.exit(main())
