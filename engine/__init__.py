"""NInfer inference engine: settings, model, paged KV cache, scheduler, engine thread and the OpenAI-compatible server.

The engine never imports Qt; the desktop app (``app/``) talks to it through this package's Python API and over HTTP.
"""
