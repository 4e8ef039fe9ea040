"""The watch's tables and the small parts every level of it shares.

What each forbidden name covers (torch function names, ATen operator prefixes, what to write
instead), the Python functions that return an answer (:data:`_ANSWER_FUNCTIONS`: the one place
that names them), the data exits of a ``torch_only`` call and ``EXIT_BUDGET``;
:class:`ForbiddenCall` and the wording of every refusal; :class:`_State`, what one
:func:`~course_utils.grading.watch.forbid` call's levels share, and :func:`_refuse`. It is the
bottom of the watch (and imports nothing of course_utils): the modes, the switch guards, the
audit hook, the answer swapping and the profiler's analysis all read it, and none of them is
needed to read a table.
"""

from __future__ import annotations

import importlib
import secrets
import sys
import threading
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
    # chapter 13: layouts, merges, step work; ring.py re-exports the modules below, and a
    # module's entry covers the functions defined in it (their code is swapped)
    "course_utils.library.ring": None,
    "course_utils.library.ring_layouts": None,
    "course_utils.library.ring_comm": None,
    "course_utils.library.ring_blocks": None,
    "course_utils.library.ring_pass": None,
    "course_utils.library.ring_allgather": None,
    "course_utils.library.ring_launcher": None,
    "course_utils.library.ring_workers": None,
    "course_utils.library.ring_benchmark": None,
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


def _refuse(s: _State, message: str):
    """Raise ForbiddenCall, remembered by the watch: a refusal that the code catches (or that
    happens in a thread, whose exception never reaches the call) still refuses the call."""
    exc = ForbiddenCall(message)
    s.raised = s.raised or exc
    raise exc


_local = threading.local()  # .watches: the watches on in this thread, innermost last


def _torch():
    """torch, imported on first use (``import course_utils`` stays light)."""
    return sys.modules.get("torch") or importlib.import_module("torch")


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
