"""Guards against two reference-count bugs of PySide6 6.12 on Python < 3.12.

With PySide6 6.12 on CPython 3.11:
- every call of a C++ method that returns void (``setText``, ``setValue``, ``setChecked``, ...) gives back ``None``
  without taking a reference to it, so each call drops None's reference count by one;
- every ``SignalInstance.emit(...)`` made from Python gives back ``True`` without taking a reference to it, so each
  emit drops True's reference count by one (whatever the signal's arguments; False is not affected).
Python 3.12+ made None and the booleans immortal (PEP 683), which hides both bugs there; on 3.11 a long-running
window reaches zero after a few hundred thousand such calls and the process dies with "Fatal Python error:
none_dealloc: deallocating None" or "bool_dealloc: deallocating True or False". PySide6 6.11.3 has neither bug.

``guard_refcount_leaks()`` detects each bug (a probe call that lowers the object's count) and, only then, gives that
object a reference count so large it can never reach zero, which is what 3.12 does for every build. It is a no-op on
3.12+, on other interpreters, and with a PySide6 that does not have the bugs.
"""
from __future__ import annotations

import ctypes
import sys

_BIG = 1 << 40
_PROBE_CALLS = 64
_guarded: set[int] = set()  # id() of the objects already given a large count


def none_refcount_leaks() -> bool:
    """Whether a void PySide6 call loses a reference to None in this process."""
    from PySide6.QtCore import QObject

    obj = QObject()
    before = sys.getrefcount(None)
    for _ in range(_PROBE_CALLS):
        obj.setObjectName("probe")
    return sys.getrefcount(None) < before - _PROBE_CALLS // 2


def true_refcount_leaks() -> bool:
    """Whether emitting a PySide6 signal from Python loses a reference to True in this process."""
    from PySide6.QtCore import QObject, Signal

    class Probe(QObject):
        fired = Signal()

    probe = Probe()
    before = sys.getrefcount(True)
    for _ in range(_PROBE_CALLS):
        probe.fired.emit()
    return sys.getrefcount(True) < before - _PROBE_CALLS // 2


def _keep_alive(obj: object) -> bool:
    """Raises obj's reference count so far that leaked references can never bring it to zero (once per object)."""
    if id(obj) in _guarded or sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return False
    field = ctypes.c_ssize_t.from_address(id(obj))  # PyObject.ob_refcnt, the first field in release builds
    seen = sys.getrefcount(obj)
    if field.value not in (seen, seen - 1, seen + 1):  # an unexpected object layout (e.g. a debug build)
        return False
    field.value += _BIG
    _guarded.add(id(obj))
    return True


def guard_none_refcount() -> bool:
    """Makes None effectively immortal when the void-call bug is present; True when it did (once per process)."""
    if id(None) in _guarded or sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return False
    return none_refcount_leaks() and _keep_alive(None)


def guard_true_refcount() -> bool:
    """Makes True effectively immortal when the emit bug is present; True when it did (once per process)."""
    if id(True) in _guarded or sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return False
    return true_refcount_leaks() and _keep_alive(True)


def guard_refcount_leaks() -> None:
    """Both guards: call before the first window or signal of the app."""
    guard_none_refcount()
    guard_true_refcount()
