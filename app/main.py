"""``ninfer``: the desktop app.

    ninfer                                   reopens the last model that worked (the launcher shows the loading)
    ninfer --model PATH --preset NAME --start   starts serving without a click (the launcher shows the progress)
    ninfer --port 9000 --max-context 4096    any ninfer-serve setting flag fills the launcher's form
    ninfer --remote http://host:8080/v1      chats with another OpenAI-compatible server

With no display (Linux without DISPLAY or WAYLAND_DISPLAY, and QT_QPA_PLATFORM not offscreen) it says so and runs
``ninfer-serve`` with the same model, preset and settings instead, so one command works on a desktop and over SSH.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Mapping

from engine.config.loading import ConfigError, build_parser

HEADLESS_PLATFORMS = ("offscreen", "minimal", "vnc", "eglfs", "linuxfb")


def has_display(env: Mapping[str, str] | None = None, platform: str | None = None) -> bool:
    env = os.environ if env is None else env
    platform = sys.platform if platform is None else platform
    qpa = env.get("QT_QPA_PLATFORM", "").split(":")[0].strip().lower()
    if qpa in HEADLESS_PLATFORMS:
        return True
    if platform.startswith(("linux", "freebsd", "openbsd", "netbsd")):
        return bool(env.get("DISPLAY") or env.get("WAYLAND_DISPLAY"))
    return True  # Windows and macOS always have a display session for a desktop app


def app_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ninfer", usage="ninfer [model] [--model PATH] [--preset NAME] [--port N] [--start] [ninfer-serve flags]",
        description="NInfer desktop app. The model, --model, --preset, --port and every other ninfer-serve setting "
                    "flag (e.g. --max-context 4096) fill the launcher's form; see ninfer-serve --help. Without a "
                    "display, ninfer runs ninfer-serve with the same arguments.")
    p.add_argument("--start", action="store_true", help="start serving at once, without a click")
    p.add_argument("--remote", metavar="URL", help="chat with another OpenAI-compatible server at URL")
    p.add_argument("--remote-key", metavar="KEY", help="API key for --remote")
    return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, dict[str, Any], list[str]]:
    """(app options with .model and .preset, setting values from the ninfer-serve flags, the argv ninfer-serve would
    get). Raises ConfigError for an unknown option, like ninfer-serve."""
    args, rest = app_parser().parse_known_args(argv)
    ns, unknown = build_parser("ninfer").parse_known_args(rest)
    if unknown:
        raise ConfigError([f"[command line] unknown option or argument {' '.join(unknown)}; run ninfer --help"])
    model = getattr(ns, "model", None)
    if model and ns.model_path and model != ns.model_path:
        raise ConfigError([f"[command line] the model is given twice ({model} and {ns.model_path}); give it once"])
    args.model = model or ns.model_path
    args.preset = ns.preset
    values = {k: v for k, v in vars(ns).items() if k not in ("model", "model_path", "preset", "config", "print_config")}
    if "port" in values:
        values["port"] = int(values["port"]) if str(values["port"]).isdigit() else values["port"]
    return args, values, list(rest)


def run_headless(serve_argv: list[str]) -> int:
    print("ninfer: no display found (DISPLAY and WAYLAND_DISPLAY are not set), so the desktop app cannot open; "
          "running ninfer-serve instead" + (f" with: {' '.join(serve_argv)}" if serve_argv else "") + ".",
          file=sys.stderr)
    from engine.serve import main as serve_main
    return serve_main(serve_argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, values, serve_argv = parse(argv)
    except ConfigError as e:
        print(f"ninfer: {e}", file=sys.stderr)
        return 2
    if getattr(args, "print_config", False) or "--print-config" in serve_argv:
        from engine.serve import main as serve_main
        return serve_main(serve_argv)  # prints the effective settings, needs no window
    if not has_display():
        if args.remote:
            print("ninfer: --remote needs a display (it opens the chat window).", file=sys.stderr)
            return 2
        return run_headless(serve_argv)
    return run_app(args, values)


def run_app(args: argparse.Namespace, values: dict[str, Any]) -> int:
    import asyncio
    import signal

    import qasync
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from app import theme
    from app.asyncutil import spawn
    from app.controller import Controller

    from app.qtcompat import guard_refcount_leaks

    guard_refcount_leaks()  # before the first window: see app/qtcompat.py
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("NInfer")
    app.setOrganizationName("NInfer")
    app.setDesktopFileName("ninfer")
    app.setQuitOnLastWindowClosed(False)
    app.setWindowIcon(theme.app_icon())
    theme.apply(app)
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)

    controller = open_windows(args, values, Controller())
    theme.follow_system(app, on_change=controller.restyle)

    signal.signal(signal.SIGINT, lambda *_: spawn(controller.quit(), "quit"))
    keepalive = QTimer(interval=300)  # lets Python run its signal handlers while Qt waits
    keepalive.timeout.connect(lambda: None)
    keepalive.start()
    with loop:
        loop.run_forever()
    return 0


def reopen_last_good(config: Any) -> bool:
    """Start the last configuration that worked without a click: there is one, the last session ended cleanly, the
    last start did not fail, and the user has not turned it off."""
    return bool(config.last_good) and not config.crashed and not config.last_failure \
        and config.get("reopen_last_model", True) is not False


def open_windows(args: argparse.Namespace, values: dict[str, Any], controller: Any) -> Any:
    """Shows the launcher with the command line's model, preset and settings; with --start it starts serving as soon
    as the checks pass, with --remote it connects the chat to that server. Returns the controller."""
    from app.asyncutil import spawn

    launcher = controller.launcher
    config = controller.config
    if args.model or args.preset or values:
        launcher.apply_config({"model": args.model, "preset": args.preset, "values": values})
        launcher.auto_start = args.start and not args.remote
    elif reopen_last_good(config) and not args.remote:
        # straight back into the chat with the model that worked last time; the launcher shows the loading and
        # stays one click away (Cancel, or File > Change model or settings…)
        launcher.apply_config(config.last_good)
        launcher.notice = "Reopening the last model that worked"
        launcher.auto_start = True
    else:
        launcher.auto_start = args.start and not args.remote
    launcher.show()
    if args.remote:
        async def connect():
            error = await controller.connect_remote(args.remote, args.remote_key)
            if error:
                launcher.status.setText(f"Could not connect to {args.remote}: {error}")
        spawn(connect(), "connect-remote")
    return controller


if __name__ == "__main__":
    sys.exit(main())
