"""The forbidden-operation watch as a measured boundary: every known route is caught, honest
code passes.

Each attack is a candidate that reaches a forbidden operation by one route (a library shortcut,
switching a level of the watch off, leaving torch, reaching the autograd engine); it runs inside
``forbid`` with the real settings of the exercise it would cheat (``specs.get(id).forbidden`` and
``torch_only``) and must raise ForbiddenCall. Most attacks are built so that the route alone
would have hidden the forbidden operation from the watch before it had the level that catches
it. The honest candidates (a softmax from exp / max / sum, a tiled attention forward, a backward
from the chapter's formulas, chapter 11's cascade reading ``cu_seqlens``) run under the same
settings and must pass untouched.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import io
import math
import os
import pickle
import struct
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch._C import DisableTorchFunction as _captured_disable_tf  # taken before any watch
from torch._C import _ExcludeDispatchKeyGuard as _captured_exclude
from torch.autograd import _disable_profiler_legacy as _captured_stop_profiler
from torch.autograd import _enable_profiler_legacy as _captured_start_profiler
from torch.autograd import _enable_record_function as _captured_record_function

from course_utils import specs, watch
from course_utils.grading.watch import EXIT_BUDGET, ForbiddenCall, forbid

PYTHON_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
SOFTMAX = "02.stable_softmax"  # softmax, log_softmax, logsumexp forbidden
FORWARD = "07.torch_forward"  # + SDPA, torch_only
BACKWARD = "08.torch_backward"  # + backward, grad, torch_only
CASCADE = "11.shared_prefix"  # SDPA, torch_only


def run(exercise_id, fn, *args):
    ex = specs.get(exercise_id)
    with forbid(ex.forbidden, torch_only=ex.torch_only):
        return fn(*args)


def qkv(seed=0, shape=(2, 2, 16, 8)):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g) for _ in range(3))


def _scores(Q, K):
    return Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])


# ----------------------------------------------------------------------------- honest code


def honest_softmax(x):
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def honest_forward(Q, K, V, Bc=8):
    """Tiled attention with the online softmax; reads two sizes as Python numbers and prints."""
    m = torch.full(Q.shape[:-1] + (1,), -math.inf)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(Q)
    for c0 in range(0, K.shape[2], Bc):
        S = _scores(Q, K[:, :, c0:c0 + Bc])
        m_new = torch.maximum(m, S.amax(-1, keepdim=True))
        P = torch.exp(S - m_new)
        alpha = torch.exp(m - m_new)
        l = l * alpha + P.sum(-1, keepdim=True)
        acc = acc * alpha + P @ V[:, :, c0:c0 + Bc]
        m = m_new
    n = int(torch.tensor(K.shape[2]))  # a size read back: one value
    if bool((l > 0).all()) and n > 0:
        repr(l[0, 0, :2])  # a debug print of two values
        f"{float(l[0, 0, 0]):.3f}"
    return acc / l, (m + torch.log(l)).squeeze(-1)


def honest_backward(Q, K, V, dO):
    S = _scores(Q, K)
    P = honest_softmax(S)
    O = P @ V
    dV = P.transpose(-2, -1) @ dO
    dP = dO @ V.transpose(-2, -1)
    D = (dO * O).sum(-1, keepdim=True)
    dS = P * (dP - D)
    scale = 1 / math.sqrt(Q.shape[-1])
    return scale * dS @ K, scale * dS.transpose(-2, -1) @ Q, dV


def honest_cascade(q, K, V, cu_seqlens):
    """Per-sequence attention over packed tokens, slicing by ``cu_seqlens.tolist()``."""
    out = torch.empty_like(q)
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        rows = slice(cu[b], cu[b + 1])
        S = q[rows] @ K[rows].T
        out[rows] = honest_softmax(S) @ V[rows]
    assert int(cu_seqlens[-1]) == q.shape[0]
    return out


def test_honest_softmax_passes():
    x = torch.randn(4, 33)
    torch.testing.assert_close(run(SOFTMAX, honest_softmax, x), torch.softmax(x, -1))


def test_honest_forward_passes():
    Q, K, V = qkv()
    O, LSE = run(FORWARD, honest_forward, Q, K, V)
    P = torch.softmax(_scores(Q, K), -1)
    torch.testing.assert_close(O, P @ V)
    torch.testing.assert_close(LSE, torch.logsumexp(_scores(Q, K), -1))


def test_honest_backward_passes():
    Q, K, V = qkv()
    dO = torch.randn_like(Q)
    got = run(BACKWARD, honest_backward, Q, K, V, dO)
    Qr, Kr, Vr = (t.clone().requires_grad_() for t in (Q, K, V))
    (torch.softmax(_scores(Qr, Kr), -1) @ Vr).backward(dO)
    for g, r in zip(got, (Qr.grad, Kr.grad, Vr.grad), strict=True):
        torch.testing.assert_close(g, r)


def test_honest_cascade_reads_its_offsets():
    q, K, V = (torch.randn(12, 4) for _ in range(3))
    cu = torch.tensor([0, 3, 7, 12], dtype=torch.int32)
    out = run(CASCADE, honest_cascade, q, K, V, cu)
    torch.testing.assert_close(out[3:7], torch.softmax(q[3:7] @ K[3:7].T, -1) @ V[3:7])


def test_checkers_beside_the_candidate_still_work():
    """The grader's own modes (harness.largest_created, harness.ch11.prefix_reads) run above the
    watch's and may read storages; a nested watch works too."""
    from course_utils.grading.harness import largest_created
    from course_utils.grading.harness.ch11 import prefix_reads

    Q, K, V = qkv()
    ex = specs.get(FORWARD)
    with forbid(ex.forbidden, torch_only=ex.torch_only):
        (O, _), largest = largest_created(honest_forward, Q, K, V)
        with forbid(("softmax",), torch_only=True):
            honest_softmax(O)
    assert largest >= 16 * 8
    q, Kp, Vp = torch.randn(6, 4), torch.randn(5, 4), torch.randn(5, 4)
    ex = specs.get(CASCADE)
    with forbid(ex.forbidden, torch_only=ex.torch_only):
        _, reads_K, reads_V = prefix_reads(lambda q, Kp, Vp: honest_softmax(q @ Kp.T) @ Vp,
                                           q, Kp, Vp)
    assert (reads_K, reads_V) == (20, 20)


