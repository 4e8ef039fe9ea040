"""Guards on the entry points that would switch the watch off, and on new threads.

``DisableTorchFunction``, ``_pop_mode``, ``_ExcludeDispatchKeyGuard``, ``redispatch``, the
profiler's switches, ...: every name under which torch's modules hold one is replaced, for the
length of the outermost watch, by a guard that refuses the call in a watched thread; threads
started during a call are refused (``torch_only``) or run with the watch's modes. Its own room:
it patches torch's module attributes and restores them, which nothing else in the watch does.
"""

from __future__ import annotations

import contextlib
import sys
import threading

from .watch_modes import _ORIGINALS, _mode_classes
from .watch_rules import (
    _DATA_EXITS,
    _exit_message,
    _importable,
    _local,
    _off_message,
    _refuse,
    _torch,
)

# The watch's own modules (this one, watch and its watch_* siblings): their calls of a switch
# are the watch's own, like torch's.
_WATCH = __name__.rpartition(".")[0] + ".watch"

# ----------------------------------------------------------------------------- entry points


_SCANNED = ("torch", "torch._C", "torch._C._autograd", "torch.autograd", "torch.autograd.profiler",
            "torch.autograd.profiler_legacy", "torch.overrides", "torch.utils._python_dispatch",
            "torch.utils.dlpack", "torch._ops", "torch.profiler", "torch.profiler.profiler")


def _switches():
    """``(owner, attribute, level)`` for every entry point that switches a watch level off.

    ``level`` says when a call is allowed: ``None``, never while the watch is on; ``"functions"``
    / ``"operators"``, when it pops a mode that is not the watch's (a checker's own mode
    leaving) or when torch's own code calls it (its ``handle_torch_function`` pops the function
    mode around the handler it calls, ``Tensor.__repr__`` sets the dispatch modes aside);
    ``"exit"``, outside torch_only calls. Every name under which torch's modules hold one of
    these objects is guarded (found once, by identity, before any guard exists).
    """
    if "switches" not in _ORIGINALS:
        torch = _torch()
        c, dispatch = torch._C, sys.modules["torch.utils._python_dispatch"]
        levels = {name: None for name in (
            "DisableTorchFunction", "_DisableTorchDispatch", "_DisablePythonDispatcher",
            "_set_torch_function_state", "_set_skip_next_torch_function",
            "_skip_one_hop_torch_function", "_unset_dispatch_mode", "_set_dispatch_mode",
            "_ExcludeDispatchKeyGuard", "ExcludeDispatchKeyGuard", "_SetExcludeDispatchKeyGuard",
            "_ForceDispatchKeyGuard", "_dispatch_tls_set_dispatch_key_excluded",
            "_dispatch_tls_set_dispatch_key_included", "_RestorePythonTLSSnapshot")}
        levels.update(_to_dlpack="exit", _to_dlpack_versioned="exit",
                      _pop_torch_function_stack="functions",
                      _pop_torch_dispatch_stack="operators")
        objects = {id(getattr(c, n)): (getattr(c, n), lv) for n, lv in levels.items()
                   if hasattr(c, n)}
        for n in ("_disable_profiler", "_disable_profiler_legacy", "_enable_record_function",
                  "_enable_profiler", "_enable_profiler_legacy", "_prepare_profiler"):
            if hasattr(c._autograd, n):
                objects[id(getattr(c._autograd, n))] = (getattr(c._autograd, n), None)
        for owner, level in ((torch.overrides, "functions"), (dispatch, "operators")):
            for n in ("_pop_mode", "_pop_mode_temporarily", "_disable_current_modes"):
                if hasattr(owner, n):
                    objects[id(getattr(owner, n))] = (getattr(owner, n), level)
        rows = []
        for module in _importable(_SCANNED):
            for attr, value in list(vars(module).items()):
                if id(value) in objects and objects[id(value)][0] is value:
                    rows.append((module, attr, objects[id(value)][1]))
        # below the Python key and the profiler alike: an operator called for one dispatch key
        rows += [(torch._ops.OpOverload, "redispatch", None),
                 (c._DispatchOperatorHandle, "redispatch_boxed", None)]
        _ORIGINALS["switches"] = [(o, n, lv) for o, n, lv in rows if hasattr(o, n)]
    return _ORIGINALS["switches"]


