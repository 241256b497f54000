"""A guard against a reference-count bug of PySide6 6.12 on Python < 3.12.

With PySide6 6.12 on CPython 3.11, every call of a C++ method that returns void (``setText``, ``setValue``,
``setChecked``, ...) gives back ``None`` without taking a reference to it, so each call drops None's reference count
by one. Python 3.12+ made None immortal (PEP 683), which hides the bug there; on 3.11 a long-running window reaches
zero after a few hundred thousand such calls and the process dies with "Fatal Python error: none_dealloc:
deallocating None" (seen here after a few minutes of chat and monitor updates).

``guard_none_refcount()`` detects the bug (a void call that lowers None's count) and, only then, gives None a
reference count so large it can never reach zero, which is what 3.12 does for every build. It is a no-op on 3.12+,
on other interpreters, and with a PySide6 that does not have the bug.
"""
from __future__ import annotations

import ctypes
import sys

_BIG = 1 << 40
_guarded = False


def none_refcount_leaks() -> bool:
    """Whether a void PySide6 call loses a reference to None in this process."""
    from PySide6.QtCore import QObject

    obj = QObject()
    before = sys.getrefcount(None)
    for _ in range(64):
        obj.setObjectName("probe")
    return sys.getrefcount(None) < before - 32


def guard_none_refcount() -> bool:
    """Makes None effectively immortal when the bug is present; True when it did (once per process)."""
    global _guarded
    if _guarded or sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return False
    if not none_refcount_leaks():
        return False
    field = ctypes.c_ssize_t.from_address(id(None))  # PyObject.ob_refcnt, the first field in release builds
    seen = sys.getrefcount(None)
    if field.value not in (seen, seen - 1, seen + 1):  # an unexpected object layout (e.g. a debug build)
        return False
    field.value += _BIG
    _guarded = True
    return True
