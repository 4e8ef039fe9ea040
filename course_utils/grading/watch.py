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
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import secrets
import sys
import threading
import types
from collections.abc import Iterable

# A forbidden name -> (torch function names, ATen operator name prefixes, what to write instead).
_RULES = {
    "softmax": (
        {"softmax", "_softmax", "softmin", "special_softmax", "_masked_softmax", "_safe_softmax"},
        ("_softmax", "_safe_softmax", "_masked_softmax", "softmax"),
        "the softmax from exp, a max and a sum",
    ),
    "log_softmax": (
        {"log_softmax", "_log_softmax", "special_log_softmax"},
        ("_log_softmax", "log_softmax"),
        "the log-softmax from the max, exp, sum and log",
    ),
    "logsumexp": (
        {"logsumexp", "special_logsumexp"},
        ("logsumexp",),
        "LSE = m + log(l) from the row max m and the sum l",
    ),
    "scaled_dot_product_attention": (
        {"scaled_dot_product_attention", "_scaled_dot_product_attention_math",
         "_fused_sdp_choice", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"},
        ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention",
         "scaled_dot_product"),
        "attention from its parts: S, the softmax, P V",
    ),
    # make_dual is where forward-mode AD (torch.func.jvp / jacfwd, forward_ad) gets a tangent.
    "backward": ({"backward", "make_dual", "_make_dual"}, ("_make_dual",),
                 "the gradients from the formulas of the chapter"),
    "grad": ({"grad", "make_dual", "_make_dual"}, ("_make_dual",),
             "the gradients from the formulas of the chapter"),
}
_GRADIENTS = "the gradients from the formulas of the chapter"

# Stems of the Python functions in torch's reference implementations that compute a forbidden
# operation from allowed ones (torch._refs.softmax is exp / amax / sum): swapped like the
# course's reference functions, since no operator name would betray them.
_LIBRARY_STEMS = {
    "softmax": ("softmax", "softmin"),
    "log_softmax": ("log_softmax",),
    "logsumexp": ("logsumexp",),
    "scaled_dot_product_attention": ("scaled_dot_product", "flash_attention",
                                     "efficient_attention", "cudnn_attention"),
}
_LIBRARY_MODULES = ("torch._refs", "torch._refs.special", "torch._refs.nn.functional",
                    "torch._decomp.decompositions")

# Python functions that return the answer itself: (module, function names).
_ANSWER_FUNCTIONS = {
    "course_utils.reference": None,  # every public function of the module
    # chapter 11: merges, masks, references (chapters 11 and 13)
    "course_utils.library.serving": None,
    "course_utils.library.ring": None,  # chapter 13: layouts, merges, step work
    "course_utils.library.ulysses": None,  # chapter 13: attention by head shards
    # the front door: every impl computes the answer
    "course_utils.library.attention": ("attention",),
    "scipy.special": ("softmax", "log_softmax", "logsumexp"),
}
# Private functions that return the answer too (a module's None above covers its public ones).
_PRIVATE_ANSWERS = {"course_utils.reference": ("_attention64",)}

# torch_only: at most this many values may leave torch as Python numbers in one call. The
# solutions need at most B + 1 offsets twice (cu_seqlens.tolist() in chapter 11, B <= 8 there).
EXIT_BUDGET = 64
# torch_only: tensor methods that hand the data to something that is not torch (numpy, DLPack,
# raw memory, pickle); none has a use in an exercise that asks for torch.
_DATA_EXITS = {
    "numpy": "converting to numpy",
    "__array__": "converting to numpy",
    "__dlpack__": "DLPack",
    "to_dlpack": "DLPack",
    "data_ptr": "a raw data pointer",
    "untyped_storage": "the raw storage",
    "storage": "the raw storage",
    "_typed_storage": "the raw storage",
    "__cuda_array_interface__": "a raw data pointer",
    "__reduce_ex__": "pickling the tensor",
    "__getstate__": "pickling the tensor",
}
_BULK_EXITS = {"tolist"}  # their values count against EXIT_BUDGET
_PRINTS = {"__repr__", "__str__", "__format__"}

