"""Chapter 12's student-side helpers: the ops its exercises plug into, and the runners that
register, fake-run and compile the student's functions where they live.

The exercises of chapter 12 are neighbours of what the lecture registers (chapter 09's Triton
attention as a ``course::`` op with ``register_fake``, ``register_autograd``, ``opcheck`` and
``torch.compile``), so that their answers are nowhere in the package:

- ``12.varlen_fake``: the fake (meta) function of a *packed* variable-length attention op.
  :func:`make_varlen_op` registers :func:`varlen_attention_reference` (the real implementation,
  given) under a fresh name; :func:`run_varlen_fake` registers the student's fake on it, runs the
  op on fake tensors (any device, any dtype, no memory) and under ``torch.compile(fullgraph=True,
  dynamic=True)``, and returns the outputs' metadata (shapes, strides, dtypes, devices).
- ``12.autograd_registration``: :func:`make_softcap_op` gives the forward of a logit softcap op,
  ``y = c * tanh(x / c)`` with a learnable cap ``c``; :func:`run_softcap_autograd` registers the
  student's ``(setup_context, backward)`` on a fresh copy and returns the gradients, eager and
  compiled, and ``opcheck``'s verdicts.
- ``12.kv_cache_write``: :func:`run_append_kv` calls the student's ``register(name)``, which
  registers a *mutating* op (a decode step's append to a paged KV cache) under a fresh name, and
  returns its schema, what it left in the caches and lengths (eager, strided caches, compiled
  with ``fullgraph=True, dynamic=True``), what it returns on fake tensors, and ``opcheck``'s
  verdicts.
- ``12.no_graph_break``: :func:`run_compiled` compiles the student's function with
  ``fullgraph=True`` and ``dynamic=True``, runs it on several problems, and returns the outputs
  and how many graphs were compiled.

Every op is registered under a fresh name (``course_ex12::softcap_3``, ...): an op name can be
defined only once per process, and a notebook cell that is run again must not collide with the
last run. Compiling uses the ``aot_eager`` backend: Dynamo captures the graph (so a graph break
still fails ``fullgraph=True``), AOTAutograd traces the forward and the backward with fake
tensors (so a wrong fake or an untraceable backward still fails), and nothing is code-generated,
which keeps a compile on a laptop's CPU at a second instead of a minute of C++ compiling.
``12.no_graph_break`` compiles with the ``eager`` backend, Dynamo alone: whether a function
breaks the graph is Dynamo's question, and tracing an attention block with symbolic shapes
through AOTAutograd as well doubles the few seconds it takes on two CPU cores.

The grader's cases (``course_utils.grading.specs.ch12``) call these through ``grader.invoke``: they
run where the candidate lives (the sandboxed worker while grading), take and return data only, and
never see an expected value.
"""

from __future__ import annotations

import itertools
import math

import torch

BACKEND = "aot_eager"  # Dynamo + AOTAutograd, no code generation (see the module's docstring)
GRAPH_BACKEND = "eager"  # 12.no_graph_break: Dynamo alone (graph breaks are Dynamo's to find)
CAP = 30.0  # 12.no_graph_break: scores whose largest |S| passes CAP are softcapped
NAMESPACE = "course_ex12"
_fresh = itertools.count()


