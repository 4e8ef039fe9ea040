"""Chapter 14, Hopper: the consumer's overlapped loop.

- ``14.consumer_loop``: ``consumer_loop(n_tiles, stages)`` returns one consumer warpgroup's loop
  over ``n_tiles`` key tiles as a list of operations (the vocabulary of
  :mod:`course_utils.library.hopper_pipeline`: waits on the full barriers with their parities,
  ``wgmma.fence``, issue S or P V, commit, wait on the group, release a buffer, softmax, rescale,
  pack P), for a ring of ``stages`` buffers.

  On the CPU the grading process runs the list on the model of the asynchronous tensor core
  (``hopper_pipeline.run_consumer``): against a producer that races ahead and one that fills a
  buffer only when asked, with the products landing as late as allowed and at random legal
  moments. It refuses a register read before its product landed, a register written under a
  product, a buffer released under a product, a wrong parity (deadlock or a stale tile), a
  missing fence; it measures the overlap (every softmax but one must run with a product in
  flight), and compares O and LSE, carried through the model with real numbers (P rounded to
  bf16), with float64 attention. On an H100 the list is generated into chapter 14's kernel in
  place of variant 2's loop, built with the watchdog, compared with float64 and timed against
  variant 0 (median of 5 interleaved rounds).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from ... import paths
from ...library import hopper_pipeline as hp
from ...runtime import on_gpu
from ..checks import CheckFailure, compare
from ..types import Exercise
from . import require_implemented

__all__ = ["consumer_loop"]

consumer_loop = Exercise(
    "14.consumer_loop", "One consumer's overlapped loop on the asynchronous tensor core", points=5,
)  # fmt: skip

BLOCK_N, ROWS, D = 8, 8, 16  # the model's tile sizes: small, the ordering is what is graded
MIN_LENGTH, PER_TILE = 40, 40  # a list longer than MIN_LENGTH + PER_TILE * n_tiles is refused
REREAD = " (Reread lecture 14, sections 4 and 5.)"
HINTS = {
    "parity": "a parity off by one: a wait passes once the phase of the given parity has "
              "completed, and a fresh barrier counts the phase before its first (parity 1) as "
              "complete. The full barrier of a buffer completes one phase each time a tile lands "
              "in it, so the parity belongs to the pass over the ring, not to the tile alone.",
    "fence": "a wgmma.fence left out: after the threads write registers a wgmma uses (the "
             "softmax and pack write S and P, the rescale writes O; O starts as zeros), a "
             "fence must come before the next issue.",
    "release": "a release before the wait on the group: a buffer may be released only once the "
               "wgmma group that reads it is retired by wgmma.wait_group (and only once).",
    "landed": "a read before the product landed (the wait_group count is wrong): "
              "wgmma.wait_group(n) leaves the n most recently committed groups in flight; count "
              "the groups committed after the one you need.",
    "overwrite": "registers written under a product: O += P V reads P and reads and writes O "
                 "until it is retired, so the rescale of O and the next pack of P wait for it.",
    "rescale": "a missing rescale: each softmax computes alpha = exp(m_old - m_new), and O and l "
               "must be multiplied by it (rescale) after the previous P V has landed and before "
               "the next P V is issued.",
    "overlap": "no overlap: the softmax runs while the tensor cores sit idle. Issue S(j) and the "
               "previous tile's P V before waiting, and wait only for S(j) before its softmax, "
               "so the P V runs under it.",
    "order": "an operation out of order: S(j) lands in the S registers, softmax(j) turns it into "
             "P(j) in float, pack_p(j) makes the bf16 P that issue_pv(j) multiplies.",
    "wait": "every product must be committed and retired by a wgmma.wait_group before the "
            "epilogue reads O.",
    "shape": "return a list of tuples such as (\"issue_s\", j), (\"wait_group\", 1).",
}


def _hint(kind):
    return HINTS.get(kind, HINTS["order"]) + REREAD


def _inputs(n, causal, ragged, seed):
    """Q (ROWS x D) and K, V (keys x D) as bf16-representable float32; logits large and
    growing along the keys, so that the row maxima move from tile to tile."""
    g = np.random.default_rng(seed)
    n_keys = n * BLOCK_N - ragged
    q0 = max(0, n_keys - ROWS) if causal else 0
    Q = hp._bf16(g.normal(size=(ROWS, D)) * 2)
    ramp = np.linspace(0, 3, n_keys)[:, None]
    K = hp._bf16(g.normal(size=(n_keys, D)) * (1 + ramp))
    V = hp._bf16(g.normal(size=(n_keys, D)))
    return Q, K, V, q0


def parse(candidate, n, stages, case):
    """The candidate's list for (n, stages), checked for its shape; a CheckFailure if bad."""
    ops = candidate(n, stages)
    try:
        return hp.parse_ops(ops, n, MIN_LENGTH + PER_TILE * n)
    except hp.PipelineError as e:
        raise CheckFailure(case, f"consumer_loop({n}, {stages}): {e}", _hint(e.kind)) from None


