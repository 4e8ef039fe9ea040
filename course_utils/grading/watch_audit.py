"""The watch's audit hook: Python's own audit events, refused during a watched call.

A function's ``__code__`` replaced (the answer functions are swapped that way, so a student's
code must not swap them back), and in a ``torch_only`` call ctypes, forks, spawns and new
processes. Its own room: an audit hook is process-wide and cannot be removed once added, so
there is one, idle unless a watch is on in its thread (``_audit.state``).
"""

from __future__ import annotations

import sys
import threading

from .watch_rules import _REFUSED_EVENTS, _exit_message, _off_message, _refuse

# ----------------------------------------------------------------------------- audit events

_audit = threading.local()  # .state: the torch_only watch of this thread, if any
_audit_installed = False


def _audit_hook(event, args):
    state = getattr(_audit, "state", None)
    if state is None or not state.active:
        return
    if event == "object.__setattr__" and len(args) > 1 and args[1] == "__code__":
        state.problem = state.problem or "a function's __code__ was replaced"
        _refuse(state, _off_message("a function's __code__ was replaced"))
    if state.torch_only and event.startswith(_REFUSED_EVENTS):
        _refuse(state, _exit_message(event, "code outside torch (ctypes or another process)"))


def _install_audit_hook():
    """Audit hooks cannot be removed once added: one, idle unless a watch is on in its thread."""
    global _audit_installed
    if not _audit_installed:
        sys.addaudithook(_audit_hook)
        _audit_installed = True