def _current():
    """The innermost watch on in this thread, or None."""
    watches = getattr(_local, "watches", None)
    return watches[-1] if watches else None


def _switch_guard(original, label, level):
    """What a switch entry point becomes while a watch is on (made once per entry point; it
    acts only in a thread whose call is watched)."""

    def guarded(*args, **kwargs):
        watch = _current()
        s = watch.state if watch is not None else None
        if s is not None and s.active:
            if level == "exit":
                if s.torch_only:
                    _refuse(s, _exit_message(label, _DATA_EXITS["to_dlpack"]))
            elif not _allowed(level, watch):
                s.problem = s.problem or f"`{label}` was called"
                _refuse(s, _off_message(f"`{label}` was called"))
        return original(*args, **kwargs)

    guarded.__name__ = getattr(original, "__name__", label.rsplit(".", 1)[-1])
    guarded.__wrapped_by_watch__ = original
    return guarded


def _allowed(level, watch) -> bool:
    if level is None:
        return False
    caller = (sys._getframe(2).f_globals.get("__name__") or "")
    if caller.startswith("torch.") or caller == _WATCH or caller.startswith(_WATCH + "_"):
        return True  # torch's mode machinery stashes and restores the modes it calls
    c = _torch()._C
    if level == "functions":
        n = c._len_torch_function_stack()
        return n > 0 and c._get_function_stack_at(n - 1) is not watch.functions
    n = c._len_torch_dispatch_stack()
    return n > 0 and c._get_dispatch_stack_at(n - 1) is not watch.operators


_guards: list = []  # (owner, attribute, original, guard), made on first use
_guards_lock = threading.Lock()
_guards_depth = 0  # watches on, in every thread: the guards stay while one is


def _guard_table():
    if not _guards:
        for owner, attr, level in _switches():
            original = getattr(owner, attr)
            label = f"{owner.__name__}.{attr}"
            if isinstance(owner, type):
                label = f"{owner.__module__}.{label}"
            _guards.append((owner, attr, original, _switch_guard(original, label, level)))
        for owner, attr in ((sys.modules.get("_thread"), "start_new_thread"),
                            (threading, "_start_new_thread")):
            if owner is not None and hasattr(owner, attr):
                original = getattr(owner, attr)
                _guards.append((owner, attr, original, _thread_guard(original)))
    return _guards


@contextlib.contextmanager
def _guarded_switches():
    """Put the guards in place for the length of the outermost watch, then the originals back."""
    global _guards_depth
    table = _guard_table()
    with _guards_lock:
        if _guards_depth == 0:
            for owner, attr, _, guard in table:
                setattr(owner, attr, guard)
        _guards_depth += 1
    try:
        yield
    finally:
        with _guards_lock:
            _guards_depth -= 1
            if _guards_depth == 0:
                for owner, attr, original, _ in table:
                    setattr(owner, attr, original)


def _thread_guard(original):
    """Threads started during a call: refused in torch_only calls, watched by the modes in the
    others (the CUDA simulator runs one thread per GPU thread; modes are per thread)."""

    def start(function, args=(), *rest):
        watch = _current()
        if watch is None or not watch.state.active:
            return original(function, args, *rest)
        s = watch.state
        if s.torch_only:
            _refuse(s, _exit_message("starting a thread", "a thread the watch does not see "
                                     "(its modes are per thread)"))
        functions_cls, operators_cls = _mode_classes()

        def watched(*a, **k):
            _local.watches = [watch]
            functions = functions_cls(s)
            with functions, operators_cls(s, functions, counted=False):
                return function(*a, **k)

        return original(watched, args, *rest)

    start.__wrapped_by_watch__ = original
    return start
