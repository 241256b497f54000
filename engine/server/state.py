"""What the server holds: the loaded engine (None while loading), the settings and the served model ids."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from engine.config.loading import Settings, sampling_defaults
from engine.metrics import Metrics
from engine.server.errors import APIError, shown


@dataclass
class ServerState:
    settings: Settings
    model_ids: list[str]
    loaded: "object | None" = None  # engine.build.LoadedEngine
    load_error: str | None = None
    load_progress: float = 0.0
    switching_to: str = ""  # the model being loaded in place of the one served before ("" when not switching)
    created: int = 0
    defaults: dict = field(default_factory=dict)
    metrics: Metrics = field(default_factory=Metrics)
    mcp: "object | None" = None  # engine.server.mcp_tools.ServerTools, for --mcp-config

    def __post_init__(self):
        self.defaults = sampling_defaults(self.settings)
        if getattr(self.loaded, "engine", None) is not None:
            self.metrics.attach(self.loaded.engine)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "loaded" and getattr(value, "engine", None) is not None and "metrics" in self.__dict__:
            self.metrics.attach(value.engine)  # measure the engine as soon as it is in place

    def apply_settings(self, settings: Settings) -> None:
        """Switches to new settings live (mode, sampling defaults): requests from now on use them."""
        self.settings, self.defaults = settings, sampling_defaults(settings)

    def ready(self):
        if self.loaded is None:
            if self.load_error:
                raise APIError(503, f"The model failed to load: {self.load_error}", code="model_load_failed")
            if self.switching_to:
                raise APIError(503, f"The server is switching to the model {shown(self.switching_to)} "
                                    f"({self.load_progress:.0%} loaded); retry in a moment.",
                               code="model_switching", headers={"Retry-After": "2"})
            raise APIError(503, f"The model is still loading ({self.load_progress:.0%}); retry in a moment.",
                           code="model_loading", headers={"Retry-After": "2"})
        return self.loaded

    def check_model(self, requested: str) -> str:
        """The served id a request's model name stands for: a served id itself, or the target of the first
        --model-alias pattern it matches; 404 for any other name (never silently served)."""
        if requested in self.model_ids:
            return requested
        for alias in getattr(self.settings, "model_alias", None) or ():
            pattern, _, target = alias.partition("=")
            if fnmatch.fnmatchcase(requested, pattern.strip()):
                target = target.strip() or self.model_ids[0]
                if target not in self.model_ids:
                    raise APIError(404, f"The model alias {shown(alias)} maps {shown(requested)} to {shown(target)}, "
                                        f"which this server does not serve; it serves {_listed(self.model_ids)}. Fix the "
                                        f"--model-alias setting.", code="model_not_found", param="model")
                return target
        hint = (" Map other names to it with --model-alias PATTERN=ID (e.g. --model-alias 'claude-*="
                f"{self.model_ids[0]}')." if self.model_ids else "")
        raise APIError(404, f"The model {shown(requested)} does not exist on this server; it serves "
                            f"{_listed(self.model_ids)}.{hint}", code="model_not_found", param="model")


def _listed(ids: list[str]) -> str:
    return ", ".join(repr(m) for m in ids)
