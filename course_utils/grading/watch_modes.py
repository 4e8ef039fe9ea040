"""The watch's two torch modes: the function mode and the dispatch mode.

:class:`_Functions` (a ``TorchFunctionMode``) sees every torch function by the name torch
reports; :class:`_Operators` (a ``TorchDispatchMode``) sees the ATen operators that really run.
Both refuse forbidden names, and in a ``torch_only`` call the data exits, subclasses with their
own handlers and values read out of torch past ``EXIT_BUDGET``. :func:`_mode_classes` makes the
two classes once and keeps the entry points the watch itself calls (:data:`_ORIGINALS`) before
any is guarded. Its own room: this is the level that runs inside every operator call.
"""

from __future__ import annotations

import contextlib
import sys
import types

from .watch_rules import (
    _BULK_EXITS,
    _DATA_EXITS,
    _GRADIENTS,
    _MARK,
    _PRINTS,
    EXIT_BUDGET,
    _budget_message,
    _exit_message,
    _message,
    _off_message,
    _public_name,
    _refuse,
    _State,
    _torch,
)


def _own_function(func) -> bool:
    """Whether ``func`` is torch's own (a builtin, an operator, or Python code of torch).

    The function mode stashes itself while its handler runs ``func``; a Python function of the
    student's reached through ``handle_torch_function`` would then run unwatched, so such
    functions are run with the mode pushed again instead.
    """
    if isinstance(func, (types.FunctionType, types.MethodType)):
        return (getattr(func, "__module__", None) or "").startswith("torch")
    return True


class _Functions:
    """The function mode's handler (the class is made a TorchFunctionMode on first use)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        s, kwargs = self.state, kwargs or {}
        if not s.active:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in s.functions or name.removeprefix("special_") in s.functions:
            _refuse(s, _message(_public_name(func), "", s.advice.get(name, "it")))
        if s.torch_only:
            self._check_exit(func, name, types_, args)
        if name in _PRINTS:
            return _print(s, func, name, args, kwargs)
        if name == "resolve_neg":
            s.bulk += 1  # called by name: not a hidden .tolist()
        if not _own_function(func):
            with _pushed_function_mode(self):
                return func(*args, **kwargs)
        s.in_functions += 1
        try:
            return func(*args, **kwargs)
        finally:
            s.in_functions -= 1

    def _check_exit(self, func, name, types_, args):
        s = self.state
        if (name in _DATA_EXITS or name in _BULK_EXITS) and _from_checker():
            s.bulk += name in _BULK_EXITS  # the grader's own helper (course_utils.grading.harness)
            return
        if name in _DATA_EXITS:
            _refuse(s, _exit_message(_public_name(func), _DATA_EXITS[name]))
        for t in types_:  # a subclass's own __torch_function__ would run with this mode stashed
            own = getattr(t, "__torch_function__", None)
            if own is not None and getattr(own, "__func__", own) not in _DEFAULT_HANDLERS \
                    and not t.__module__.startswith("torch"):
                _refuse(s, _exit_message(
                    f"{t.__name__}.__torch_function__", "a tensor subclass's own handler"))
        if name in _BULK_EXITS:
            _charge(s, _numel(args[0]) if args else 0, _public_name(func))


_checker_cache: dict[tuple, frozenset] = {}


def _checker_codes() -> frozenset:
    """The code objects of ``course_utils.grading.harness``: the grader's helpers that run beside
    the candidate (e.g. a dispatch mode counting which storages an operator reads). Matched by
    identity, so code compiled elsewhere under the same file or module name is not trusted."""
    modules = tuple(sorted(n for n in sys.modules if n.startswith("course_utils.grading.harness")))
    if modules not in _checker_cache:
        codes, todo = set(), []
        for name in modules:
            for value in vars(sys.modules[name]).values():
                members = vars(value).values() if isinstance(value, type) else (value,)
                todo += [getattr(m, "__code__", None) for m in members]
        while todo:
            code = todo.pop()
            if isinstance(code, types.CodeType) and code not in codes:
                codes.add(code)
                todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        _checker_cache[modules] = frozenset(codes)
    return _checker_cache[modules]


def _from_checker() -> bool:
    """Whether the function mode's handler was called from the grader's helper code."""
    frame = sys._getframe(3)  # _from_checker <- _check_exit <- __torch_function__ <- caller
    return frame.f_code in _checker_codes()


def _charge(s: _State, n: int, found: str) -> None:
    """Count ``n`` values leaving torch in one piece (``.tolist()``, a print)."""
    if s.exits + n > EXIT_BUDGET:
        _refuse(s, _budget_message(found, s.exits + n))
    s.exits += n
    s.bulk += 1
    s.bulk_values += n


def _numel(obj) -> int:
    try:
        return int(obj.numel())
    except Exception:
        return 0


def _print(s: _State, func, name, args, kwargs):
    """``repr`` / ``str`` / ``format`` of a tensor: torch's formatter without its mode switch.

    Torch's ``Tensor.__repr__`` switches the dispatch modes off around its formatting, which the
    watch would report as tampering. The same formatter (``_str_intern``) runs here with the
    modes on, inside a profiler range the checks recognise; in a torch_only call the printed
    values count against ``EXIT_BUDGET`` (printing is reading values out of torch).
    """
    torch = _torch()
    tensor = args[0] if args else None
    s.in_functions += 1
    try:
        if name == "__format__":
            spec = args[1] if len(args) > 1 else kwargs.get("format_spec", "")
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 0 or spec:
                return func(*args, **kwargs)  # 0-d: its .item() (one value); a spec: TypeError
        if s.torch_only:
            n = _numel(tensor)
            _charge(s, n, f"printing a tensor of {n} values")
        else:
            s.bulk += 1
        from torch._C._profiler import _RecordFunctionFast
        from torch._tensor_str import _str_intern

        s.printing += 1
        try:
            with _RecordFunctionFast(f"{_MARK}.print.{s.token}"), torch.no_grad():
                return _str_intern(tensor)
        finally:
            s.printing -= 1
    finally:
        s.in_functions -= 1


@contextlib.contextmanager
def _pushed_function_mode(mode):
    c = _torch()._C
    c._push_on_torch_function_stack(mode)
    try:
        yield
    finally:
        n = c._len_torch_function_stack()
        if n and c._get_function_stack_at(n - 1) is mode:
            _ORIGINALS["_pop_torch_function_stack"]()


class _Operators:
    """The dispatch mode's handler (made a TorchDispatchMode on first use)."""

    def __init__(self, state, functions, counted=True):
        super().__init__()
        self.state, self.functions, self.counted = state, functions, counted

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        torch = _torch()
        s, kwargs = self.state, kwargs or {}
        if not s.active:
            return func(*args, **kwargs)
        if self.counted:
            s.seen += 1
        verdict = s.verdicts.get(func)
        if verdict is None:
            verdict = s.verdicts[func] = _verdict(s.prefixes, s.advice, func)
        op, advice, namespace = verdict
        if advice is not None:
            _refuse(s, _message(f"aten.{op}", "the ATen operator that ran", advice))
        if s.torch_only and namespace not in _TORCH_NAMESPACES:
            _refuse(s, _exit_message(f"{namespace}::{op}", "an operator of its own, whose kernel "
                                     "(C++, Python or compiled) the watch does not see into"))
        if s.gradients and (torch._C._current_graph_task_id() != -1
                            or torch._C._current_autograd_node() is not None):
            _refuse(s, _message("the autograd engine", f"aten.{op} run by a backward pass",
                                _GRADIENTS))
        if torch._C._is_torch_function_all_disabled():
            _refuse(s, _off_message(f"torch functions disabled around aten.{op}"))
        if not s.in_functions and not _holds(self.functions):
            _refuse(s, _off_message(f"the function mode was popped around aten.{op}"))
        if s.torch_only:
            if op == "_local_scalar_dense" and not s.printing:
                s.exits += 1
                if s.exits > EXIT_BUDGET:
                    _refuse(s, _budget_message("Tensor.item", s.exits))
            for t in types_:  # a subclass's own __torch_dispatch__ runs with this mode stashed
                own = getattr(t, "__torch_dispatch__", None)
                if own is not None and getattr(own, "__func__", own) is not _DEFAULT_DISPATCH \
                        and not t.__module__.startswith("torch"):
                    _refuse(s, _exit_message(
                        f"{t.__name__}.__torch_dispatch__", "a tensor subclass's own handler"))
        return func(*args, **kwargs)


