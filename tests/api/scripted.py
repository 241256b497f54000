"""A scripted engine for API tests: the real server and tokenizer, with a model that says exactly what the test
wants (e.g. a tool call), so parsing and streaming are tested deterministically."""
from types import SimpleNamespace

from engine.config.loading import load_settings
from engine.sequence import RequestOutput
from engine.server.state import ServerState
from engine.stream import RequestStream
from tests.api.conftest import RunningServer


class ScriptedEngine:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.script = ""
        self.fail_after: int | None = None  # emit this many tokens, then an engine error
        self.cut_after: int | None = None  # emit this many tokens, then end as the engine ends what a switch stops
        self.prompts: list[list[int]] = []
        self.params = []
        self.refuse: tuple[int, Exception] | None = None  # (n, error): accept n submissions, then raise error
        self.hold = False  # submitted sequences say nothing until aborted
        self.aborted: list[str] = []

    def submit(self, prompt, params, request_id=None, loop=None):
        if self.refuse is not None and len(self.prompts) >= self.refuse[0]:
            raise self.refuse[1]
        self.prompts.append(list(prompt))
        self.params.append(params)
        stream = RequestStream(request_id or f"r{len(self.prompts)}", self.abort, loop)
        if self.hold:
            return stream
        ids = self.tokenizer.encode(self.script)[:params.max_tokens]
        if self.fail_after is not None:
            for i, t in enumerate(ids[:self.fail_after]):
                stream.push(RequestOutput(stream.request_id, [t], False, None, len(prompt), i + 1))
            stream.push(RequestOutput(stream.request_id, [], True, "error", len(prompt), self.fail_after,
                                      error="The engine failed during a step: RuntimeError: boom"))
            return stream
        if self.cut_after is not None:
            for i, t in enumerate(ids[:self.cut_after]):
                stream.push(RequestOutput(stream.request_id, [t], False, None, len(prompt), i + 1))
            stream.push(RequestOutput(stream.request_id, [], True, "abort", len(prompt), self.cut_after))
            return stream
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            reason = ("length" if len(ids) == params.max_tokens else "stop") if last else None
            stream.push(RequestOutput(stream.request_id, [t], last, reason, len(prompt), i + 1))
        return stream

    def abort(self, request_id):
        self.aborted.append(request_id)

    def stats(self):
        return {"running": 0, "waiting": 0}


def scripted_server(default_engine):
    """A RunningServer whose engine replays `server.engine.script`; uses the default model's tokenizer."""
    settings, _ = load_settings([], {})
    engine = ScriptedEngine(default_engine.tokenizer)
    state = ServerState(settings, ["scripted"])
    state.loaded = SimpleNamespace(engine=engine, tokenizer=default_engine.tokenizer, context_window=2048)
    running = RunningServer(state)
    running.engine = engine
    return running
