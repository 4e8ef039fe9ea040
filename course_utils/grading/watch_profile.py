"""Reading the profiler's record of a watched call (:func:`_analyse`).

Torch's RecordFunction profiler sits below both modes: from its record the watch refuses a
forbidden operator wherever it ran, a backward node that ran, values read out of torch, and an
operator that ran past the dispatch mode (the mode was switched off). Its own room: it reads a
finished record after the call, with none of the modes' machinery.
"""

from __future__ import annotations

import contextlib

from .watch_rules import (
    _GRADIENTS,
    _MARK,
    _PDM,
    EXIT_BUDGET,
    ForbiddenCall,
    _budget_message,
    _exit_message,
    _message,
    _off_message,
    _State,
)

# ----------------------------------------------------------------------------- the profiler


def _profiler_config():
    from torch._C._profiler import ProfilerConfig, ProfilerState, _ExperimentalConfig

    return ProfilerConfig(ProfilerState.CPU, False, False, False, False, False,
                          _ExperimentalConfig())


_composite: dict[str, bool] = {}


def _is_composite(name: str) -> bool:
    """Whether ``aten::name`` decomposes before the dispatch mode (any of its overloads)."""
    if name not in _composite:
        import torch

        namespace, _, op = name.partition("::")
        known, result = True, False
        try:
            packet = getattr(getattr(torch.ops, namespace), op)
            overloads = packet.overloads()
        except Exception:
            known, overloads = False, []
        for overload in overloads:
            full = name if overload == "default" else f"{name}.{overload}"
            with contextlib.suppress(RuntimeError):  # an overload TorchScript alone knows
                if torch._C._dispatch_has_kernel_for_dispatch_key(
                        full, "CompositeImplicitAutograd"):
                    result = True
                    break
        _composite[name] = result or not known  # not an operator at all: nothing to compare
    return _composite[name]


_names: dict = {}  # forbidden prefixes -> {event name: (is an operator, forbidden prefix)}


def _event_name(names: dict, name: str, prefixes) -> tuple:
    op = "::" in name and not name.startswith("autograd::")
    short = name.split("::", 1)[1] if op else ""
    found = next((p for p in prefixes if short.startswith(p)), None) if op else None
    names[name] = op, found
    return names[name]


def _ops_above(frame) -> list:
    names, frame = [], frame[_PARENT]
    while frame is not None:
        if frame[_OP]:
            names.append(frame[_NAME])
        frame = frame[_PARENT]
    return names


# A frame of the record is a list (lists are the cheapest Python object to make, and a call's
# record holds thousands of events): these are its fields.
_NAME, _OP, _MARKED, _PARENT, _IS_PDM, _PDM_CHILD, _PARENT_PDM, _NESTED, _HIDDEN = range(9)