def run_cpu(ops, n, stages, causal, ragged, case, seed=0, orders=("late", 1, 2, 3)):
    """Every producer policy and completion order on the model; then overlap and numbers."""
    Q, K, V, q0 = _inputs(n, causal, ragged, seed)
    scale = 1 / np.sqrt(D)
    O64, lse64 = hp.float64_attention(Q, K, V, scale, causal, q0)
    for producer in ("eager", "lazy"):
        for order in orders:
            try:
                r = hp.run_consumer(ops, Q=Q, K=K, V=V, block_n=BLOCK_N, stages=stages,
                                    scale=scale, causal=causal, q0=q0, producer=producer,
                                    order=order)
            except hp.PipelineError as e:
                when = "products landing as late as allowed" if order == "late" else \
                    f"products landing at random legal moments (order {order})"
                who = "racing ahead" if producer == "eager" else "filling on demand"
                raise CheckFailure(case, f"{e} [producer {who}, {when}]", _hint(e.kind)) from None
            idle = [(i, j) for i, j, busy in r.overlapped if not busy]
            if len(idle) > 1:
                i, j = idle[1]
                raise CheckFailure(
                    case, f"softmax({j}) at operation {i} runs with no wgmma in flight, and so do "
                    f"{len(idle) - 1} other softmax(es): only one (the first) may. On the model's "
                    f"timeline (a product and a softmax one unit each) the tensor cores are busy "
                    f"{r.tensor_busy:.0%} of the time", _hint("overlap"))
            for name, got, want in (("O", r.O, O64), ("LSE", r.LSE, lse64)):
                compare(name, torch.from_numpy(got), torch.from_numpy(want), case=case,
                        atol=3e-2, rtol=3e-2, hint=_hint("rescale"))


def _cpu_case(n, stages, causal, ragged):
    def run(candidate):
        require_implemented(candidate)
        case = _name(n, stages, causal, ragged)
        ops = parse(candidate, n, stages, case)
        run_cpu(ops, n, stages, causal, ragged, case, seed=random.randrange(1 << 30))

    return run


def _name(n, stages, causal, ragged):
    extra = (", causal" if causal else "") + (f", last tile {BLOCK_N - ragged} of {BLOCK_N} keys"
                                              if ragged else "")
    return f"{n} tile(s), {stages} stage(s){extra}"


for _n, _stages, _causal, _ragged, _hidden in [
    (1, 2, False, 0, False),
    (4, 2, False, 3, False),
    (5, 3, True, 0, False),
    (3, 1, False, 0, False),
    (7, 2, False, 5, True),
    (6, 3, True, 2, True),
    (9, 4, False, 0, True),
    (2, 1, True, 1, True),
    (12, 2, True, 0, True),
]:
    consumer_loop.case(_name(_n, _stages, _causal, _ragged), hidden=_hidden)(
        _cpu_case(_n, _stages, _causal, _ragged))


# ------------------------------------------------------------------ on an H100: the real kernel

GPU_TILES, GPU_D = 8, 128  # key blocks of 128 (Nk 897..1024) at d = 128: the list for 8 tiles


