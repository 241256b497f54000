"""The launcher's live checks (Qt-free): hardware verdicts, the model, the memory estimate, settings problems,
environment overrides and the port. Each check has a level and, when something is wrong, a remedy; Start is
allowed only while no check is an error.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any, Mapping

from app.launcher.estimate import MemoryEstimate, ModelInfo, estimate, model_info
from app.launcher.settings import Effective, Preset, effective, shown
from app.launcher.wording import label as field_label, model_name

LEVELS = ("ok", "info", "warning", "error")


@dataclass(frozen=True)
class Check:
    level: str  # ok | info | warning | error
    area: str  # hardware | model | memory | settings | environment | port
    message: str
    remedy: str = ""


@dataclass
class Validation:
    checks: list[Check] = field(default_factory=list)
    effective: Effective | None = None
    info: ModelInfo | None = None
    memory: MemoryEstimate | None = None

    @property
    def errors(self) -> list[Check]:
        return [c for c in self.checks if c.level == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def settings(self):
        return self.effective.settings if self.effective is not None and self.ok else None


def _unique_sources(problem: str) -> str:
    """"[preset:x, preset:x] ..." -> "[preset:x] ..." (a problem of two settings from the same source)."""
    if problem.startswith("[") and "]" in problem:
        sources, rest = problem[1:].split("]", 1)
        unique = list(dict.fromkeys(part.strip() for part in sources.split(",")))
        return f"[{', '.join(unique)}]{rest}"
    return problem


def split_problem(problem: str) -> tuple[str, str]:
    """A ConfigError problem line -> (what is wrong, what to do): the remedy follows the last '; '."""
    head, sep, tail = _unique_sources(problem).rpartition("; ")
    return (head, tail[:1].upper() + tail[1:] + ".") if sep else (problem, "")


def model_check(model: str | None) -> tuple[ModelInfo | None, Check | None]:
    """Reads the model (slow the first time: run it off the GUI thread): (info, None) or (None, an error check)."""
    from engine.errors import NInferError
    try:
        return model_info(model), None
    except NInferError as e:
        return None, Check("error", "model", e.problem, e.remedy)
    except (OSError, ValueError) as e:
        return None, Check("error", "model", f"Cannot read the model: {e}.", "Pick another file or folder.")


def hardware_checks(report: Any, device: str) -> list[Check]:
    if report is None:
        return [Check("info", "hardware", "Checking the GPU and memory...")]
    checks = [Check(v.level, "hardware", v.message, v.remedy) for v in report.verdicts]
    if device == "cuda" and report.device == "cpu":
        from engine.errors import NInferError
        from engine.hardware import resolve_device
        try:
            resolve_device("cuda", report)
        except NInferError as e:
            checks.append(Check("error", "hardware", e.problem, e.remedy))
    elif device == "cpu" and report.device != "cpu":
        checks.append(Check("info", "hardware", f"device is cpu: the GPU ({report.device}) will not be used.",
                            "Set device to auto to use it."))
    # no NVIDIA GPU is not a problem when the user asked for the CPU
    if device == "cpu":
        checks = [c if not (c.level == "warning" and "No usable NVIDIA GPU" in c.message) else
                  Check("ok", "hardware", "Running on the CPU, as asked.") for c in checks]
    return checks


def port_check(host: str, port: int) -> Check | None:
    """An error when (host, port) cannot be bound right now (another server holds it)."""
    h = host.strip().strip("[]")
    family = socket.AF_INET6 if ":" in h else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((h, port))
        except OSError as e:
            return Check("error", "port", f"Port {port} on {host} is not free ({e.strerror or e}).",
                         "Another program (perhaps another ninfer-serve) uses it: choose another port, or stop it.")
    return None


def validate(form: Mapping[str, Any], model: str | None, preset: Preset | None, report: Any = None,
             env: Mapping[str, str] | None = None, *, info: ModelInfo | None = None, read_model: bool = True,
             model_error: Check | None = None, check_port: bool = True) -> Validation:
    """All the checks for one state of the launcher. ``report`` is ``engine.hardware.probe()``'s result, or None while
    it runs. ``info`` may be passed when already read; with ``read_model=False`` the model is not opened here (it is
    slow the first time) and ``model_error`` says why it could not be read, if it could not."""
    env = os.environ if env is None else env
    v = Validation()
    eff = v.effective = effective(form, model, preset, env)
    device = eff.settings.device if eff.settings else form.get("device", "auto")
    v.checks += hardware_checks(report, device)

    if model_error is not None:
        v.checks.append(model_error)
    elif info is None and not read_model:
        v.checks.append(Check("info", "model", "Reading the model..."))
    elif info is None:
        info, problem = model_check(model)
        if problem:
            v.checks.append(problem)
    if info is not None:
        v.info = info
        cfg = info.config
        v.checks.append(Check("ok", "model", f"{model_name(model)}: {cfg.arch}, {cfg.num_layers} layers, "
                                             f"{info.params / 1e6:,.0f}M parameters, context {cfg.max_position:,}."))

    for problem in eff.problems:
        message, remedy = split_problem(problem)
        v.checks.append(Check("error", "settings", message, remedy))
    for warning in eff.warnings:
        message, remedy = split_problem(warning)
        v.checks.append(Check("warning", "environment", message, remedy))
    for o in eff.overrides:
        form_value = form.get(o.setting.name)
        value = "(hidden)" if o.setting.secret else o.raw
        v.checks.append(Check(
            "warning", "environment",
            f"{o.variable}={value} is set in the environment and overrides “{field_label(o.setting.name)}”"
            + (f" (the form says {shown(form_value)})" if not o.setting.secret else "") + ".",
            f"Unset {o.variable} before starting NInfer (check your shell profile and system environment) "
            f"to use the form's value."))

    settings = eff.settings
    if settings is not None and info is not None and report is not None:
        try:
            mem = v.memory = estimate(info, settings, report)
        except ValueError as e:
            v.checks.append(Check("error", "memory", f"The memory ledger cannot plan this configuration: {e}",
                                  "Change the setting it names, or pick another model."))
            mem = None
        if mem is not None:
            for level, message, remedy in mem.problems:
                v.checks.append(Check(level, "memory", message, remedy))
            for note in mem.notes:
                v.checks.append(Check("info", "memory", note))
            if mem.fits:
                v.checks.append(Check("ok", "memory", f"Fits: {mem.fit_text()}."))
    if settings is not None and check_port:
        problem = port_check(settings.host, settings.port)
        if problem:
            v.checks.append(problem)
    return v