# Audit events refused in a torch_only call: ctypes reads and writes memory and calls C
# directly; a child process or a new interpreter computes where nothing is watched.
_REFUSED_EVENTS = ("ctypes.", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn",
                   "os.system", "os.startfile", "subprocess.Popen", "pty.spawn")

_MARK = "course_utils.grading.watch"  # the profiler range around the whole call
_PDM = "PythonDispatchMode"  # the profiler's range around every dispatch-mode handler


class ForbiddenCall(RuntimeError):
    """Raised inside a graded call when the candidate reaches a forbidden shortcut."""


def _rules_for(names: Iterable[str]):
    functions, prefixes, advice = set(), [], {}
    for name in names:
        fn_names, aten_prefixes, instead = _RULES.get(name, ({name}, (), f"`{name}` yourself"))
        functions |= fn_names
        prefixes += aten_prefixes
        for n in fn_names:
            advice[n] = instead
        for p in aten_prefixes:
            advice["aten." + p] = instead
    return functions, tuple(dict.fromkeys(prefixes)), advice


def _message(found: str, route: str, instead: str) -> str:
    via = f" (reached through {route})" if route else ""
    return (
        f"this exercise forbids `{found}`{via}: the point is to write {instead} yourself, so "
        "library routes to the same operation are refused whatever their name."
    )


def _exit_message(found: str, what: str) -> str:
    return (
        f"this exercise must stay in torch: `{found}` hands the tensor's values to {what}, where "
        "nothing can be watched. Compute it with torch operations on the tensors instead."
    )


def _budget_message(found: str, total: int) -> str:
    return (
        f"this exercise must stay in torch: `{found}` brings the call to {total} values read out "
        f"of torch as Python numbers (at most {EXIT_BUDGET}: a few sizes or offsets). Compute "
        "with torch operations on whole tensors instead of reading their elements in Python."
    )


def _off_message(how: str) -> str:
    return (
        f"the forbidden-operation watch was switched off during this call ({how}): it must stay "
        "on while your code runs. Remove the code that disables torch's function or dispatch "
        "modes, the profiler or the watch's checks, and write the operation yourself."
    )


def _guard(*args, **kwargs):
    """The code every answer function runs while it is forbidden (it names itself)."""
    import sys  # this code runs with the swapped function's globals: import what it needs

    from course_utils.grading.watch import ForbiddenCall

    frame = sys._getframe()
    qualname = f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_name}"
    raise ForbiddenCall(
        f"this exercise forbids `{qualname}`: it computes the answer itself (the course's "
        "float64 reference, or a library's), so it cannot stand in for your implementation."
    )


_library_cache: dict[tuple[str, ...], list] = {}


def _library_copies(names: Iterable[str]) -> list:
    """The Python functions of torch._refs / torch._decomp that compute a forbidden operation.

    Found once per set of names (torch imports those modules itself) and unwrapped to the
    function that holds the arithmetic (under ``register_decomposition`` / ``out_wrapper``), the
    one whose code is swapped.
    """
    stems = tuple(sorted({s for n in names for s in _LIBRARY_STEMS.get(n, ())}))
    if not stems:
        return []
    if stems not in _library_cache:
        found = {}
        for module in _importable(_LIBRARY_MODULES):
            for attr, value in list(vars(module).items()):
                # not the backward formulas: TorchScript compiles those from their source when
                # forward-mode AD starts, and a swapped one would break it
                if not callable(value) or not any(s in attr for s in stems) \
                        or "backward" in attr:
                    continue
                with contextlib.suppress(Exception):
                    fn = inspect.unwrap(value)
                    if isinstance(fn, types.FunctionType):
                        found[id(fn)] = fn
        _library_cache[stems] = list(found.values())
    return _library_cache[stems]


_answer_cache: list = []  # the course's and SciPy's answer functions, found once