def _error_line(exc: BaseException, limit: int = 600) -> str:
    """The exception's type and the first lines of its message (compile errors run long)."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    text = " / ".join(lines[:6])
    return f"{type(exc).__name__}: {text[:limit]}"


def _pair(obj, what):
    if not isinstance(obj, (tuple, list)) or len(obj) != 2 or not all(map(callable, obj)):
        raise TypeError(f"expected the pair {what} of functions, got {type(obj).__name__}")
    return obj


# ============================================================================= 12.varlen_fake


def varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The real implementation of ``varlen_attention``: ``(O, LSE)``, one sequence at a time.

    q ``(Tq, Hq, d)``, k ``(Tk, Hkv, d)``, v ``(Tk, Hkv, dv)`` (packed: sequence b's tokens are
    rows ``cu_seqlens[b]`` to ``cu_seqlens[b + 1]``), any strides; ``cu_seqlens_*`` ``(B + 1,)``
    int32; ``max_seqlen_*`` the longest sequence (a kernel sizes its grid with it; unused here).
    Query head h reads K/V head ``h // (Hq // Hkv)``; every query sees every key of its sequence
    (no mask); scale ``1 / sqrt(d)``.

    Returns O ``(Tq, Hq, dv)`` in q's dtype, contiguous, and LSE ``(Hq, Tq)`` float32,
    contiguous, in natural-log units (``LSE = log sum_j exp(S_j)``, as SDPA returns it; a row with
    no key has LSE = -inf and O = 0).
    """
    Tq, Hq, d = q.shape
    Hkv, dv = k.shape[1], v.shape[2]
    group = Hq // Hkv
    O = torch.zeros(Tq, Hq, dv, dtype=torch.float32, device=q.device)
    LSE = torch.full((Hq, Tq), -math.inf, dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        if cq[b + 1] == cq[b] or ck[b + 1] == ck[b]:
            continue
        Q = q[cq[b]:cq[b + 1]].float().transpose(0, 1)  # (Hq, nq, d)
        K = k[ck[b]:ck[b + 1]].float().transpose(0, 1).repeat_interleave(group, 0)
        V = v[ck[b]:ck[b + 1]].float().transpose(0, 1).repeat_interleave(group, 0)
        S = Q @ K.transpose(1, 2) / math.sqrt(d)  # (Hq, nq, nk)
        LSE[:, cq[b]:cq[b + 1]] = torch.logsumexp(S, dim=-1)
        O[cq[b]:cq[b + 1]] = (torch.softmax(S, dim=-1) @ V).transpose(0, 1)
    return O.to(q.dtype), LSE


def make_varlen_op(fake=None):
    """A fresh custom op ``course_ex12::varlen_attention_<n>`` running the reference.

    ``fake``: the fake function to register (or None, to register it later with
    ``op.register_fake(fn)``). Returns the op (a ``CustomOpDef``: call it like a function).
    """

    def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         max_seqlen_q: int, max_seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k)

    op = torch.library.custom_op(f"{NAMESPACE}::varlen_attention_{next(_fresh)}",
                                 varlen_attention, mutates_args=())
    if fake is not None:
        op.register_fake(fake)
    return op


def _meta(t) -> dict:
    """What a fake tensor promises: shape, strides, dtype, device."""
    if not isinstance(t, torch.Tensor):
        return {"type": type(t).__name__}
    return {"shape": [int(s) for s in t.shape], "stride": [int(s) for s in t.stride()],
            "dtype": str(t.dtype).removeprefix("torch."), "device": str(t.device)}


def _fake_input(desc: dict):
    """A fake tensor from ``{"shape", "stride", "dtype", "device"}`` (inside a FakeTensorMode):
    no memory, so any device works, a GPU's included on a machine without one."""
    return torch.empty_strided(desc["shape"], desc["stride"], device=desc["device"],
                               dtype=getattr(torch, desc["dtype"]))