def test_printing_is_allowed_where_leaving_torch_is():
    """A debug print of a whole tensor in an exercise that is not torch_only: same text as
    torch's own repr, and no tampering reported (torch's repr sets the dispatch modes aside)."""
    x = torch.randn(40, 50)
    text = run(SOFTMAX, lambda t: (repr(t), str(honest_softmax(t)), f"{t}"), x)
    assert text[0] == repr(x) == text[2]


def test_the_watch_leaves_nothing_behind():
    before = (torch._C.DisableTorchFunction, torch.overrides._pop_mode, threading._start_new_thread)
    with contextlib.suppress(ForbiddenCall):
        run(FORWARD, attack_pop_function_mode_and_leave, *qkv())
    assert torch._C._len_torch_function_stack() == 0
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not torch.autograd._profiler_enabled()
    assert (torch._C.DisableTorchFunction, torch.overrides._pop_mode,
            threading._start_new_thread) == before
    run(FORWARD, honest_forward, *qkv())  # and the next call is watched as before


def test_a_profiler_already_running_is_refused():
    from torch.profiler import profile

    with profile(), pytest.raises(ForbiddenCall, match="profiler is already running"):
        run(FORWARD, honest_forward, *qkv())


# ----------------------------------------------------------------------------- attacks

ATTACKS: dict[str, tuple[str, object, str]] = {}  # name -> (exercise, fn(Q, K, V), message part)


def attack(name, exercise, match=""):
    def register(fn):
        ATTACKS[name] = (exercise, fn, match)
        return fn

    return register


OFF = "switched off"
STAY = "stay in torch"
ENGINE = "gradients from the formulas"
ANSWER = "computes the answer itself"


