"""Chapter 12, the course's kernel inside a model (a custom op under torch.compile): graded
exercises.

The lecture registers chapter 09's Triton attention as a ``course::`` op (``register_fake``,
``register_autograd``, ``opcheck``) and trains a tiny GPT through it under
``torch.compile(fullgraph=True)``. The exercises are neighbours it does not show, judged here, in
the grading process, from raw data the worker sends back (metadata, outputs, gradients): the
worker's own verdicts (``opcheck``'s) only ever add a hint.

- ``12.varlen_fake``: the fake function of a packed variable-length attention op
  ``varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> (O,
  LSE)``. The worker registers it on a fresh op and runs the op on fake tensors (any device and
  dtype, non-contiguous inputs, GQA, dv != d) and compiled with ``dynamic=True``; the metadata
  that comes back is compared with what the real implementation returns, written down here: O
  ``(Tq, Hq, dv)`` contiguous in q's dtype, LSE ``(Hq, Tq)`` float32 contiguous, on q's device.
- ``12.autograd_registration``: ``(setup_context, backward)`` for ``register_autograd`` of a
  softcap op ``y = c * tanh(x / c)`` with a learnable cap ``c`` (a scalar or one per head). The
  gradients that come back, eager and compiled, against float64 autograd of the definition.
- ``12.no_graph_break``: an attention block that breaks the graph (an ``assert`` and an ``if`` on
  a tensor's value, a ``print`` of one) rewritten to compile with ``fullgraph=True, dynamic=True``;
  its compiled outputs on several shapes against a float64 block written here, and one graph for
  every sequence length.
"""

from __future__ import annotations

import itertools
import math
import re

import torch

from ...runtime import device
from ..checks import CheckFailure, Mistake, brief, compare, sequence, validated, whole_number
from ..harness.ch12 import CAP, append_problem
from ..types import Exercise, invoke
from . import require_implemented, returned_dict, returned_text

H = "course_utils.grading.harness.ch12:"


def _add(exercise, name, make, *args, hidden=False, **kwargs):
    """Register the case ``make(name, *args, **kwargs)`` under ``name``."""
    exercise.case(name, hidden=hidden)(make(name, *args, **kwargs))


def _require(candidate):
    """NotImplementedError if the candidate (or any function of a pair) is still a stub."""
    for c in candidate if isinstance(candidate, (tuple, list)) else (candidate,):
        require_implemented(c)


def _opcheck_hint(verdicts) -> str:
    """The tests ``opcheck`` failed, in one line ("" if none or none reported)."""
    if not isinstance(verdicts, dict):
        return ""
    failed = [f"{returned_text(name, 60)}: {returned_text(v, 200)}"
              for name, v in itertools.islice(verdicts.items(), 16)
              if not (isinstance(v, str) and v == "SUCCESS")]  # fmt: skip
    return ("; opcheck says " + " | ".join(failed)) if failed else ""


# ============================================================================= varlen fake

varlen_fake = Exercise(
    "12.varlen_fake", "The fake function of a packed (varlen) attention op", points=3,
)  # fmt: skip

_HV = {
    "empty_like": "torch.empty_like(q) copies q's strides (and q's head dim d): for a transposed "
    "or sliced q that is not the contiguous O the kernel writes. Allocate O with torch.empty("
    "(Tq, Hq, dv), ...): a fresh tensor is contiguous.",
    "gqa": "O has one head per query head: Hq = q.shape[1], not k's Hkv; its last dim is v's "
    "head dim dv = v.shape[2], which need not be d.",
    "lse": "LSE is (Hq, Tq): one row per query head, one column per packed token, float32 "
    "whatever q's dtype (the kernel accumulates in float32), contiguous.",
    "device": "every output lives on q's device: torch.empty(..., device=q.device). A fake that "
    "forgets it makes CPU tensors in a CUDA graph.",
    "data": "a fake function sees no data: Tq is q.shape[0] (a size, symbolic under "
    "dynamic=True), never cu_seqlens_q[-1].item() or max_seqlen_q * B.",
}