def run_varlen_fake(fake, problems):
    """Register ``fake`` on a fresh varlen op and run the op on fake tensors.

    ``problems``: a list of dicts with the metadata of ``q``, ``k``, ``v`` (each ``{"shape",
    "stride", "dtype", "device"}``), ``lengths_q``, ``lengths_k`` (the sequence lengths). Returns,
    per problem, ``{"outputs": [meta of each output]}`` or ``{"error": "..."}``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = make_varlen_op(fake)
    found = []
    for p in problems:
        try:
            with FakeTensorMode():
                q, k, v = (_fake_input(p[name]) for name in ("q", "k", "v"))
                device = q.device
                cu_q = torch.empty(len(p["lengths_q"]) + 1, dtype=torch.int32, device=device)
                cu_k = torch.empty(len(p["lengths_k"]) + 1, dtype=torch.int32, device=device)
                out = op(q, k, v, cu_q, cu_k, max(p["lengths_q"]), max(p["lengths_k"]))
            outs = out if isinstance(out, (tuple, list)) else [out]
            found.append({"outputs": [_meta(t) for t in outs]})
        except Exception as exc:  # the fake raised: what and where, for the grader's message
            found.append({"error": _error_line(exc)})
    return found


def run_varlen_compiled(fake, packings, check_op=True):
    """Register ``fake``, then run the op compiled (``fullgraph=True, dynamic=True``) on real
    inputs, one packing after the other (different token counts: one graph should serve all).

    ``packings``: a list of ``(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k)``. Returns ``{"outputs": [(O, LSE), ...], "graphs": n, "opcheck": {test:
    verdict}}`` or ``{"error": "..."}`` if compiling or running failed. ``opcheck`` (on the first
    packing, when ``check_op``) compares the fake with the real outputs: for hints only.
    """
    import torch._dynamo

    torch._dynamo.reset()  # the same code object compiled for an earlier op: trace afresh
    op = make_varlen_op(fake)
    graphs = [0]
    backend = _counting_backend(graphs)

    def attend(q, k, v, cu_q, cu_k, max_q, max_k):
        O, LSE = op(q, k, v, cu_q, cu_k, max_q, max_k)
        return O * 1.0, LSE + 0.0  # an op after it: the fake's metadata feeds the graph

    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend=backend)
    result = {"opcheck": _opcheck(op, packings[0]) if check_op else {}}
    try:
        result["outputs"] = [tuple(compiled(*p)) for p in packings]
    except Exception as exc:
        return dict(result, error=_error_line(exc))
    result["graphs"] = graphs[0]
    return result


def _opcheck(op, args) -> dict:
    """``torch.library.opcheck``'s verdict per test, as strings ("SUCCESS" or the error)."""
    try:
        verdicts = torch.library.opcheck(op, args, raise_exception=False)
    except Exception as exc:
        return {"opcheck": _error_line(exc)}
    return {name: v if isinstance(v, str) else _error_line(v) for name, v in verdicts.items()}


def _counting_backend(graphs, name=BACKEND):
    """The backend ``name``, counting the graphs it is given (a recompile is one more)."""
    from torch._dynamo import lookup_backend

    inner = lookup_backend(name)

    def backend(gm, example_inputs):
        graphs[0] += 1
        return inner(gm, example_inputs)

    return backend


# ========================================================== 12.autograd_registration


def make_softcap_op():
    """A fresh custom op ``course_ex12::softcap_<n>(x, c) -> c * tanh(x / c)``, forward only.

    x: the scores, any shape; c: the cap, a tensor that broadcasts to x (a scalar, or one cap per
    head, ``(H, 1, 1)`` against ``(B, H, N, N)``), learnable. The fake is registered; the
    autograd formula is not (that is the exercise).
    """

    def softcap(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return c * torch.tanh(x / c)

    op = torch.library.custom_op(f"{NAMESPACE}::softcap_{next(_fresh)}", softcap,
                                 mutates_args=())

    @op.register_fake
    def _(x, c):
        return torch.empty_like(x)

    return op


def run_softcap_autograd(pair, x, c, grad_y, compiled_problems, check_op=True):
    """Register ``pair = (setup_context, backward)`` on a fresh softcap op and differentiate it.

    Eager: ``y = op(x, c)``, ``y.backward(grad_y)``. Compiled: for each ``(x, c, grad_y)`` of
    ``compiled_problems``, the same through ``torch.compile(fullgraph=True, dynamic=True)`` (the
    backward is traced by AOTAutograd with fake tensors). Returns ``{"eager": (y, dx, dc),
    "compiled": [(y, dx, dc), ...], "graphs": n, "opcheck": {...}}``; a stage that raised gives
    ``"eager_error"`` or ``"compiled_error"`` instead (after an eager error, nothing else is
    run). A missing gradient comes back as None.
    """
    setup_context, backward = _pair(pair, "(setup_context, backward)")
    op = make_softcap_op()
    op.register_autograd(backward, setup_context=setup_context)

    def differentiate(fn, x, c, grad_y):
        x = x.detach().clone().requires_grad_()
        c = c.detach().clone().requires_grad_()
        y = fn(x, c)
        y.backward(grad_y)
        return y.detach(), x.grad, c.grad

    import torch._dynamo

    torch._dynamo.reset()
    result = {}
    try:
        result["eager"] = differentiate(op, x, c, grad_y)
    except Exception as exc:
        result["eager_error"] = _error_line(exc)
        return result  # nothing past a backward that raises is judged (nor worth its time)
    graphs = [0]
    compiled = torch.compile(lambda x, c: op(x, c) * 1.0, fullgraph=True, dynamic=True,
                             backend=_counting_backend(graphs))
    try:
        result["compiled"] = [differentiate(compiled, *p) for p in compiled_problems]
        result["graphs"] = graphs[0]
    except Exception as exc:
        result["compiled_error"] = _error_line(exc)
    if check_op:
        args = (x.detach().clone().requires_grad_(), c.detach().clone().requires_grad_())
        result["opcheck"] = _opcheck(op, args)
    return result


# ============================================================================= 12.kv_cache_write


def append_problem(B, pages, S, H, d, dtype, seed, *, lengths=None):
    """``(k_cache, v_cache, cache_seqlens, k, v, block_table)``: B sequences with their pages
    in a shuffled pool (``pages`` per sequence), random cache contents, the new tokens, int32
    lengths (``lengths`` or random, each below its capacity), on the course's device."""
    from ...runtime import device

    g = torch.Generator().manual_seed(seed)
    P = B * pages + 1
    table = torch.randperm(P, generator=g)[:B * pages].view(B, pages).to(torch.int32)
    if lengths is None:
        lengths = torch.randint(0, pages * S, (B,), generator=g).tolist()
    dt = getattr(torch, dtype)
    k_cache = torch.randn(P, S, H, d, generator=g).to(dt)
    v_cache = torch.randn(P, S, H, d, generator=g).to(dt)
    k = torch.randn(B, H, d, generator=g).to(dt)
    v = torch.randn(B, H, d, generator=g).to(dt)
    dev = device()
    return tuple(t.to(dev) for t in (k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32),
                                     k, v, table))