def _aten_softmax(Q, K, V):
    """The ATen operator by its overload: the function mode does not know this name."""
    return torch.ops.aten._softmax.default(_scores(Q, K), -1, False) @ V


# --- switching the watch's levels off around one call --------------------------------------------
@attack("DisableTorchFunction around numpy", FORWARD)
def attack_disable_tf_numpy(Q, K, V):
    with torch._C.DisableTorchFunction():
        return torch.from_numpy(Q.numpy().copy())


@attack("DisableTorchFunction captured before the call, around numpy", FORWARD, OFF)
def attack_captured_disable_tf_numpy(Q, K, V):
    with _captured_disable_tf():
        return torch.from_numpy(Q.numpy().copy())


@attack("DisableTorchFunction captured before the call, around tolist", FORWARD, STAY)
def attack_captured_disable_tf_tolist(Q, K, V):
    with _captured_disable_tf():
        values = Q.tolist()  # no operator reaches the dispatch mode in here
    return torch.tensor(values)


@attack("DisableTorchFunction captured before the call, around backward", BACKWARD, ENGINE)
def attack_captured_disable_tf_backward(Q, K, V):
    Q = Q.clone().requires_grad_()
    loss = (honest_softmax(_scores(Q, K)) @ V).sum()
    seed = torch.ones_like(loss)
    with _captured_disable_tf():
        loss.backward(seed)  # every operator in here is the engine's
    return Q.grad


@attack("DisableTorchFunctionSubclass around backward", BACKWARD)
def attack_disable_tf_subclass_backward(Q, K, V):
    Q = Q.clone().requires_grad_()
    with torch._C.DisableTorchFunctionSubclass():
        (honest_softmax(_scores(Q, K)) @ V).sum().backward()
    return Q.grad


@attack("torch.overrides._pop_mode_temporarily around numpy", FORWARD)
def attack_pop_tf_temporarily(Q, K, V):
    with torch.overrides._pop_mode_temporarily():
        return torch.from_numpy(Q.numpy().copy())


@attack("torch.overrides._pop_mode around numpy", FORWARD)
def attack_pop_tf(Q, K, V):
    mode = torch.overrides._pop_mode()
    try:
        return torch.from_numpy(Q.numpy().copy())
    finally:
        torch.overrides._push_mode(mode)


@attack("torch._C._pop_torch_function_stack around numpy", FORWARD)
def attack_pop_tf_stack(Q, K, V):
    mode = torch._C._pop_torch_function_stack()
    try:
        return torch.from_numpy(Q.numpy().copy())
    finally:
        torch._C._push_on_torch_function_stack(mode)


def attack_pop_function_mode_and_leave(Q, K, V):
    torch._C._get_function_stack_at(0)  # (a harmless look first)
    torch.overrides._pop_mode()
    return Q


attack("the function mode popped and not restored", FORWARD)(attack_pop_function_mode_and_leave)


@attack("torch._C._set_torch_function_state off around numpy", FORWARD)
def attack_tf_state(Q, K, V):
    state = torch._C._get_torch_function_state()
    torch._C._set_torch_function_state(torch._C._TorchFunctionState.ALL_DISABLED)
    try:
        return torch.from_numpy(Q.numpy().copy())
    finally:
        torch._C._set_torch_function_state(state)


@attack("_disable_current_modes around aten._softmax", FORWARD)
def attack_disable_current_modes(Q, K, V):
    with torch.utils._python_dispatch._disable_current_modes():
        return _aten_softmax(Q, K, V)


@attack("python_dispatch._pop_mode_temporarily around aten._softmax", FORWARD)
def attack_pop_dispatch_temporarily(Q, K, V):
    with torch.utils._python_dispatch._pop_mode_temporarily():
        return _aten_softmax(Q, K, V)


@attack("torch._C._pop_torch_dispatch_stack around aten._softmax", FORWARD)
def attack_pop_dispatch_stack(Q, K, V):
    mode = torch._C._pop_torch_dispatch_stack(None)
    try:
        return _aten_softmax(Q, K, V)
    finally:
        torch._C._push_on_torch_dispatch_stack(mode)