def _answer_functions() -> list:
    if not _answer_cache:
        found = {}
        for module_name, names in _ANSWER_FUNCTIONS.items():
            try:
                module = importlib.import_module(module_name)
            except Exception:  # scipy is optional
                continue
            if names is None:
                names = [n for n, v in vars(module).items()
                         if isinstance(v, types.FunctionType) and v.__module__ == module_name
                         and not n.startswith("_")]  # fmt: skip
            names = [*names, *_PRIVATE_ANSWERS.get(module_name, ())]
            for name in names:
                fn = getattr(module, name, None)
                found[id(fn)] = fn
        _answer_cache.append([fn for fn in found.values() if isinstance(fn, types.FunctionType)])
    return _answer_cache[0]


_guard_codes: dict = {}  # the guard's code under each swapped function's name


@contextlib.contextmanager
def _swap_answer_functions(extra=()):
    """Make the course's reference functions (and SciPy's softmax family) raise, and ``extra``."""
    swapped, done = [], set()
    paused, _audit.state = getattr(_audit, "state", None), None  # a nested watch swaps too
    for fn in (*_answer_functions(), *extra):
        if fn.__closure__ or id(fn) in done:
            continue
        done.add(id(fn))
        code = fn.__code__
        swapped.append((fn, code))
        guard = _guard_codes.get(code.co_name)
        if guard is None:
            guard = _guard_codes[code.co_name] = _guard.__code__.replace(co_name=code.co_name)
        fn.__code__ = guard
    _audit.state = paused
    try:
        yield
    finally:
        paused, _audit.state = getattr(_audit, "state", None), None
        for fn, code in reversed(swapped):
            fn.__code__ = code
        _audit.state = paused


# ----------------------------------------------------------------------------- the modes


class _State:
    """What the modes of one watch share with its checks (one per :func:`forbid` call)."""

    def __init__(self, functions, prefixes, advice, torch_only, gradients):
        self.functions, self.prefixes, self.advice = functions, prefixes, advice
        self.torch_only, self.gradients = torch_only, gradients
        self.active = True
        self.seen = 0  # operators the dispatch mode handled (the profiler must agree)
        self.exits = 0  # values read out of torch as Python numbers (all routes, live)
        self.bulk = 0  # .tolist() calls and prints let through (each one a bulk exit)
        self.bulk_values = 0  # the values those carried
        self.in_functions = 0  # depth inside the function mode's own handler
        self.printing = 0  # depth inside a print (its reads are charged once, by size)
        self.verdicts: dict = {}  # OpOverload -> (short name, advice or None)
        self.token = secrets.token_hex(8)
        self.problem: str | None = None  # the first violation found outside an operator
        self.raised: ForbiddenCall | None = None  # the first one raised in a thread it watched


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


def _refuse(s: _State, message: str):
    """Raise ForbiddenCall, remembered by the watch: a refusal that the code catches (or that
    happens in a thread, whose exception never reaches the call) still refuses the call."""
    exc = ForbiddenCall(message)
    s.raised = s.raised or exc
    raise exc


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


def _torch():
    """torch, imported on first use (``import course_utils`` stays light)."""
    return sys.modules.get("torch") or importlib.import_module("torch")


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
    if caller.startswith("torch.") or caller == __name__:
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


# ----------------------------------------------------------------------------- the watch

_local = threading.local()  # .watches: the watches on in this thread, innermost last


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


def _public_name(func) -> str:
    """``torch._softmax``, ``torch.ops.aten._softmax``, ``torch.nn.functional.softmin``."""
    name = getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None) or ""
    if module.startswith("torch._ops"):
        return f"torch.ops.aten.{name}"
    owner = getattr(func, "__objclass__", None)
    on_tensor = owner is not None and owner.__name__ in ("TensorBase", "Tensor")
    if on_tensor or module == "torch._tensor":
        return f"Tensor.{name}"
    if module.startswith("torch._C") or module in ("", "torch"):
        return f"torch.{name}"
    return f"{module}.{name}"


def _importable(module_names):
    """The modules of ``module_names`` that this torch has, imported (an older torch lacks some)."""
    for name in module_names:
        try:
            yield importlib.import_module(name)
        except Exception:
            continue
