"""Watch what a graded call actually runs, and stop library shortcuts whatever their route.

An exercise that asks for a softmax forbids ``torch.softmax``. Matching that one name is not
enough: ``torch._softmax``, ``torch.ops.aten._softmax``, ``F.softmin(-S)`` and SDPA's math path
all end in the same ATen operator. :func:`forbid` therefore watches several levels at once while
the student's code runs:

- **torch functions** (a ``TorchFunctionMode``): every public and private torch function by the
  name torch reports, however it was imported or aliased;
- **ATen operators** (a ``TorchDispatchMode``): the operators that really execute, after every
  Python wrapper and decomposition, e.g. ``aten._softmax`` or ``aten._scaled_dot_product_*``;
- **the profiler's record of every operator call** (torch's thread-local RecordFunction profiler,
  run by the watch for the length of the call). It sits below both Python modes, so it records
  what runs while a mode is switched off (``DisableTorchFunction``, a popped mode, an excluded
  ``Python`` dispatch key), inside a custom op's Python kernel or a tensor subclass, and the
  composite operators that decompose before any mode. From it the watch refuses a forbidden
  operator wherever it ran, a backward node that ran, and values read out of torch; and it
  counts the dispatch mode's handler calls (each opens a ``PythonDispatchMode`` range) against
  the calls the mode saw: an operator that ran past the mode means the watch was switched off;
- **Python functions of the course, of SciPy and of torch's own Python copies** whose result is
  the answer itself: ``course_utils.reference`` (the float64 ground truth of every check),
  ``scipy.special.softmax`` / ``log_softmax`` / ``logsumexp``, and the reference
  implementations of a forbidden operation in ``torch._refs`` / ``torch._decomp`` (they rebuild
  a softmax from ``exp`` and ``amax``, which no operator name betrays). Their code objects are
  swapped for one that raises, so every alias, ``functools.partial`` or stored reference is
  caught.

Forbidding ``"backward"`` or ``"grad"`` forbids the autograd engine itself, by any route
(``Tensor.backward``, an alias of ``torch.autograd.backward``, ``torch.autograd.functional``,
``torch.func.grad`` / ``vjp`` / ``jacrev``, ``Variable._execution_engine.run_backward``, a
``grad_fn`` node called by hand): the dispatch mode refuses any operator run while the engine
has a graph task or a node in flight, and the profiler record refuses any backward node that
ran. Forward-mode AD (``torch.func.jvp`` / ``jacfwd``, ``torch.autograd.forward_ad``) is refused
at ``make_dual``, the one way a tangent enters a tensor.

With ``torch_only=True`` the code must stay in torch, where it can be watched: numpy, DLPack,
raw storage or data pointers, pickling a tensor, operators outside ATen (a custom op's kernel),
tensor subclasses with their own handlers, ctypes, threads and child processes are refused, and
at most ``EXIT_BUDGET`` values may leave torch as Python numbers in one call (``.item()``,
``float(t)``, ``bool(t)``, ``.tolist()``, printing a tensor). The solutions read a handful of
sizes or offsets that way (chapter 11's ``cu_seqlens.tolist()``: at most 18 values); a softmax
computed in Python over a score matrix needs thousands. A budget per call rather than a rule per
tensor also stops the element-by-element loop (``for x in t: float(x)``), and one that counts
integers too stops values smuggled out as fixed-point integers.

While a watch is on, the entry points that switch torch's modes or the profiler off
(``DisableTorchFunction``, ``_pop_mode``, ``_disable_current_modes``, ``_ExcludeDispatchKeyGuard``,
``redispatch``, ``_disable_profiler``, ``_enable_record_function``, ...) are replaced, under every
name torch's modules hold them by, with guards that raise when the student's code calls them;
after the call the mode stacks, the dispatch-key sets and the profiler record must show that
nothing was switched off or restarted, and a refusal the code caught (or that happened in a
thread) still refuses the call. Everything is restored when the call ends.

The grader only wraps the candidate's own calls in :func:`forbid`; the checks around them
(references, comparisons) run outside it. Cost, measured on one CPU core: a 4x8x64x32 attention
in torch (0.7 ms alone) takes about 2.8 ms watched, half a millisecond more than with the two
modes alone; a tiled forward pays about 20 us more per operator than with the modes alone (the
profiler's record, then reading it).

Limits: the watch runs in the student's own process (the sandboxed worker when grading), so it
is a tripwire for library routes and for the known ways of switching it off, not a wall against
code written to defeat this module. What in-process watching can never stop: C code (ctypes,
or any compiled extension loaded before the call) reading a tensor's memory to compute outside
torch, or writing the interpreter's or torch's memory, e.g. its thread-local mode stack (ctypes
calls made during a ``torch_only`` call are refused, but a C function resolved before the call
raises no audit event); entry points captured before the call under another name (``from
torch._C import DisableTorchFunction as off``), which only the after-the-fact checks see (the
mode stacks, the profiler record): a captured ``redispatch_boxed`` handle runs an operator below
both modes and the profiler alike, and a captured switch around an exit that runs no operator
(``data_ptr``, ``__dlpack__``) goes unseen; a thread started before the call that runs torch on
request (modes and the profiler are per thread: only threads started during the call are
refused or watched); forging the profiler's record (restarting it and replaying the watch's
markers) or rewriting this module's objects reached through ``gc``; and values leaving torch
one bit at a time through comparisons that end in a Python ``bool`` (``torch.equal``,
``allclose``). In exercises that are not ``torch_only`` (kernels in a simulator, which needs
threads, C and processes) a child process can compute anything, and threads started during the
call are watched by the modes but not by the profiler. None of this changes a score by itself:
the checks of what the code returns run in the grading process, which the student's code never
reaches.

Where each part lives (this module keeps :func:`forbid`, :class:`ForbiddenCall` and
``EXIT_BUDGET``, the names the grader, the sandbox and the specs import): the tables, the
messages and the state one call shares in :mod:`.watch_rules` (the bottom: it imports nothing
of course_utils, and neither does any part of the watch); the two torch modes in
:mod:`.watch_modes`; the guards on the switches and threads in :mod:`.watch_switches`; the
audit hook in :mod:`.watch_audit`; the swapped answer functions in :mod:`.watch_answers`; the
reading of the profiler's record in :mod:`.watch_profile`. Here: :class:`_Watch`, which puts
them together around one call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from .watch_answers import _library_copies, _swap_answer_functions
from .watch_audit import _audit, _install_audit_hook
from .watch_modes import _ORIGINALS, _mode_classes
from .watch_profile import _analyse, _profiler_config
from .watch_rules import (
    _MARK,
    EXIT_BUDGET,  # noqa: F401  (public: the values a torch_only call may read out of torch)
    ForbiddenCall,
    _local,
    _off_message,
    _rules_for,
    _State,
    _torch,
)
from .watch_switches import _guarded_switches

# ----------------------------------------------------------------------------- the watch


class _Watch:
    """The modes, switches, audit state and profiler session of one :func:`forbid` call."""

    def __init__(self, state):
        functions_cls, operators_cls = _mode_classes()
        self.state = state
        self.functions = functions_cls(state)
        self.operators = operators_cls(state, self.functions)

    @contextlib.contextmanager
    def on(self):
        torch = _torch()
        s = self.state
        outer = getattr(_local, "watches", None) or []
        profiling = not outer  # a nested watch leaves the record to the outermost one
        if profiling and torch.autograd._profiler_enabled():
            raise ForbiddenCall(
                "a torch profiler is already running in this thread: the forbidden-operation "
                "watch runs its own while your code is graded. Stop the profiler (or run the "
                "check outside it)."
            )
        _install_audit_hook()
        result, body_error = None, None
        _local.watches = [*outer, self]
        saved_audit = getattr(_audit, "state", None)
        try:
            with _guarded_switches():
                mark = None
                if profiling:
                    from torch._C._profiler import _RecordFunctionFast

                    _ORIGINALS["record_function"](True)  # switched off before the call?
                    _ORIGINALS["enable"](_profiler_config())
                    mark = _RecordFunctionFast(f"{_MARK}.{s.token}")
                    mark.__enter__()
                try:
                    self.functions.__enter__()
                    self.functions_at = torch._C._len_torch_function_stack() - 1
                    self.operators.__enter__()
                    self.operators_at = torch._C._len_torch_dispatch_stack() - 1
                    entry = _key_sets()  # with the modes on (they add the Python keys)
                    _audit.state = s
                    try:
                        yield
                    except BaseException as exc:
                        body_error = exc
                    finally:
                        _audit.state = saved_audit
                        self._check_state(entry)
                        self._leave()
                finally:
                    if profiling:
                        with contextlib.suppress(Exception):
                            mark.__exit__(None, None, None)
                        with _RecordFunctionFast(f"{_MARK}.end.{s.token}"):
                            pass  # missing from the record if RecordFunction is off now
                        try:
                            result = _ORIGINALS["disable"]()
                        except Exception:  # stopped by the code it watched
                            s.problem = s.problem or "the watch's profiler was stopped"
        finally:
            s.active = False
            _local.watches = outer
        if isinstance(body_error, ForbiddenCall) or \
                body_error is not None and not isinstance(body_error, Exception):
            raise body_error  # a refusal already, or KeyboardInterrupt / SystemExit
        if s.raised is not None:
            raise s.raised
        try:
            if s.problem:
                raise ForbiddenCall(_off_message(s.problem))
            if result is not None:
                _analyse(result, s)
        except ForbiddenCall as found:
            if body_error is not None:
                raise found from body_error
            raise
        if body_error is not None:
            raise body_error

    def _check_state(self, entry):
        """The modes and dispatch keys must be as the watch left them when the call began."""
        s, c = self.state, _torch()._C
        if c._is_torch_function_all_disabled():
            s.problem = s.problem or "torch functions were left disabled"
        n = c._len_torch_function_stack()
        if n <= self.functions_at or c._get_function_stack_at(self.functions_at) \
                is not self.functions:
            s.problem = s.problem or "the function mode was popped"
        n = c._len_torch_dispatch_stack()
        if n <= self.operators_at or c._get_dispatch_stack_at(self.operators_at) \
                is not self.operators:
            s.problem = s.problem or "the dispatch mode was popped"
        if _key_sets() != entry:
            s.problem = s.problem or "the dispatch keys were changed"

    def _leave(self):
        """Pop the watch's modes, and whatever the call left above them."""
        c = _torch()._C
        while c._len_torch_dispatch_stack() > self.operators_at:
            top = c._get_dispatch_stack_at(c._len_torch_dispatch_stack() - 1)
            if top is self.operators:
                self.operators.__exit__(None, None, None)
                break
            _ORIGINALS["_pop_torch_dispatch_stack"](None)
        while c._len_torch_function_stack() > self.functions_at:
            top = c._get_function_stack_at(c._len_torch_function_stack() - 1)
            if top is self.functions:
                self.functions.__exit__(None, None, None)
                break
            _ORIGINALS["_pop_torch_function_stack"]()


def _key_sets():
    c = _torch()._C
    return (c._dispatch_tls_local_exclude_set().raw_repr(),
            c._dispatch_tls_local_include_set().raw_repr())


@contextlib.contextmanager
def forbid(names: Iterable[str] = (), *, torch_only: bool = False):
    """Raise :class:`ForbiddenCall` when code inside the block reaches a forbidden operation.

    ``names`` are the exercise's forbidden operations (``"softmax"``, ``"log_softmax"``,
    ``"logsumexp"``, ``"scaled_dot_product_attention"``, ``"backward"``, ``"grad"``, or any torch
    function name); the course's reference functions are always forbidden inside the block.
    ``torch_only`` also forbids leaving torch (numpy, DLPack, raw memory, ctypes, threads,
    child processes, more than ``EXIT_BUDGET`` values read as Python numbers).
    """
    names = tuple(names)
    functions, prefixes, advice = _rules_for(names)
    with _swap_answer_functions(_library_copies(names)):
        if not (functions or prefixes or torch_only):
            yield
            return
        gradients = bool({"backward", "grad"} & set(names))
        state = _State(functions, prefixes, advice, torch_only, gradients)
        with _Watch(state).on():
            yield