@attack("torch._C._unset_dispatch_mode", FORWARD)
def attack_unset_dispatch_mode(Q, K, V):
    torch._C._unset_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)
    return _aten_softmax(Q, K, V)


@attack("_ExcludeDispatchKeyGuard(Python) around aten._softmax", FORWARD)
def attack_exclude_python_key(Q, K, V):
    with torch._C._ExcludeDispatchKeyGuard(PYTHON_KEY):
        return _aten_softmax(Q, K, V)


@attack("_ExcludeDispatchKeyGuard captured before, + DisableTorchFunction, softmax", FORWARD)
def attack_captured_everything_off(Q, K, V):
    with _captured_exclude(PYTHON_KEY), _captured_disable_tf():
        return torch.softmax(_scores(Q, K), -1) @ V


@attack("_ExcludeDispatchKeyGuard captured before, around an allowed op", FORWARD, OFF)
def attack_captured_exclude_allowed_op(Q, K, V):
    S = _scores(Q, K)
    with _captured_exclude(PYTHON_KEY):
        return torch.ops.aten.exp.default(S)  # unseen, harmless: still tampering


@attack("_DisablePythonDispatcher around aten._softmax", FORWARD)
def attack_disable_python_dispatcher(Q, K, V):
    with torch._C._DisablePythonDispatcher():
        return _aten_softmax(Q, K, V)


@attack("_DisableTorchDispatch around aten._softmax", FORWARD)
def attack_disable_torch_dispatch(Q, K, V):
    with torch._C._DisableTorchDispatch():
        return _aten_softmax(Q, K, V)


@attack("OpOverload.redispatch below the Python key", FORWARD)
def attack_redispatch(Q, K, V):
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    return torch.ops.aten._softmax.default.redispatch(keys, _scores(Q, K), -1, False) @ V


@attack("the operator handle's redispatch_boxed", FORWARD)
def attack_redispatch_boxed(Q, K, V):
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    handle = torch.ops.aten._softmax.default._handle
    return handle.redispatch_boxed(keys, _scores(Q, K), -1, False) @ V


@attack("_set_skip_next_torch_function before numpy", FORWARD)
def attack_skip_next_tf(Q, K, V):
    if not hasattr(torch._C, "_set_skip_next_torch_function"):  # torch < 2.12 (the H200's 2.11)
        pytest.skip("this torch has no _set_skip_next_torch_function: nothing to switch off")
    torch._C._set_skip_next_torch_function(True)
    return torch.from_numpy(Q.numpy().copy())


@attack("a custom op whose Python kernel runs aten._softmax", SOFTMAX)
def attack_custom_op(x):
    lib = torch.library.Library("watch_attack", "FRAGMENT")  # noqa: TOR901
    with contextlib.suppress(RuntimeError):
        lib.define("rows(Tensor x) -> Tensor")
    lib.impl("rows", lambda t: torch.ops.aten._softmax.default(t, -1, False), "CPU")
    return torch.ops.watch_attack.rows(x)


