"""Runs an untrusted Python program (a model's answer and its tests) and says how it ended, never raising for what
the program did.

The program runs in a fresh temporary folder, in its own session (every process it starts is killed with it), with
a scrubbed environment (PATH, HOME and TMPDIR only), Python's isolated mode, and these limits, set by a small
launcher before it executes the program: CPU seconds, address space (memory), the size of any file it writes, no
core files, and a number of processes. Where the operating system allows, it also gets a network namespace of its
own (loopback only), and a process started as root drops to the unprivileged user "nobody" (running the first
Python that user may execute: this one, /usr/bin/python3 or /usr/local/bin/python3), so that the process limit
applies; where nobody can run a Python, the program runs as root without the process limit. A wall-clock timeout kills the whole session."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mib: int = 1024
    file_mib: int = 16
    processes: int = 16


@dataclass(frozen=True)
class Outcome:
    passed: bool
    status: str  # passed, failed, timeout, cpu limit, memory limit, file size limit, process limit,
    #              killed by signal N
    detail: str  # the last lines of what the program wrote to stderr


# Runs as the sandbox's first process: limits, network namespace, user; then replaces itself with the program.
LAUNCHER = r"""
import ctypes, json, os, resource, sys
lim = json.loads(sys.argv[1])
try:
    if ctypes.CDLL(None, use_errno=True).unshare(0x40000000 | (0 if os.getuid() == 0 else 0x10000000)) == 0:
        os.environ["SANDBOX_NETWORK"] = "none"
except (OSError, AttributeError):
    pass
exe = sys.executable
if os.getuid() == 0:  # drop to "nobody" when it can run a Python (the process limit does not bind root)
    os.setegid(lim["gid"]); os.seteuid(lim["uid"])
    usable = [p for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3")
              if os.access(p, os.X_OK, effective_ids=True)]
    os.seteuid(0); os.setegid(0)
    if usable:
        exe = usable[0]
        os.setgroups([]); os.setgid(lim["gid"]); os.setuid(lim["uid"])
def running(uid):
    n = 0
    for p in os.listdir("/proc"):
        try:
            n += p.isdigit() and open(f"/proc/{p}/status").read().split("\nUid:\t")[1].split()[0] == str(uid)
        except (OSError, IndexError):
            pass
    return n
for name, value in (("RLIMIT_CPU", lim["cpu"]), ("RLIMIT_AS", lim["mem"]), ("RLIMIT_FSIZE", lim["file"]),
                    ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", running(os.getuid()) + lim["procs"])):
    hard = value + 1 if name == "RLIMIT_CPU" else value
    resource.setrlimit(getattr(resource, name), (value, hard))
os.execv(exe, [exe, "-I", sys.argv[2]])
"""


def _nobody() -> tuple[int, int]:
    try:
        import pwd

        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except (ImportError, KeyError):
        return 65534, 65534


def run_program(source: str, limits: Limits = Limits()) -> Outcome:
    """Runs ``source`` as a script under ``limits``; it passes when it exits with status 0."""
    uid, gid = _nobody()
    with tempfile.TemporaryDirectory(prefix="ninfer-eval-") as tmp:
        folder = Path(tmp)
        (folder / "program.py").write_text(source, encoding="utf-8")
        if os.getuid() == 0:
            os.chown(folder, uid, gid)
            os.chown(folder / "program.py", uid, gid)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
        lim = {"cpu": limits.cpu_s, "mem": limits.memory_mib << 20, "file": limits.file_mib << 20,
               "procs": limits.processes, "uid": uid, "gid": gid}
        with open(folder / "stderr.txt", "w+b") as err:
            proc = subprocess.Popen([sys.executable, "-I", "-c", LAUNCHER, json.dumps(lim), "program.py"],
                                    cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=err, start_new_session=True)
            timed_out = False
            try:
                proc.wait(limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_session(proc.pid)
            proc.wait()
            err.seek(0)
            detail = err.read()[-4000:].decode("utf-8", "replace").strip()
    return _outcome(proc.returncode, timed_out, detail)


def _kill_session(pid: int) -> None:
    """Kills the program and everything it started (they share its process group)."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.01)


def _outcome(code: int, timed_out: bool, detail: str) -> Outcome:
    last = "\n".join(detail.splitlines()[-3:])
    if timed_out:
        return Outcome(False, "timeout", last)
    if code == 0:
        return Outcome(True, "passed", last)
    if code in (-signal.SIGXCPU, -signal.SIGKILL) and not detail:
        return Outcome(False, "cpu limit", last)
    if "MemoryError" in detail:
        return Outcome(False, "memory limit", last)
    if "File too large" in detail or code == -signal.SIGXFSZ:
        return Outcome(False, "file size limit", last)
    if "BlockingIOError" in detail and "fork" in detail:
        return Outcome(False, "process limit", last)
    if code < 0:
        return Outcome(False, f"killed by signal {-code}", last)
    return Outcome(False, "failed", last)