def _schema(op) -> str:
    """The op's schema as text (``name(Tensor(a0!) k_cache, ...) -> ()``)."""
    overload = getattr(op, "_opoverload", None)
    return str(overload._schema) if overload is not None else ""


def _append_problem_tensors(p, strided):
    """Fresh copies of a problem's tensors (the grader's stay untouched); with ``strided``, the
    caches are views of a wider buffer: rows 1.. of pages one row longer, every other head (not
    contiguous, and no two of their dims merge: a reshape of them copies)."""
    k_cache, v_cache, seqlens, k, v, table = (t.clone() for t in p)
    if not strided:
        return (k_cache, v_cache, seqlens, k, v, table), None
    P, S, H, d = k_cache.shape
    wide = [torch.zeros(P, S + 1, 2 * H, d, dtype=k_cache.dtype, device=k_cache.device)
            for _ in range(2)]
    views = []
    for buffer, cache in zip(wide, (k_cache, v_cache), strict=True):
        buffer[:, 1:, 1::2] = cache
        views.append(buffer[:, 1:, 1::2])
    return (views[0], views[1], seqlens, k, v, table), wide


def _after(args, wide):
    """What a call left behind: the caches, the lengths, and whether a strided cache's
    neighbouring heads (not part of the view) were written."""
    out = {"k_cache": args[0].clone(), "v_cache": args[1].clone(),
           "cache_seqlens": args[2].clone()}
    if wide is not None:
        out["outside_view"] = any(bool(w[:, :, 0::2].any() or w[:, 0].any()) for w in wide)
    return out