class _Sneaky(torch.Tensor):
    """A wrapper subclass whose exp is a softmax of its inner tensor."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args = [a.inner if isinstance(a, _Sneaky) else a for a in args]
        if func is torch.ops.aten.exp.default:
            return torch.ops.aten._softmax.default(args[0], -1, False)
        return func(*args, **(kwargs or {}))


@attack("a custom op in a torch_only exercise", FORWARD, STAY)
def attack_custom_op_torch_only(Q, K, V):
    lib = torch.library.Library("watch_attack", "FRAGMENT")  # noqa: TOR901
    with contextlib.suppress(RuntimeError):
        lib.define("rows_exp(Tensor x) -> Tensor")
    lib.impl("rows_exp", lambda t: t.exp(), "CPU")
    return torch.ops.watch_attack.rows_exp(_scores(Q, K))


@attack("a tensor subclass's __torch_dispatch__ turning exp into softmax", SOFTMAX, "_softmax")
def attack_subclass_dispatch(x):
    return torch.exp(_Sneaky(x))


@attack("a tensor subclass's __torch_dispatch__ in a torch_only exercise", FORWARD, STAY)
def attack_subclass_dispatch_torch_only(Q, K, V):
    return torch.exp(_Sneaky(Q))


@attack("a thread runs softmax (modes are per thread; its exception stays in it)", SOFTMAX)
def attack_thread(x):
    out = []
    t = threading.Thread(target=lambda: out.append(torch.softmax(x, -1)))
    t.start()
    t.join()
    return out[0] if out else x


@attack("a thread pool runs softmax", SOFTMAX)
def attack_thread_pool(x):
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(torch.softmax, x, -1).result()


@attack("a thread in a torch_only exercise", FORWARD, STAY)
def attack_thread_torch_only(Q, K, V):
    out = []
    t = threading.Thread(target=lambda: out.append(Q.numpy().copy()))
    t.start()
    t.join()
    return Q


@attack("the profiler stopped by a reference taken before the call", FORWARD, OFF)
def attack_stop_profiler(Q, K, V):
    _captured_stop_profiler()
    with torch.utils._python_dispatch._disable_current_modes():
        return _aten_softmax(Q, K, V)


@attack("the profiler restarted by references taken before the call", FORWARD, OFF)
def attack_restart_profiler(Q, K, V):
    _captured_stop_profiler()
    _captured_start_profiler(watch._profiler_config())
    return Q


@attack("the profiler stopped through its module", FORWARD, OFF)
def attack_stop_profiler_module(Q, K, V):
    torch.autograd._disable_profiler_legacy()
    return Q


@attack("RecordFunction switched off through its module", FORWARD, OFF)
def attack_record_function_off(Q, K, V):
    torch.autograd._enable_record_function(False)
    return Q


@attack("RecordFunction switched off by a reference taken before the call", FORWARD, OFF)
def attack_captured_record_function_off(Q, K, V):
    _captured_record_function(False)
    return Q


@attack("the course's reference restored from a saved __code__", FORWARD, OFF)
def attack_restore_reference(Q, K, V):
    from course_utils import reference

    reference.attention.__code__ = _SAVED_REFERENCE_CODE
    return reference.attention(Q, K, V)[0].float()


_SAVED_REFERENCE_CODE = __import__("course_utils.reference").reference.attention.__code__


@attack("the reference's private float64 core called directly", FORWARD, ANSWER)
def attack_private_reference(Q, K, V):
    from course_utils import reference

    out = reference._attention64(Q.double(), K.double(), V.double(), None, None)
    return out[0].float()


# --- library routes to the forbidden operation --------------------------------------------------
@attack("torch._refs.softmax (exp / amax / sum in Python)", SOFTMAX, ANSWER)
def attack_refs_softmax(x):
    return torch._refs.softmax(x, -1)


@attack("torch._decomp's _softmax", SOFTMAX, ANSWER)
def attack_decomp_softmax(x):
    from torch._decomp import decompositions

    return decompositions._softmax(x, -1, False)


@attack("torch._refs.special.log_softmax, exponentiated", SOFTMAX, ANSWER)
def attack_refs_log_softmax(x):
    return torch._refs.special.log_softmax(x, -1).exp()


@attack("torch._decomp's SDPA for the CPU", FORWARD, ANSWER)
def attack_decomp_sdpa(Q, K, V):
    from torch._decomp import decompositions

    return decompositions.scaled_dot_product_flash_attention_for_cpu(Q, K, V)[0]


@attack("F.softmin(-S)", SOFTMAX)
def attack_softmin(x):
    return F.softmin(-x, -1)


@attack("torch.jit.trace of softmax", SOFTMAX)
def attack_jit_trace(x):
    return torch.jit.trace(lambda t: torch.softmax(t, -1), x)(x)


@attack("torch.compile of softmax (a generated kernel runs no softmax operator)", SOFTMAX)
def attack_compile(x):
    return torch.compile(lambda t: torch.softmax(t, -1))(x)


@attack("torch.distributions.Categorical(logits=...).probs", SOFTMAX)
def attack_distributions(x):
    return torch.distributions.Categorical(logits=x).probs


@attack("flex_attention", FORWARD)
def attack_flex(Q, K, V):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(Q, K, V)


# --- leaving torch (torch_only) -----------------------------------------------------------------
@attack("Tensor.tolist of a score matrix", FORWARD, STAY)
def attack_tolist(Q, K, V):
    S = _scores(Q, K).tolist()
    return torch.tensor(S)


@attack("a score matrix as fixed-point integers", FORWARD, STAY)
def attack_fixed_point(Q, K, V):
    return torch.tensor((_scores(Q, K) * 2**20).round().long().tolist()) / 2**20


@attack("Tensor.item in a loop", FORWARD, STAY)
def attack_item_loop(Q, K, V):
    S = _scores(Q, K).flatten()
    return torch.tensor([S[i].item() for i in range(S.numel())])


@attack("float() of every element while iterating", FORWARD, STAY)
def attack_iterate(Q, K, V):
    return torch.tensor([float(x) for x in _scores(Q, K).flatten()])


@attack("list(t) of rows, then their values", FORWARD, STAY)
def attack_list_rows(Q, K, V):
    rows = list(_scores(Q, K).reshape(-1, 16))
    return torch.tensor([[float(v) for v in r] for r in rows])


@attack("array.array from a tensor", FORWARD, STAY)
def attack_array(Q, K, V):
    return torch.tensor(array.array("f", _scores(Q, K).flatten()))


@attack("struct.pack of the values", FORWARD, STAY)
def attack_struct(Q, K, V):
    S = _scores(Q, K).flatten()
    return torch.frombuffer(bytearray(struct.pack(f"{S.numel()}f", *S)), dtype=torch.float32)


@attack("printing a whole tensor and parsing it", FORWARD, STAY)
def attack_print(Q, K, V):
    torch.set_printoptions(precision=8, threshold=10**6)
    try:
        return torch.tensor(eval(repr(_scores(Q, K)).removeprefix("tensor(")[:-1]))
    finally:
        torch.set_printoptions(profile="default")


class _Capsule:
    """numpy takes a DLPack capsule only from an object that hands it over."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