_verdicts: dict = {}


_TORCH_NAMESPACES = {"aten", "prims", "profiler"}  # torch's own operators, in a torch_only call


def _verdict(prefixes, advice, func):
    """``(short name, advice if forbidden else None, namespace)`` of an operator, kept."""
    key = (func, prefixes)
    if key not in _verdicts:
        namespace, _, op = func.name().partition("::")
        op = op.split(".")[0]
        found = next((p for p in prefixes if op.startswith(p)), None)
        _verdicts[key] = op, (advice.get("aten." + found, "it") if found else None), namespace
    return _verdicts[key]


def _holds(mode) -> bool:
    c = _torch()._C
    return any(c._get_function_stack_at(i) is mode
               for i in range(c._len_torch_function_stack() - 1, -1, -1))


_CLASSES: dict[str, type] = {}
_DEFAULT_HANDLERS: set = set()
_DEFAULT_DISPATCH = None
_ORIGINALS: dict = {}  # the entry points the watch itself calls, taken before any is guarded


def _mode_classes():
    """The two mode classes, made once (a class per call would cost a tenth of a millisecond)."""
    global _DEFAULT_DISPATCH
    if not _CLASSES:
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        _CLASSES["functions"] = type("_Functions", (_Functions, TorchFunctionMode), {})
        _CLASSES["operators"] = type("_Operators", (_Operators, TorchDispatchMode), {})
        _DEFAULT_HANDLERS.update({torch.Tensor.__torch_function__.__func__,
                                  torch._C._disabled_torch_function_impl})
        _DEFAULT_DISPATCH = torch._C._disabled_torch_dispatch_impl
        _ORIGINALS.update(
            _pop_torch_function_stack=torch._C._pop_torch_function_stack,
            _pop_torch_dispatch_stack=torch._C._pop_torch_dispatch_stack,
            enable=torch.autograd._enable_profiler_legacy,
            disable=torch.autograd._disable_profiler_legacy,
            record_function=torch._C._autograd._enable_record_function,
        )
    return _CLASSES["functions"], _CLASSES["operators"]