def run_append_kv(register, problems, compiled_problems=(), strided=False, check_op=False):
    """Register the student's op with ``register(name)`` and run it.

    ``problems``, ``compiled_problems``: lists of ``(k_cache, v_cache, cache_seqlens, k, v,
    block_table)``. Returns ``{"schema": text, "fake": what the op returns on fake tensors,
    "eager": [after each call], "compiled": [after each compiled call], "compiled_read":
    [the caches as the compiled function read them after the call], "graphs": n, "opcheck":
    {...}}``; a stage that raised gives ``"register_error"``, ``"eager_error"``, ``"fake_error"``
    or ``"compiled_error"`` instead. ``strided``: the caches of the eager calls are views (rows
    1.. and every other head of a wider buffer). ``after`` holds the caches, the lengths and
    for strided caches ``outside_view`` (a write that landed outside the view).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    result = {}
    try:
        op = register(f"{NAMESPACE}::append_kv_{next(_fresh)}")
        if not callable(op):
            raise TypeError(f"register returned {type(op).__name__}, not the op")
    except Exception as exc:
        return {"register_error": _error_line(exc)}
    result["schema"] = _schema(op)
    try:
        eager = []
        for p in problems:
            args, wide = _append_problem_tensors(p, strided)
            returned = op(*args)
            eager.append(dict(_after(args, wide), returned=type(returned).__name__))
        result["eager"] = eager
    except Exception as exc:
        result["eager_error"] = _error_line(exc)
    try:
        with FakeTensorMode() as mode:
            fake_args = [mode.from_tensor(t) for t in problems[0]]
            returned = op(*fake_args)
        result["fake"] = type(returned).__name__
    except Exception as exc:
        result["fake_error"] = _error_line(exc)
    if compiled_problems:
        import torch._dynamo

        torch._dynamo.reset()
        graphs = [0]

        def step(k_cache, v_cache, cache_seqlens, k, v, block_table):
            op(k_cache, v_cache, cache_seqlens, k, v, block_table)
            return k_cache + 0, v_cache + 0, cache_seqlens + 0  # read after the write

        compiled = torch.compile(step, fullgraph=True, dynamic=True,
                                 backend=_counting_backend(graphs))
        try:
            done, read = [], []
            for p in compiled_problems:
                args, _ = _append_problem_tensors(p, False)
                read.append(list(compiled(*args)))
                done.append(_after(args, None))
            result.update(compiled=done, compiled_read=read, graphs=graphs[0])
        except Exception as exc:
            result["compiled_error"] = _error_line(exc)
    if check_op:
        result["opcheck"] = _opcheck(op, tuple(t.clone() for t in problems[0]))
    return result


# ============================================================================= 12.no_graph_break


def run_compiled(fn, problems):
    """Compile ``fn`` with ``fullgraph=True, dynamic=True`` and run it on each problem.

    ``problems``: a list of argument tuples. Returns ``{"outputs": [...], "graphs": n}``, or
    ``{"error": "..."}`` when Dynamo could not capture ``fn`` in one graph (the graph break's
    reason) or the compiled function raised. ``graphs`` counts the graphs compiled: one when
    ``fn`` is captured once for every shape. ``fn`` is first called once without compiling (on
    copies of the first problem): when that raises, the error is the function's own, not the
    compiler's, and comes back as ``{"error": "...", "eager": True}`` without a compile.
    """
    import torch._dynamo

    try:
        fn(*(a.clone() if isinstance(a, torch.Tensor) else a for a in problems[0]))
    except Exception as exc:
        return {"error": _error_line(exc, limit=900), "eager": True}
    torch._dynamo.reset()  # a function compiled before (same code object) is traced afresh
    graphs = [0]
    compiled = torch.compile(fn, fullgraph=True, dynamic=True,
                             backend=_counting_backend(graphs, GRAPH_BACKEND))
    try:
        outputs = [compiled(*p) for p in problems]
    except Exception as exc:
        return {"error": _error_line(exc, limit=900)}
    return {"outputs": outputs, "graphs": graphs[0]}


def graph_breaks(fn, *args):
    """Where Dynamo breaks ``fn``'s graph: a list of one-line reasons (empty: one graph)."""
    import torch._dynamo

    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    plain = {"generic_jump": "a Python if/assert on a tensor's value",
             "builtin operator": "a builtin (print) that needs a value",
             "skipped": "a function Dynamo does not trace"}
    reasons = []
    for r in explained.break_reasons:
        where = r.user_stack[-1] if r.user_stack else None
        line = f"line {where.lineno}: {where.line.strip()}" if where and where.line else ""
        reason = r.reason.splitlines()[0]
        gloss = next((g for key, g in plain.items() if key in reason), "")
        reasons.append(f"{line}  <- {reason}" + (f" ({gloss})" if gloss else ""))
    return reasons


__all__ = [
    "BACKEND",
    "CAP",
    "GRAPH_BACKEND",
    "graph_breaks",
    "make_softcap_op",
    "make_varlen_op",
    "run_compiled",
    "append_problem",
    "run_append_kv",
    "run_softcap_autograd",
    "run_varlen_compiled",
    "run_varlen_fake",
    "varlen_attention_reference",
]