def _analyse(result, s: _State) -> None:
    """Read the profiler's record of the call; raise ForbiddenCall for what it should not hold.

    Every thread the profiler followed is a list of push/pop events; a push names an operator
    (``aten::exp``), a backward node (scope 1), the engine's ``autograd::engine::...`` range or
    the ``PythonDispatchMode`` range torch opens around every dispatch-mode handler. With the
    watch's dispatch mode at the bottom of the mode stack, each of its handler calls is a
    ``PythonDispatchMode`` range holding no other one (a checker's mode pushed later holds the
    watch's), so their count must equal the operators the mode handled; and an operator outside
    those ranges whose call did not open one ran past the mode, unless it is a composite that
    decomposes before any mode. A frame's fate is decided when it is popped: by then its
    children, and for a ``PythonDispatchMode`` range whether it holds another, are known.
    """
    marked = ended = False
    bottom, unseen, scalars, bulk = 0, [], 0, 0
    mark_name, end_name = f"{_MARK}.{s.token}", f"{_MARK}.end.{s.token}"
    printing, prefixes = f"{_MARK}.print.{s.token}", s.prefixes
    names = _names.setdefault(prefixes, {})  # event name -> (is an operator, forbidden prefix)
    for events in result:
        stack: list = []
        for e in events:
            kind = e.kind()
            if kind == "pop":
                if not stack:
                    continue
                f = stack.pop()
                if f[_IS_PDM]:
                    if not f[_NESTED]:
                        bottom += 1
                    elif f[_HIDDEN]:
                        unseen += f[_HIDDEN]  # an upper mode's range: what ran past the watch's
                elif f[_OP] and f[_MARKED] != printing:
                    name = f[_NAME]
                    if name == "aten::_local_scalar_dense":
                        scalars += set(_ops_above(f)) <= _SCALAR_WRAPS
                    elif name == "aten::resolve_neg":
                        bulk += not _ops_above(f)
                    if not f[_PDM_CHILD] and name not in _BELOW_MODES and \
                            not _is_composite(name):
                        pdm = f[_PARENT_PDM]
                        if pdm is None:
                            unseen.append(name)
                        elif pdm[_HIDDEN] is None:
                            pdm[_HIDDEN] = [name]
                        else:
                            pdm[_HIDDEN].append(name)
                continue
            if kind != "push":
                continue
            name = e.name()
            info = names.get(name) or _event_name(names, name, prefixes)
            if info[1] is not None:
                raise ForbiddenCall(_message(f"aten.{name.split('::', 1)[1]}", "the ATen "
                                             "operator that ran, as the profiler recorded it",
                                             s.advice.get("aten." + info[1], "it")))
            if s.gradients and (name.startswith("autograd::engine") or e.scope() == 1):
                raise ForbiddenCall(_message("the autograd engine", f"{name}, a backward node "
                                             "that ran", _GRADIENTS))
            parent = stack[-1] if stack else None
            if parent is None:
                mark = parent_pdm = None
            else:
                mark = parent[_MARKED]
                parent_pdm = parent if parent[_IS_PDM] else parent[_PARENT_PDM]
            is_pdm = name == _PDM
            if is_pdm:
                if parent is not None:
                    parent[_PDM_CHILD] = True
                if parent_pdm is not None:
                    parent_pdm[_NESTED] = True
            elif name.startswith(_MARK):
                marked, ended, mark = marked or name == mark_name, ended or name == end_name, name
            stack.append([name, info[0], mark, parent, is_pdm, False, parent_pdm, False, None])
    if not marked:
        raise ForbiddenCall(_off_message("the watch's profiler was stopped or restarted"))
    if not ended:
        raise ForbiddenCall(_off_message("RecordFunction, which the profiler reads, was off"))
    if s.torch_only:
        if bulk > s.bulk:
            raise ForbiddenCall(_exit_message("Tensor.tolist", "Python lists past the watch"))
        if scalars + s.bulk_values > EXIT_BUDGET:
            raise ForbiddenCall(_budget_message("Tensor.item", scalars + s.bulk_values))
    if unseen:
        raise ForbiddenCall(_off_message(f"aten::{unseen[0].split('::')[-1]} ran past the "
                                         "dispatch mode"))
    if bottom != s.seen:
        raise ForbiddenCall(_off_message(f"{bottom} operators reached the dispatch mode's place "
                                         f"in the profile, {s.seen} reached the mode"))


# `_local_scalar_dense` under only these is a value read by Python (item, float, int, bool).
_SCALAR_WRAPS = {"aten::item", "aten::is_nonzero", "aten::_local_scalar_dense"}
# What torch.tensor / as_tensor run below the Python key before handing their result to the
# modes through lift_fresh (allocating, reading Python scalars, converting), and as_subclass's
# alias. None of them can compute a forbidden operation, and a forbidden operator is refused by
# name wherever it runs.
_BELOW_MODES = {"aten::empty", "aten::empty_strided", "aten::to", "aten::_to_copy",
                "aten::copy_", "aten::detach_", "aten::item", "aten::_local_scalar_dense",
                "aten::lift_fresh", "aten::alias"}  # alias: Tensor.as_subclass