@attack("torch.utils.dlpack.to_dlpack", FORWARD, STAY)
def attack_to_dlpack(Q, K, V):
    return torch.from_numpy(np.from_dlpack(_Capsule(torch.utils.dlpack.to_dlpack(Q))).copy())


@attack("Tensor.__dlpack__", FORWARD, STAY)
def attack_dunder_dlpack(Q, K, V):
    capsule = Q.__dlpack__()
    return torch.utils.dlpack.from_dlpack(capsule)


@attack("np.from_dlpack(t)", FORWARD, STAY)
def attack_np_from_dlpack(Q, K, V):
    return torch.from_numpy(np.from_dlpack(Q).copy())


@attack("np.asarray(t)", FORWARD, STAY)
def attack_asarray(Q, K, V):
    return torch.from_numpy(np.asarray(Q).copy())


@attack("TensorBase.numpy called on the base class", FORWARD, STAY)
def attack_base_numpy(Q, K, V):
    return torch.from_numpy(torch._C.TensorBase.numpy(Q).copy())


@attack("untyped_storage bytes", FORWARD, STAY)
def attack_storage_bytes(Q, K, V):
    return torch.frombuffer(bytearray(bytes(Q.untyped_storage())), dtype=torch.float32)


@attack("Tensor.storage().tolist()", FORWARD, STAY)
def attack_typed_storage(Q, K, V):
    return torch.tensor(Q.storage().tolist())


@attack("data_ptr + ctypes", FORWARD, STAY)
def attack_data_ptr(Q, K, V):
    raw = ctypes.string_at(Q.data_ptr(), Q.numel() * 4)
    return torch.frombuffer(bytearray(raw), dtype=torch.float32)