def generated_source(ops, n_tiles=GPU_TILES, d=GPU_D):
    """Chapter 14's kernel source with variant 2's loop replaced by the list's statements."""

    from ...toolbox import cuda as C

    body = hp.emit_cuda(ops, n_tiles, _gpu_stages(d))
    lines = [f"#define FA_GENERATED_TILES {n_tiles}", f"#define FA_GENERATED_D {d}",
             "#define FA_GENERATED_LOOP \\"] + [f"    {line} \\" for line in body.splitlines()]
    lines.append("    /* end of the generated loop */")
    path = paths.KERNELS / "flash_attention_hopper.cu"
    return "\n".join(lines) + "\n" + C._read_source(path)[0]


def _gpu_stages(d):
    """The kernel's ring depth at head dim d (its FA_STAGES_D64 / FA_STAGES_D128 defaults)."""
    import re

    kernel = paths.KERNELS / "flash_attention_hopper.cu"
    text = kernel.read_text()
    return int(re.search(rf"#define FA_STAGES_D{d} (\d+)", text).group(1))


def _is_sm90():
    return on_gpu() and torch.cuda.get_device_capability()[0] == 9


_built = {}


def _gpu_module(ops):
    from ...toolbox import cuda as C

    key = tuple(ops)
    if key not in _built:
        _built.clear()  # one student's list at a time
        _built[key] = C.load_cuda(generated_source(ops), ["flash_attention_hopper"],
                                  name="fa_hopper_consumer_loop", arch="sm_90a",
                                  extra_cuda_cflags=["-DFA_HOPPER_WATCHDOG"])
    return _built[key]


def _gpu_case(candidate):
    from ...reference import attention

    require_implemented(candidate)
    case = f"H100: the list for {GPU_TILES} tiles in chapter 14's kernel, d = {GPU_D}"
    stages = _gpu_stages(GPU_D)
    ops = parse(candidate, GPU_TILES, stages, case)
    run_cpu(ops, GPU_TILES, stages, False, 0, case, orders=("late",))  # refuse a hang up front
    mod = _gpu_module(ops)
    g = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    for B, H, Nq, Nk in ((1, 2, 200, 1000), (2, 3, 512, 1024), (1, 1, 64, 897)):
        q, k, v = (torch.randn(B, H, n, GPU_D, device="cuda", generator=g).bfloat16()
                   for n in (Nq, Nk, Nk))
        junk = torch.full((1 << 24,), float("nan"), device="cuda")  # the allocator's next
        del junk  # blocks start as NaN: an element of O never written shows
        O, lse = mod.flash_attention_hopper(q, k, v, False, 2)
        O64, lse64 = attention(q, k, v, causal=False)
        where = f"{case}, B={B} H={H} Nq={Nq} Nk={Nk}"
        compare("O", O, O64, case=where, atol=2e-2, rtol=2e-2, poisoned=True,
                hint=_hint("rescale"))
        compare("LSE", lse, lse64, case=where, atol=1e-2, rtol=1e-3, hint=_hint("rescale"))
    # timing: the generated loop against variant 0 of the same build, 5 interleaved rounds
    q, k, v = (torch.randn(8, 16, n, GPU_D, device="cuda", generator=g).bfloat16()
               for n in (4096, 1024, 1024))
    times = {0: [], 2: []}
    for variant in (0, 2):
        mod.flash_attention_hopper(q, k, v, False, variant)  # warm up
    for _ in range(5):
        for variant in (0, 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                mod.flash_attention_hopper(q, k, v, False, variant)
            end.record()
            torch.cuda.synchronize()
            times[variant].append(start.elapsed_time(end) / 10)
    base, yours = float(np.median(times[0])), float(np.median(times[2]))
    if yours > 1.05 * base:
        raise CheckFailure(case, f"your loop takes {yours:.3f} ms, variant 0 {base:.3f} ms "
                           "(median of 5 interleaved rounds, B=8 H=16 Nq=4096 Nk=1024): slower "
                           "than the loop without overlap", _hint("overlap"))


if _is_sm90():  # the real kernel, where there is an H100 (or H200)
    consumer_loop.case(f"H100: the list for {GPU_TILES} tiles in chapter 14's kernel, d = {GPU_D}")(
        _gpu_case)