def _contiguous_strides(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return list(reversed(strides))


def _desc(shape, dtype, dev, *, order=None):
    """Metadata of a (fake) input: ``order`` permutes the memory layout (e.g. (1, 0, 2): the
    tensor is a transpose of a contiguous (shape[1], shape[0], shape[2]) one)."""
    order = order or tuple(range(len(shape)))
    base = [shape[i] for i in order]
    base_strides = _contiguous_strides(base)
    stride = [0] * len(shape)
    for pos, dim in enumerate(order):
        stride[dim] = base_strides[pos]
    return {"shape": list(shape), "stride": stride, "dtype": dtype, "device": dev}


def _fused_slice(Tq, Hq, Hkv, d, dtype, dev):
    """q, k, v as slices of one fused projection (Tq, Hq + 2 Hkv, d): none is contiguous."""
    width = (Hq + 2 * Hkv) * d
    q = {"shape": [Tq, Hq, d], "stride": [width, d, 1], "dtype": dtype, "device": dev}
    kv = {"shape": [Tq, Hkv, d], "stride": [width, d, 1], "dtype": dtype, "device": dev}
    return q, kv, dict(kv)


def expected_varlen_meta(p):
    """What the real ``varlen_attention`` returns for problem ``p``: [meta of O, meta of LSE]."""
    Tq, Hq, _ = p["q"]["shape"]
    dv = p["v"]["shape"][2]
    return [{"shape": [Tq, Hq, dv], "stride": _contiguous_strides([Tq, Hq, dv]),
             "dtype": p["q"]["dtype"], "device": p["q"]["device"]},
            {"shape": [Hq, Tq], "stride": _contiguous_strides([Hq, Tq]), "dtype": "float32",
             "device": p["q"]["device"]}]  # fmt: skip


def _same_device(a, b):
    """"cuda" and "cuda:0" are one device for a fake tensor."""
    def norm(s):
        return str(s) if ":" in str(s) else f"{s}:0" if str(s) != "cpu" else "cpu"

    return norm(a) == norm(b)


def _checked_meta(got, label, name):
    """One output's metadata as the worker described it, checked before it is compared: a
    dict of a shape and strides (at most 8 whole numbers each), a dtype and a device (short
    strings), or of the ``type`` of something that is not a tensor."""
    got = returned_dict(got, f"the metadata of {name}", label)
    if "shape" not in got:
        return {"type": returned_text(got.get("type"), 80)}
    checked = {}
    for key in ("shape", "stride"):
        values = sequence(got.get(key), what=f"the {key} of {name}", case=label, at_most=8)
        checked[key] = [whole_number(v, what=f"the {key} of {name}", case=label, low=0)
                        for v in values]  # fmt: skip
    if len(checked["stride"]) != len(checked["shape"]):
        raise CheckFailure(label, f"{name} has {len(checked['shape'])} dims but "
                           f"{len(checked['stride'])} strides")  # fmt: skip
    for key in ("dtype", "device"):
        value = got.get(key)
        if not isinstance(value, str) or len(value) > 64:
            raise CheckFailure(label, f"the {key} of {name} is {brief(value)}, not a name")
        checked[key] = value
    return checked


def _meta_problem(got, want):
    """What differs between a fake output's metadata and the real one ("" if nothing), and the
    hint for it."""
    if "shape" not in got:
        return f"is a {got.get('type')}, not a tensor", "return two tensors: O, LSE"
    if got["shape"] != want["shape"]:
        return f"has shape {tuple(got['shape'])}, the real op returns {tuple(want['shape'])}", None
    if got["dtype"] != want["dtype"]:
        return f"has dtype {got['dtype']}, the real op returns {want['dtype']}", None
    if not _same_device(got["device"], want["device"]):
        return f"is on {got['device']}, the real op returns it on {want['device']}", \
            _HV["device"]
    # strides of dims of size 1 say nothing about the layout: ignore them
    bad = [i for i, n in enumerate(want["shape"])
           if n > 1 and got["stride"][i] != want["stride"][i]]
    if bad:
        return (f"has strides {tuple(got['stride'])}, the real op returns a contiguous tensor "
                f"with strides {tuple(want['stride'])}"), None
    return "", None


def _judge_outputs(label, outputs, want, q_desc):
    if not isinstance(outputs, (list, tuple)) or len(outputs) != 2:
        count = len(outputs) if isinstance(outputs, (list, tuple)) else brief(outputs)
        raise CheckFailure(label, f"the fake returned {count} value(s), the op returns 2 "
                           "(O, LSE)", "return O, LSE")
    for name, got, w in zip(("O", "LSE"), outputs, want, strict=True):
        got = _checked_meta(got, label, name)
        problem, hint = _meta_problem(got, w)
        if not problem:
            continue
        if hint is None:
            if name == "LSE":
                hint = _HV["lse"]
            elif got["shape"] == w["shape"] and got["dtype"] == w["dtype"]:
                hint = _HV["empty_like"]
            else:
                hint = _HV["gqa"]
            if name == "O" and got.get("shape") == q_desc["shape"] and got.get("stride") == \
                    q_desc["stride"] and got["shape"] != w["shape"]:
                hint = _HV["empty_like"]
        raise CheckFailure(label, f"{name} {problem}", hint)


def _varlen_case(name, problems, hint):
    """``problems``: metadata dicts of q, k, v and the sequence lengths (fake tensors only)."""

    def run(candidate):
        _require(candidate)
        found = invoke(candidate, H + "run_varlen_fake", problems)
        if not isinstance(found, list) or len(found) != len(problems):
            raise CheckFailure(name, "the harness returned something unexpected", None)
        for p, f in zip(problems, found, strict=True):
            q, k, v = p["q"], p["k"], p["v"]
            label = (f"{name} [q {tuple(q['shape'])} strides {tuple(q['stride'])}, k "
                     f"{tuple(k['shape'])}, v {tuple(v['shape'])}, {q['dtype']} on "
                     f"{q['device']}, lengths {p['lengths_q']}]")
            if not isinstance(f, dict):
                raise CheckFailure(label, "the harness returned something unexpected", None)
            if "error" in f:
                error = returned_text(f["error"], 1000)
                why = _HV["data"] if ("data-dependent" in error.lower() or "item" in error
                                      or "DataDependent" in error) else hint
                raise CheckFailure(label, f"the fake raised {error}", why)
            _judge_outputs(label, f.get("outputs", []), expected_varlen_meta(p), q)

    return run


def _packed(lengths_q, lengths_k, Hq, Hkv, d, dv, dtype="float32", dev="cpu", *, q_order=None,
            kv_order=None):
    Tq, Tk = sum(lengths_q), sum(lengths_k)
    return {"q": _desc([Tq, Hq, d], dtype, dev, order=q_order),
            "k": _desc([Tk, Hkv, d], dtype, dev, order=kv_order),
            "v": _desc([Tk, Hkv, dv], dtype, dev, order=kv_order),
            "lengths_q": list(lengths_q), "lengths_k": list(lengths_k)}  # fmt: skip


def _fused(lengths, Hq, Hkv, d, dtype="float32", dev="cpu"):
    q, k, v = _fused_slice(sum(lengths), Hq, Hkv, d, dtype, dev)
    return {"q": q, "k": k, "v": v, "lengths_q": list(lengths), "lengths_k": list(lengths)}


_DEV = str(device())
_add(varlen_fake, "contiguous q, k, v; Hq = Hkv; dv = d", _varlen_case,
     [_packed([5, 3, 8], [5, 3, 8], 2, 2, 16, 16, dev=_DEV)], _HV["gqa"])
_add(varlen_fake, "GQA (Hq = 4 Hkv) and dv != d", _varlen_case,
     [_packed([4, 9], [12, 9], 8, 2, 16, 32, dev=_DEV)], _HV["gqa"])
_add(varlen_fake, "non-contiguous q: a transpose, and slices of a fused QKV projection",
     _varlen_case, [_packed([6, 2], [6, 2], 4, 2, 16, 16, dev=_DEV, q_order=(1, 0, 2)),
                    _fused([7, 5, 1], 4, 2, 8, dev=_DEV)], _HV["empty_like"])
_add(varlen_fake, "float16 and bfloat16 inputs: LSE stays float32", _varlen_case,
     [_packed([3, 4], [3, 4], 2, 1, 16, 16, "float16", _DEV),
      _packed([5], [11], 4, 4, 32, 32, "bfloat16", _DEV)], _HV["lse"])
_add(varlen_fake, "inputs on a GPU (fake tensors: no GPU needed)", _varlen_case,
     [_packed([3, 6], [4, 6], 2, 2, 16, 16, dev="cuda"),
      _packed([2, 2], [2, 2], 4, 2, 8, 8, "float16", "cuda", kv_order=(1, 0, 2))], _HV["device"])
_add(varlen_fake, "fresh shapes: Hq = 6, Hkv = 3, d = 24, dv = 40, transposed k and v",
     _varlen_case, [_packed([9, 1, 13, 4], [20, 1, 13, 30], 6, 3, 24, 40, "bfloat16", "cuda",
                            q_order=(1, 0, 2), kv_order=(1, 0, 2))], _HV["gqa"], hidden=True)
_add(varlen_fake, "one sequence, multi-query, a fused projection on a GPU", _varlen_case,
     [_fused([17], 8, 1, 64, "float16", "cuda"), _packed([2], [2], 3, 1, 8, 4, dev="cpu")],
     _HV["empty_like"], hidden=True)


def _real_packing(lengths_q, lengths_k, Hq, Hkv, d, dv, seed):
    g = torch.Generator().manual_seed(seed)
    Tq, Tk = sum(lengths_q), sum(lengths_k)
    q = torch.randn(Hq, Tq, d, generator=g).transpose(0, 1)  # a transposed q: not contiguous
    k = torch.randn(Tk, Hkv, d, generator=g)
    v = torch.randn(Tk, Hkv, dv, generator=g)

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    dev = device()
    return (q.to(dev), k.to(dev), v.to(dev), cu(lengths_q).to(dev), cu(lengths_k).to(dev),
            max(lengths_q), max(lengths_k))


def _varlen_compiled_case(name, packings, check_op=False):
    def run(candidate):
        _require(candidate)
        inputs = [_real_packing(*p) for p in packings]
        found = invoke(candidate, H + "run_varlen_compiled", inputs, check_op)
        hints = _opcheck_hint(found.get("opcheck") if isinstance(found, dict) else None)
        if not isinstance(found, dict):
            raise CheckFailure(name, "the harness returned something unexpected", None)
        if "error" in found:
            error = returned_text(found["error"], 1000)
            why = _HV["data"] if "data-dependent" in error.lower() or "item" in error else (
                "under torch.compile the fake runs on fake tensors with symbolic sizes: build "
                "every output from the inputs' sizes (q.shape, v.shape) and dtypes, with no "
                "data and no Python int() of a size")
            raise CheckFailure(name, f"torch.compile(fullgraph=True, dynamic=True) failed: "
                               f"{error}", why + hints)
        outputs = sequence(found.get("outputs"), len(inputs), what="the compiled outputs",
                           case=name)
        for packing, pair in zip(inputs, outputs, strict=True):
            q, v = packing[0], packing[2]
            label = f"{name} [Tq = {q.shape[0]}, Hq = {q.shape[1]}, dv = {v.shape[2]}]"
            O, LSE = sequence(pair, 2, what="the compiled op's result", case=label,
                              hint="return O, LSE")
            for what, t in (("O", O), ("LSE", LSE)):
                if not isinstance(t, torch.Tensor):
                    raise CheckFailure(label, f"{what} is {brief(t)}, not a tensor",
                                       "return O, LSE")
            desc = {"q": {"shape": list(q.shape), "stride": list(q.stride()),
                          "dtype": str(q.dtype).removeprefix("torch."), "device": str(q.device)},
                    "v": {"shape": list(v.shape)}}
            got = [{"shape": list(t.shape), "stride": list(t.stride()),
                    "dtype": str(t.dtype).removeprefix("torch."), "device": str(t.device)}
                   for t in (O, LSE)]
            _judge_outputs(label, got, expected_varlen_meta(desc), desc["q"])
        if found.get("graphs") != 1:
            raise CheckFailure(name, f"{brief(found.get('graphs'))} graphs were compiled for "
                               f"{len(inputs)} packings: the fake specialised on a size",
                               "use the sizes as they are (q.shape[0], ...), never int() of "
                               "them or a Python branch on them" + hints)

    return run


_add(varlen_fake, "torch.compile(fullgraph=True, dynamic=True): two packings, one graph",
     _varlen_compiled_case,
     [([5, 4], [5, 6], 4, 2, 16, 8, 0), ([2, 7, 4], [9, 7, 1], 4, 2, 16, 8, 1)], check_op=True)

# ============================================================================= autograd

autograd_registration = Exercise(
    "12.autograd_registration", "register_autograd for a softcap op with a learnable cap",
    points=4,
)  # fmt: skip

_HA = {
    "dx": "dy/dx = 1 - tanh(x / c)^2: the c in front and the 1/c of the chain rule cancel.",
    "dc": "c appears twice: dy/dc = tanh(x / c) + c (1 - tanh(x / c)^2) (-x / c^2) = t - (x / c)"
    " (1 - t^2) with t = tanh(x / c). Sum it over the elements that share one cap.",
    "none": "backward must return one gradient per input of the op, (grad_x, grad_c): c is a "
    "tensor that requires grad (a learnable cap), so its gradient cannot be None.",
    "compiled": "under torch.compile, AOTAutograd traces backward with fake tensors: no .item(), "
    "float(c), numpy or Python branches on values; keep everything as tensor operations. Save "
    "tensors with ctx.save_for_backward in setup_context.",
    "shape": "a gradient has its input's shape: grad_c like c (sum over the broadcast dims, e.g. "
    ".sum_to_size(c.shape)).",
}


def softcap_gradients(x, c, grad_y):
    """float64 ``(y, dx, dc)`` of ``y = c tanh(x / c)`` by autograd of the definition."""
    x64 = x.detach().double().requires_grad_()
    c64 = c.detach().double().requires_grad_()
    y = c64 * torch.tanh(x64 / c64)
    dx, dc = torch.autograd.grad(y, (x64, c64), grad_y.double())
    return y.detach(), dx, dc


def _softcap_problem(shape, caps, std, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * std).to(device())
    c = torch.tensor(caps, dtype=torch.float32)
    if c.dim() == 1:  # one cap per head: (H, 1, 1) against (B, H, N, N)
        c = c.view(-1, 1, 1)
    grad_y = torch.randn(*shape, generator=g).to(device())
    return x, c.to(device()), grad_y


def _grad_tol(expected):
    scale = max(1.0, float(expected.abs().max()))
    return 2e-5 * scale, 2e-5


def _judge_gradients(label, got, problem, stage):
    x, c, grad_y = problem
    y_ref, dx_ref, dc_ref = softcap_gradients(x, c, grad_y)
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        raise CheckFailure(label, "the harness returned something unexpected", None)
    y, dx, dc = got
    compare("y", y, y_ref, case=label, atol=2e-5 * max(1.0, float(y_ref.abs().max())),
            rtol=2e-5, hint="the forward is given: did the op change?")
    if dx is None:
        raise CheckFailure(label, f"{stage}: x.grad is None", _HA["none"])
    atol, rtol = _grad_tol(dx_ref)
    compare("x.grad", dx, dx_ref, case=f"{label}, {stage}", atol=atol, rtol=rtol,
            hint=_HA["dx"])
    if dc is None:
        raise CheckFailure(label, f"{stage}: c.grad is None", _HA["none"])
    if not isinstance(dc, torch.Tensor):
        raise CheckFailure(label, f"{stage}: c.grad is {brief(dc)}, not a tensor", _HA["shape"])
    if tuple(dc.shape) != tuple(c.shape):
        raise CheckFailure(label, f"{stage}: c.grad has shape {tuple(dc.shape)}, c "
                           f"{tuple(c.shape)}", _HA["shape"])
    atol, rtol = _grad_tol(dc_ref)
    atol *= math.sqrt(x.numel() / c.numel())  # a sum of many float32 terms
    compare("c.grad", dc, dc_ref, case=f"{label}, {stage}", atol=atol, rtol=rtol,
            hint=_HA["dc"])


def _autograd_case(name, eager, compiled=(), check_op=False):
    """``eager``: (shape, caps, std, seed) of the eager problem; ``compiled``: problems run
    through torch.compile (several shapes: one graph must serve them all)."""

    def run(candidate):
        _require(candidate)
        if not isinstance(candidate, (tuple, list)) or len(candidate) != 2:
            raise CheckFailure(name, f"got {type(candidate).__name__}, not the pair of functions",
                               "grader.check('12.autograd_registration', (setup_context, "
                               "backward))")
        problem = _softcap_problem(*eager)
        problems = [_softcap_problem(*p) for p in compiled]
        found = invoke(_whole(candidate), H + "run_softcap_autograd", *problem, problems,
                       check_op)
        if not isinstance(found, dict):
            raise CheckFailure(name, "the harness returned something unexpected", None)
        hints = _opcheck_hint(found.get("opcheck"))
        x, c = problem[0], problem[1]
        label = f"{name} [x {tuple(x.shape)}, c {tuple(c.shape)}]"
        try:
            if "eager_error" in found:
                error = returned_text(found["eager_error"], 1000)
                raise CheckFailure(label, f"y.backward() raised {error}",
                                   _HA["none"] if "expected" in error
                                   else _HA["shape"] if "shape" in error else None)
            _judge_gradients(label, found.get("eager"), problem, "eager")
            if "compiled_error" in found:
                raise CheckFailure(label, "torch.compile(fullgraph=True, dynamic=True): "
                                   f"{returned_text(found['compiled_error'], 1000)}",
                                   _HA["compiled"])
            results = sequence(found.get("compiled", []), len(problems),
                               what="the compiled results", case=label)
            for p, got in zip(problems, results, strict=True):
                shape = (f"{name} [compiled: x {tuple(p[0].shape)}, c {tuple(p[1].shape)}]")
                _judge_gradients(shape, got, p, "compiled")
            if problems and found.get("graphs") != 1:
                raise CheckFailure(label, f"{brief(found.get('graphs'))} graphs compiled for "
                                   f"{len(problems)} shapes", _HA["compiled"])
        except CheckFailure as failure:
            failure.hint = (failure.hint or "") + hints
            raise

    return run


def _whole(pair):
    """One candidate for the whole pair, so that a harness helper receives both functions.

    ``grader.check`` gives a case one candidate per item of a tuple; ``register_autograd``
    needs the two functions together, in the process where they live.
    """
    from ..types import LocalCandidate

    first = pair[0]
    if isinstance(first, LocalCandidate):  # of the pair's own kind (a test's stand-in, say)
        return type(first)(tuple(c.obj for c in pair), first.forbidden, first.torch_only)
    from ..sandbox import RemoteCandidate

    if isinstance(first, RemoteCandidate):
        return RemoteCandidate(first.worker, tuple(first.path[:-1]), first.exercise)
    return tuple(pair)


_add(autograd_registration, "a scalar cap, some scores past it (opcheck run too)",
     _autograd_case, ((3, 5, 7), 8.0, 10.0, 0), check_op=True)
_add(autograd_registration, "one cap per head: c (H, 1, 1) against S (B, H, N, N)",
     _autograd_case, ((2, 3, 6, 6), [5.0, 20.0, 50.0], 15.0, 1))
_add(autograd_registration, "compiled (fullgraph=True, dynamic=True), two sequence lengths",
     _autograd_case, ((4, 4), 3.0, 4.0, 2),
     [((3, 2, 5, 5), [4.0, 9.0], 8.0, 3), ((2, 2, 11, 11), [4.0, 9.0], 8.0, 4)])
_add(autograd_registration, "fresh shapes, a small cap (saturated tanh), compiled",
     _autograd_case, ((2, 4, 9, 9), [0.5, 1.0, 2.0, 30.0], 6.0, 5),
     [((2, 4, 3, 3), [0.5, 1.0, 2.0, 30.0], 6.0, 6),
      ((3, 4, 13, 13), [0.7, 1.5, 3.0, 20.0], 6.0, 7)], hidden=True)
_add(autograd_registration, "a scalar cap, a large tensor", _autograd_case,
     ((4, 2, 33, 33), 50.0, 40.0, 8), hidden=True)

# ============================================================================= no graph break

no_graph_break = Exercise(
    "12.no_graph_break", "An attention block that compiles with fullgraph=True", points=3,
)  # fmt: skip

_HG = {
    "print": "print() of a tensor needs its value while Dynamo only traces: remove the print "
    "(or print outside the compiled function).",
    "branch": "Python `if` and `assert` on a tensor's value need that value while tracing: "
    "compute both sides and choose with torch.where(condition, capped, S); drop the assert (or "
    "check outside the compiled function).",
    "skipped": "that function cannot be traced: keep timing and logging outside the compiled "
    "function.",
    "cap": "the cap is global: softcap every score when the largest |S| of the whole batch "
    "passes CAP, none otherwise (torch.where on that one condition). Softcapping always changes "
    "scores below CAP too.",
    "mask": "query i of sequence b sees keys j <= i with j < lengths[b] (the rest is padding).",
    "graphs": "one graph should serve every sequence length under dynamic=True: no Python int() "
    "of a size, no Python branch on a size, no loop whose length is a size. (The cases avoid "
    "sizes of 1 and sizes that coincide, which Dynamo specialises on by itself.)",
}


def block_reference(x, W_qkv, W_o, lengths, n_heads, *, capped=None):
    """float64 output of the attention block, one (sequence, head) at a time.

    Per sequence b and head h: S = q k^T / sqrt(d) (q, k, v: columns h d .. (h + 1) d of the
    three thirds of x W_qkv); if the largest |S| of the whole batch passes CAP, every score is
    softcapped, S <- CAP tanh(S / CAP); query i sees the keys j <= i with j < lengths[b]; O =
    softmax(S) V; the heads side by side, then O W_o. ``capped`` True or False forces the cap on
    or off (to name a slip in a hint).
    """
    x, W_qkv, W_o = (t.detach().double() for t in (x, W_qkv, W_o))
    B, N, D = x.shape
    d = D // n_heads
    proj = x @ W_qkv
    q, k, v = proj[..., :D], proj[..., D:2 * D], proj[..., 2 * D:]
    scores = {}
    for b in range(B):
        for h in range(n_heads):
            cols = slice(h * d, (h + 1) * d)
            scores[b, h] = q[b, :, cols] @ k[b, :, cols].T / math.sqrt(d)
    if capped is None:
        capped = max(float(S.abs().max()) for S in scores.values()) > CAP
    out = torch.zeros(B, N, D, dtype=torch.float64, device=x.device)
    for (b, h), S in scores.items():
        if capped:
            S = CAP * torch.tanh(S / CAP)
        n = int(lengths[b])
        for i in range(N):
            seen = min(i + 1, n)
            w = torch.exp(S[i, :seen] - S[i, :seen].max())
            out[b, i, h * d:(h + 1) * d] = (w / w.sum()) @ v[b, :seen, h * d:(h + 1) * d]
    return out @ W_o


def block_problem(B, N, D, n_heads, lengths, std, seed):
    """``(x, W_qkv, W_o, lengths, n_heads)`` with scores of about ``std`` (float32)."""
    g = torch.Generator().manual_seed(seed)
    d = D // n_heads
    x = torch.randn(B, N, D, generator=g)
    W_qkv = torch.randn(D, 3 * D, generator=g) / math.sqrt(D)
    W_qkv[:, :D] *= math.sqrt(std * math.sqrt(d))  # q and k scaled: |S| of about std
    W_qkv[:, D:2 * D] *= math.sqrt(std * math.sqrt(d))
    W_o = torch.randn(D, D, generator=g) / math.sqrt(D)
    dev = device()
    return (x.to(dev), W_qkv.to(dev), W_o.to(dev), torch.tensor(lengths, device=dev), n_heads)


def _graph_case(name, problems, hint):
    """``problems``: ``(B, N, D, n_heads, lengths, std, seed)`` rows, run by one compiled
    function one after the other."""

    def run(candidate):
        _require(candidate)
        inputs = [block_problem(*p) for p in problems]
        found = invoke(candidate, H + "run_compiled", inputs)
        if not isinstance(found, dict):
            raise CheckFailure(name, "the harness returned something unexpected", None)
        if "error" in found and found.get("eager"):
            raise CheckFailure(name, "called without torch.compile (on the first shape), the "
                               f"block raised {returned_text(found['error'], 1000)}", hint)
        if "error" in found:
            error = returned_text(found["error"], 1000)
            why = (_HG["print"] if "builtin operator" in error or "print" in error
                   else _HG["branch"] if "branching" in error.lower() or "data-dependent" in
                   error.lower() else _HG["skipped"] if "skipped" in error else hint)
            raise CheckFailure(name, f"torch.compile(fullgraph=True, dynamic=True) failed: "
                               f"{error}", why)
        outputs = sequence(found.get("outputs", []), len(problems), what="the compiled outputs",
                           case=name)
        for p, args, out in zip(problems, inputs, outputs, strict=True):
            B, N, D, n_heads, lengths, std, _ = p
            expected = block_reference(*args)
            peak = max(float((args[0].double() @ args[1].double()).abs().max()), 1.0)
            label = (f"{name} [B={B}, N={N}, D={D}, heads={n_heads}, lengths {lengths}, "
                     f"scores of std {std:g}]")
            atol = 2e-5 * max(1.0, float(expected.abs().max())) * max(1.0, peak / 10)
            out = validated(out, expected.shape, what="out", case=label)  # before the hint
            try:
                compare("out", out, expected, case=label, atol=atol, rtol=1e-4,
                        dtype=torch.float32, hint=hint)
            except CheckFailure as failure:
                failure.hint = _block_hint(out, args, atol) or hint
                raise
        if found.get("graphs") != 1:
            raise CheckFailure(name, f"{brief(found.get('graphs'))} graphs were compiled for "
                               f"{len(problems)} shapes (sequence lengths "
                               f"{[p[1] for p in problems]})", _HG["graphs"])

    return run


def _block_hint(out, args, atol):
    """Name the slip when the output matches the block with the cap always or never on."""
    out = out.double()
    for capped in (True, False):
        alt = block_reference(*args, capped=capped)
        if bool(((out - alt).abs() <= atol + 1e-4 * alt.abs()).all()):
            return _HG["cap"]
    return ""


_add(no_graph_break, "two sequence lengths, one graph (scores below CAP)", _graph_case,
     [(3, 5, 16, 2, [5, 3, 2], 2.0, 0), (2, 9, 16, 2, [9, 4], 2.0, 1)], _HG["mask"])
_add(no_graph_break, "the cap on in one call, off in the next (one graph)", _graph_case,
     [(3, 6, 16, 2, [6, 6, 4], 60.0, 2), (2, 6, 16, 2, [2, 6], 1.0, 3),
      (2, 12, 16, 2, [10, 12], 45.0, 4)], _HG["cap"])
_add(no_graph_break, "fresh shapes: 4 heads, D = 32, lengths down to 1", _graph_case,
     [(3, 7, 32, 4, [7, 1, 4], 3.0, 5), (3, 13, 32, 4, [2, 13, 9], 50.0, 6),
      (2, 3, 32, 4, [3, 2], 0.5, 7)], _HG["mask"], hidden=True)

# ============================================================================= kv cache write

kv_cache_write = Exercise(
    "12.kv_cache_write", "A mutating custom op: a decode step's append to a paged KV cache",
    points=3,
)  # fmt: skip

MUTATED = ("k_cache", "v_cache", "cache_seqlens")  # what the op writes, in its argument order
ARGUMENTS = ("k_cache", "v_cache", "cache_seqlens", "k", "v", "block_table")

_HK = {
    "undeclared": "declare every tensor the op writes: torch.library.custom_op(name, fn, "
    "mutates_args=(...)) with the names of the arguments it changes in place. An op declared "
    "pure that returns nothing is, to the compiler, a call with no effect: it may drop it (the "
    "compiled call below wrote nothing), reorder a read of the cache before it, or reuse a "
    "value read earlier.",
    "seqlens": "cache_seqlens grows by one in place too (cache_seqlens += 1): it is mutated, so "
    "it belongs in mutates_args with the caches. A mutation the schema does not declare is "
    "invisible to the compiler (opcheck's test_schema names it).",
    "extra": "declare only what the op writes: an argument it only reads, declared mutated, "
    "makes the compiler copy it back after every call and forbids reusing it.",
    "fake": "a mutating op that returns nothing has a fake that returns nothing (None): the "
    "compiler learns about the writes from the schema, and the fake only checks metadata. A "
    "fake that returns a tensor (even an input) promises an output the op does not have.",
    "returns": "the op returns nothing (annotate `-> None`): its effect is the write. Returning "
    "a cache would make an output that aliases an input, which custom_op refuses.",
    "register": "custom_op reads the schema from the type hints: annotate every argument "
    "torch.Tensor and the return `-> None`, and pass the name you were given.",
    "arith": "token b goes to position pos = cache_seqlens[b] of sequence b: logical page "
    "pos // page_size, which is physical page block_table[b, pos // page_size], row "
    "pos % page_size. Write it there, then add one to cache_seqlens[b].",
    "copy": "the caches here are views (part of each page, every other head of a wider buffer): "
    ".reshape, .flatten or .contiguous() of a view makes a COPY, and writing into the copy "
    "leaves the cache as it was. Index the cache itself (k_cache[page, row] = k) or use a view "
    "that shares its memory.",
    "graphs": "one graph should serve every batch size under dynamic=True: the compiler traces "
    "the fake (never the op's body) with symbolic sizes, so the fake must not take int() of a "
    "size, branch on one, or read a value.",
}


def append_kv_reference(k_cache, v_cache, cache_seqlens, k, v, block_table, *, variant=None):
    """What the op leaves behind: new ``(k_cache, v_cache, cache_seqlens)``, token by token.

    ``variant`` models a slip (to name it in a hint): "swapped" (page from pos % page_size, row
    from pos // page_size), "logical" (the logical page, no block table), "after" (written at
    the incremented length), "no_increment".
    """
    kc, vc, lengths = k_cache.clone(), v_cache.clone(), cache_seqlens.clone()
    S = k_cache.shape[1]
    for b, pos in enumerate(cache_seqlens.tolist()):
        if variant == "after":
            pos += 1
        logical, row = (pos % S, pos // S) if variant == "swapped" else (pos // S, pos % S)
        if not (0 <= logical < block_table.shape[1] and 0 <= row < S):
            return None  # the slip indexes outside the table: it cannot be this one
        page = logical if variant == "logical" else int(block_table[b, logical])
        if not 0 <= page < kc.shape[0]:
            return None  # the slip indexes outside the cache: it cannot be this one
        kc[page, row] = k[b]
        if variant != "k_only":
            vc[page, row] = v[b]
    if variant != "no_increment":
        lengths += 1
    return kc, vc, lengths


def _mutated_in_schema(schema):
    """The argument names the schema marks as written (``Tensor(a0!) k_cache``)."""
    return re.findall(r"Tensor\([a-z0-9]+!\)\??\s+(\w+)", schema)


_SLIPS = (("swapped", "page and row swapped", "arith"),
          ("logical", "the logical page, not block_table's", "arith"),
          ("after", "written at cache_seqlens + 1", "arith"))


def _judge_after(label, after, problem, stage):
    """One call's leftovers against the definition, naming a modelled slip."""
    after = returned_dict(after, f"what the {stage} call left", label,
                          ("k_cache", "v_cache", "cache_seqlens"))
    want = append_kv_reference(*problem)
    if after.get("outside_view") is True:
        raise CheckFailure(label, f"{stage}: the op wrote outside the cache view (into rows or "
                           "heads of the buffer that the view does not hold)", _HK["copy"])
    for name, got, w in zip(("k_cache", "v_cache"), (after["k_cache"], after["v_cache"]),
                            want[:2], strict=True):
        unchanged = problem[0 if name == "k_cache" else 1]
        mistakes = [(Mistake("nothing written", _HK["copy"] if stage == "eager, strided caches"
                             else _HK["undeclared"] if stage == "compiled" else _HK["arith"]),
                     unchanged)]
        for variant, what, hint in _SLIPS:
            wrong = append_kv_reference(*problem, variant=variant)
            if wrong is not None:
                mistakes.append((Mistake(what, _HK[hint]), wrong[0 if name == "k_cache" else 1]))
        compare(f"{name} after the {stage} call", got, w, case=label, atol=0.0, rtol=0.0,
                dtype=w.dtype, hint=_HK["arith"], mistakes=mistakes)
    lengths = after["cache_seqlens"]
    if not isinstance(lengths, torch.Tensor) or lengths.shape != want[2].shape:
        raise CheckFailure(label, f"cache_seqlens after the {stage} call is {brief(lengths)}",
                           _HK["arith"])
    if torch.equal(lengths.cpu().long(), problem[2].cpu().long()):
        raise CheckFailure(label, f"{stage}: cache_seqlens did not change",
                           _HK["undeclared"] if stage == "compiled" else _HK["seqlens"])
    compare(f"cache_seqlens after the {stage} call", lengths, want[2], case=label, atol=0.0,
            rtol=0.0, dtype=torch.int32, hint=_HK["arith"])


def _append_case(name, problems, compiled=(), strided=False, check_op=False):
    """``problems``/``compiled``: rows of :func:`append_problem`'s arguments; eager calls (on
    strided caches with ``strided``), then calls of one compiled function."""

    def run(candidate):
        _require(candidate)
        eager_inputs = [append_problem(*p[:-1], **p[-1]) for p in problems]
        compiled_inputs = [append_problem(*p[:-1], **p[-1]) for p in compiled]
        found = invoke(candidate, H + "run_append_kv", eager_inputs, compiled_inputs, strided,
                       check_op)
        found = returned_dict(found, "what the harness returned", name)
        hints = _opcheck_hint(found.get("opcheck"))
        label = name
        try:
            if "register_error" in found:
                raise CheckFailure(label, "registering the op failed: "
                                   f"{returned_text(found['register_error'], 800)}",
                                   _HK["register"])
            if "eager_error" in found:
                if returned_text(found["eager_error"], 800).startswith("NotImplementedError"):
                    raise NotImplementedError(returned_text(found["eager_error"], 300))
                error = returned_text(found["eager_error"], 800)
                raise CheckFailure(label, f"calling the op raised {error}",
                                   _HK["returns"] if "alias" in error else _HK["arith"])
            stage = "eager, strided caches" if strided else "eager"
            eager = sequence(found.get("eager"), len(eager_inputs), what="the eager results",
                             case=label)
            for p, got in zip(eager_inputs, eager, strict=True):
                B, S = p[3].shape[0], p[0].shape[1]
                shape_label = (f"{name} [B = {B}, page_size = {S}, cache_seqlens "
                               f"{p[2].tolist()}]")
                got = returned_dict(got, "what the eager call left", shape_label)
                if not (isinstance(got.get("returned"), str) and got["returned"] == "NoneType"):
                    raise CheckFailure(shape_label, f"the op returned a "
                                       f"{returned_text(got.get('returned'), 40)}",
                                       _HK["returns"])
                _judge_after(shape_label, got, p, stage)
            schema = returned_text(found.get("schema"), 600)
            mutated = set(_mutated_in_schema(schema))
            if not mutated:
                raise CheckFailure(label, f"the schema declares no mutation: {schema}",
                                   _HK["undeclared"])
            missing = [a for a in MUTATED if a not in mutated]
            if missing:
                raise CheckFailure(label, f"the schema does not declare {', '.join(missing)} as "
                                   f"mutated: {schema}", _HK["seqlens"] if missing ==
                                   ["cache_seqlens"] else _HK["undeclared"])
            extra = sorted(mutated - set(MUTATED))
            if extra:
                raise CheckFailure(label, f"the schema declares {', '.join(extra)} as mutated, "
                                   f"but the op only reads it: {schema}", _HK["extra"])
            if not schema.rstrip().endswith("-> ()"):
                raise CheckFailure(label, f"the op returns something: {schema}", _HK["returns"])
            if "fake_error" in found:
                error = returned_text(found["fake_error"], 600)
                raise CheckFailure(label, f"the op on fake tensors raised {error}",
                                   _HK["fake"] if "return None" in error else
                                   "a fake sees no data: check shapes and dtypes only")
            if not (isinstance(found.get("fake"), str) and found["fake"] == "NoneType"):
                raise CheckFailure(label, "on fake tensors the op returned a "
                                   f"{returned_text(found.get('fake'), 40)}", _HK["fake"])
            if not compiled_inputs:
                return
            if "compiled_error" in found:
                error = returned_text(found["compiled_error"], 800)
                raise CheckFailure(label, f"torch.compile(fullgraph=True, dynamic=True): {error}",
                                   _HK["fake"] if "return None" in error or "fake tensor" in
                                   error else _HK["graphs"])
            done = sequence(found.get("compiled"), len(compiled_inputs),
                            what="the compiled results", case=label)
            for p, got in zip(compiled_inputs, done, strict=True):
                shape_label = f"{name} [compiled, B = {p[3].shape[0]}]"
                _judge_after(shape_label, got, p, "compiled")
            graphs = found.get("graphs")
            if not (isinstance(graphs, int) and graphs == 1):
                raise CheckFailure(label, f"{brief(graphs)} graphs compiled for "
                                   f"{len(compiled_inputs)} batch sizes", _HK["graphs"])
        except CheckFailure as failure:
            failure.hint = (failure.hint or "") + hints
            raise

    return run


_F32 = "float32"
_add(kv_cache_write, "three sequences, pages out of order, one at a page boundary (eager, "
     "schema, fake; opcheck run too)", _append_case,
     [(3, 3, 4, 2, 8, _F32, 0, {"lengths": [5, 8, 0]})], check_op=True)
_add(kv_cache_write, "torch.compile(fullgraph=True, dynamic=True): two batch sizes, one graph",
     _append_case, [(2, 2, 4, 1, 8, _F32, 1, {})],
     [(3, 2, 8, 2, 8, _F32, 2, {}), (5, 2, 8, 2, 8, _F32, 3, {})])
_add(kv_cache_write, "caches that are views of a wider buffer (part of each page, every other "
     "head), bfloat16",
     _append_case, [(4, 3, 8, 2, 16, "bfloat16", 4, {}), (1, 1, 16, 1, 8, _F32, 5,
                                                        {"lengths": [15]})],
     strided=True, hidden=True)
_add(kv_cache_write, "fresh shapes compiled: page_size 16, 4 heads, lengths at page ends",
     _append_case, [(6, 2, 16, 4, 16, _F32, 6, {"lengths": [15, 16, 31, 0, 1, 17]})],
     [(6, 3, 16, 4, 16, _F32, 7, {"lengths": [15, 16, 47, 0, 1, 33]}),
      (9, 3, 16, 4, 16, _F32, 8, {})], hidden=True)  # B never equal to another size


__all__ = [
    "append_kv_reference",
    "autograd_registration",
    "block_problem",
    "block_reference",
    "expected_varlen_meta",
    "kv_cache_write",
    "no_graph_break",
    "softcap_gradients",
    "varlen_fake",
]