@attack("ctypes reading memory", FORWARD, STAY)
def attack_ctypes(Q, K, V):
    ctypes.string_at(id(Q), 8)
    return Q


@attack("memoryview of the numpy buffer", FORWARD, STAY)
def attack_memoryview(Q, K, V):
    return torch.frombuffer(bytearray(memoryview(Q.numpy())), dtype=torch.float32)


@attack("pickle.dumps(t)", FORWARD, STAY)
def attack_pickle(Q, K, V):
    return pickle.loads(pickle.dumps(Q))


@attack("torch.save to a buffer", FORWARD, STAY)
def attack_torch_save(Q, K, V):
    buffer = io.BytesIO()
    torch.save(Q, buffer)
    return Q


@attack("a tensor subclass's __torch_function__ calling numpy", FORWARD, STAY)
def attack_subclass_function(Q, K, V):
    class Leak(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            args[0].as_subclass(torch.Tensor).numpy()
            return super().__torch_function__(func, types, args, kwargs)

    return (Q.as_subclass(Leak) + 0).as_subclass(torch.Tensor)


@attack("handle_torch_function running the student's function", FORWARD, STAY)
def attack_handle_torch_function(Q, K, V):
    return torch.overrides.handle_torch_function(lambda t: torch.from_numpy(t.numpy()), (Q,), Q)


@attack("os.fork", FORWARD, STAY)
def attack_fork(Q, K, V):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return Q


@attack("a subprocess", FORWARD, STAY)
def attack_subprocess(Q, K, V):
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return Q


# --- gradients from the autograd engine ---------------------------------------------------------
def _loss(Q, K, V):
    return (honest_softmax(_scores(Q, K)) @ V).sum()


def _leaf(t):
    return t.clone().requires_grad_()


@attack("torch.autograd.backward aliased", BACKWARD, ENGINE)
def attack_backward_alias(Q, K, V):
    run_it, Q = torch.autograd.backward, _leaf(Q)
    run_it(_loss(Q, K, V))
    return Q.grad


@attack("Tensor.backward", BACKWARD)
def attack_backward(Q, K, V):
    Q = _leaf(Q)
    _loss(Q, K, V).backward()
    return Q.grad


@attack("torch.autograd.grad", BACKWARD)
def attack_autograd_grad(Q, K, V):
    Q = _leaf(Q)
    return torch.autograd.grad(_loss(Q, K, V), Q)[0]


@attack("torch.autograd.functional.vjp", BACKWARD, ENGINE)
def attack_functional_vjp(Q, K, V):
    return torch.autograd.functional.vjp(lambda q: _loss(q, K, V), Q)[1]


@attack("torch.autograd.functional.jacobian", BACKWARD, ENGINE)
def attack_functional_jacobian(Q, K, V):
    return torch.autograd.functional.jacobian(lambda q: _loss(q, K, V), Q)


@attack("torch.autograd.functional.jacobian, forward mode", BACKWARD)
def attack_functional_jacobian_forward(Q, K, V):
    return torch.autograd.functional.jacobian(lambda q: _loss(q, K, V), Q, vectorize=True,
                                              strategy="forward-mode")


@attack("torch.func.grad", BACKWARD, ENGINE)
def attack_func_grad(Q, K, V):
    return torch.func.grad(lambda q: _loss(q, K, V))(Q)


@attack("torch.func.vjp", BACKWARD, ENGINE)
def attack_func_vjp(Q, K, V):
    _, pullback = torch.func.vjp(lambda q: _loss(q, K, V), Q)
    return pullback(torch.tensor(1.0))[0]


@attack("torch.func.jacrev", BACKWARD, ENGINE)
def attack_func_jacrev(Q, K, V):
    return torch.func.jacrev(lambda q: _loss(q, K, V))(Q)


@attack("torch.func.jvp (forward mode)", BACKWARD)
def attack_func_jvp(Q, K, V):
    return torch.func.jvp(lambda q: _loss(q, K, V), (Q,), (torch.ones_like(Q),))[1]


@attack("torch.func.jacfwd (forward mode)", BACKWARD)
def attack_func_jacfwd(Q, K, V):
    return torch.func.jacfwd(lambda q: _loss(q, K, V))(Q)


@attack("torch.autograd.forward_ad", BACKWARD)
def attack_forward_ad(Q, K, V):
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():
        dual = fwad.make_dual(Q, torch.ones_like(Q))
        return fwad.unpack_dual(_loss(dual, K, V)).tangent


@attack("Variable._execution_engine.run_backward", BACKWARD, ENGINE)
def attack_execution_engine(Q, K, V):
    Q = _leaf(Q)
    loss = _loss(Q, K, V)
    engine = torch.autograd.Variable._execution_engine
    return engine.run_backward((loss,), (torch.ones_like(loss),), False, False, (Q,), False,
                               False)[0]


@attack("a grad_fn node called by hand", BACKWARD, ENGINE)
def attack_grad_fn_call(Q, K, V):
    Q = _leaf(Q)
    S = _scores(Q, K)
    return S.grad_fn(torch.ones_like(S))  # MulBackward / DivBackward, outside the engine


@attack("torch.autograd.graph gradient edge", BACKWARD, ENGINE)
def attack_gradient_edge(Q, K, V):
    Q = _leaf(Q)
    edge = torch.autograd.graph.get_gradient_edge(Q)
    return torch.autograd.grad(_loss(Q, K, V), edge)[0]


@attack("an autograd.Function's backward run by the engine", BACKWARD, ENGINE)
def attack_function_backward(Q, K, V):
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    Q = _leaf(Q)
    Twice.apply(Q).sum().backward()
    return Q.grad


@pytest.mark.parametrize("name", list(ATTACKS))
def test_route_is_caught(name):
    exercise, fn, match = ATTACKS[name]
    args = (torch.randn(4, 16),) if exercise == SOFTMAX else qkv()
    try:
        with pytest.raises(ForbiddenCall, match=match or None):
            run(exercise, fn, *args)
    finally:
        torch.autograd._enable_record_function(True)  # for the next test, whatever happened
    # the watch is gone afterwards, whatever the attack left behind
    assert torch._C._len_torch_function_stack() == 0
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not torch.autograd._profiler_enabled()
    assert not torch._C._is_torch_function_all_disabled()


@attack("a refusal caught by the candidate, then a fallback", SOFTMAX)
def attack_swallowed(x):
    try:
        return torch.softmax(x, -1)
    except Exception:
        return honest_softmax(x)


def test_budget_admits_a_few_values_and_refuses_more():
    x = torch.arange(EXIT_BUDGET, dtype=torch.float32)
    run(FORWARD, lambda: x.tolist())
    with pytest.raises(ForbiddenCall, match=f"at most {EXIT_BUDGET}"):
        run(FORWARD, lambda: (x.tolist(), x[0].item()))


def test_the_attack_list_covers_every_class():
    assert len(ATTACKS) >= 60


@pytest.mark.parametrize("front", ["course_utils.reference", "course_utils.library.serving",
                                   "course_utils.library.ring", "course_utils.library.ulysses"])
def test_every_answer_function_behind_a_front_module_is_in_the_table(front):
    """A module split into parts (ring.py re-exports ring_layouts, ring_pass, ...) keeps every
    public function forbidden: the table must name the module each one is defined in (the
    watch swaps the code of the functions whose ``__module__`` the table names)."""
    import importlib
    import inspect

    from course_utils.grading.watch_rules import _ANSWER_FUNCTIONS

    module = importlib.import_module(front)
    public = [f for name, f in vars(module).items()  # its own and its parts' (front_*.py)
              if not name.startswith("_") and inspect.isfunction(f)
              and (f.__module__ == front or f.__module__.startswith(front + "_"))]
    assert public, front
    missing = sorted({f"{f.__module__}.{f.__name__}" for f in public
                      if f.__module__ not in _ANSWER_FUNCTIONS})
    assert not missing, f"answer functions the watch would not swap: {missing}"
