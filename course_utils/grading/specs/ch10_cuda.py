"""Chapter 10's GPU twin, ``10.warp_loop_cuda``: the warp's tile loop in CUDA C++.

The student fills the two blanks of a teaching kernel, ``warp_flash_forward`` (one warp of 32
lanes per 16 query rows, D = 64, key tiles of BC = 32 in shared memory, Q's A fragments loaded
once): the body of the key-tile loop (S = Q K^T with ``ldmatrix_x4`` and ``mma_m16n8k16_bf16``,
the masks as selects, the row max with two ``__shfl_xor_sync``, the rescale of l and of the O
fragments, P packed into bf16 A registers, O += P V with ``ldmatrix_x4_trans``) and the finish
(l summed over the 4 lanes of a row, O / l and the natural-log LSE stored; -inf and O = 0 for a
row that sees no key). The kernel's helpers are ``kernels/mma_helpers.cuh``.

On a GPU the source is built with NVRTC in the student's process (``harness.ch10
.run_warp_flash``) and launched into O and LSE that the grader poisoned with NaN; on a CPU the
same source runs on the CUDA emulation (``course_utils.toolbox.cuda_cpu``, whose warp collectives
and mma helpers compute what the PTX ISA says), twice, in two thread orders. Either way O and LSE
are compared here with a float64 softmax of the same bf16 inputs, and the known slips are named
by models computed here (tile by tile, in float64).
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from ...runtime import on_gpu
from .. import emulated
from ..checks import CheckFailure, Mistake, compare
from ..harness.ch10 import LOOP_BC, LOOP_D, LOOP_KERNEL
from ..types import Exercise, invoke
from . import source_of
from .ch10_loop import (
    M_BASE2,
    M_LANE_MAX,
    M_NO_ALPHA_L,
    M_NO_ALPHA_O,
    M_NO_GUARD,
    _softmax_sums,
    _tiled,
)

H = "course_utils.grading.harness.ch10:"

warp_loop_cuda = Exercise(
    "10.warp_loop_cuda", "The warp's tile loop in CUDA C++ (ldmatrix, mma.sync, shuffles)",
    points=4,
)

HINT_CUDA = (
    "per key tile: s[nt] from mma_m16n8k16_bf16 (A = qa[kc], B = ldmatrix_x4 of Ks), masked "
    "values set to -inf before the max, the max over the lane's values then __shfl_xor_sync 1 "
    "and 2, alpha = exp(m - m_new) on l and on every o[nd][i] (row g: i = 0, 1; row g + 8: "
    "i = 2, 3), P packed with pack_bf16 (keys 2t, 2t + 1 of the left n-tile, then the right), "
    "O += P V with ldmatrix_x4_trans of Vs; at the end l summed over the 4 lanes, O / l, "
    "LSE = m + ln(l). Reread the lecture's sections 1 to 4 and the kernel excerpts of section 7"
)
M_L_NOT_SUMMED = Mistake(
    "l not summed over the 4 lanes of its row", "each lane summed exp(S - m) over its own "
    "keys only (2t, 2t + 1 of each n-tile): add the other 3 lanes' shares with two "
    "__shfl_xor_sync (1, 2) before dividing"
)


def _inputs(rng, Nq, N, logits):
    Q = torch.from_numpy(rng.standard_normal((Nq, LOOP_D)) * logits).bfloat16()
    K = torch.from_numpy(rng.standard_normal((N, LOOP_D))).bfloat16()
    V = torch.from_numpy(rng.standard_normal((N, LOOP_D))).bfloat16()
    return Q, K, V


def _reference(Q, K, V, q_offset, causal):
    """O, LSE (float64), the scaled scores and which keys each row sees."""
    S = Q.double().numpy() @ K.double().numpy().T / math.sqrt(LOOP_D)
    Nq, N = S.shape
    visible = np.ones((Nq, N), bool)
    if causal:
        visible = np.arange(N)[None, :] <= q_offset + np.arange(Nq)[:, None]
    m, l = _softmax_sums(S, visible)
    Vd = V.double().numpy()
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        W = np.where(visible, np.exp(S - np.where(np.isneginf(m), 0, m)[:, None]), 0.0)
        O = np.where(l[:, None] > 0, W @ Vd / l[:, None], 0.0)
        LSE = np.where(l > 0, m + np.log(l), -np.inf)
    return O, LSE, S, visible, Vd


def _mistakes(S, visible, Vd, O, LSE):
    """(Mistake, wrong) pairs for O and for LSE, every model in float64."""
    blind = ~visible.any(axis=1)
    rows = len(S)

    def tiled(**kw):
        outs = [_tiled(S[r0:r0 + 16], Vd, visible[r0:r0 + 16], LOOP_BC, **kw)
                for r0 in range(0, rows, 16)]  # fmt: skip
        return np.concatenate([o[0] for o in outs]), np.concatenate([o[1] for o in outs])

    def not_summed():
        m, _ = _softmax_sums(S, visible)
        base = np.where(np.isneginf(m), 0, m)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            W = np.where(visible, np.exp(S - base[:, None]), 0.0)
            lane_of_key = (np.arange(S.shape[1]) % 8) // 2
            share = np.stack([W[:, lane_of_key == t].sum(axis=1) for t in range(4)], axis=1)
            lane_of_col = (np.arange(LOOP_D) % 8) // 2
            acc = W @ Vd
            O_w = np.where(share[:, lane_of_col] > 0, acc / share[:, lane_of_col], 0.0)
            LSE_w = np.where(share[:, 0] > 0, m + np.log(share[:, 0]), -np.inf)
        return O_w, LSE_w

    m_row, l_row = _softmax_sums(S, visible)
    with np.errstate(divide="ignore"):
        lse_log2 = np.where(blind, -np.inf, m_row + np.log2(l_row))
    def lane_max():
        """Each lane's own running max (no shuffle): P, l and the O columns it holds use it."""
        rows_, N = S.shape
        key_lane = (np.arange(N) % 8) // 2
        col_lane = (np.arange(LOOP_D) % 8) // 2
        m = np.full((rows_, 4), -np.inf)
        l = np.zeros((rows_, 4))
        acc = np.zeros((rows_, LOOP_D))
        with np.errstate(invalid="ignore", over="ignore"):
            for j0 in range(0, N, LOOP_BC):
                keys = np.arange(j0, min(j0 + LOOP_BC, N))
                s = np.where(visible[:, keys], S[:, keys], -np.inf)
                m_new = m.copy()
                for t in range(4):
                    mine = key_lane[keys] == t
                    if mine.any():
                        m_new[:, t] = np.maximum(m[:, t], s[:, mine].max(axis=1))
                base = np.where(np.isneginf(m_new), 0.0, m_new)
                alpha = np.exp(m - base)
                P = np.exp(s - base[:, key_lane[keys]])
                for t in range(4):
                    l[:, t] = alpha[:, t] * l[:, t] + P[:, key_lane[keys] == t].sum(axis=1)
                acc = alpha[:, col_lane] * acc + P @ Vd[keys]
                m = m_new
            L = l.sum(axis=1)
            O_w = np.where(L[:, None] > 0, acc / L[:, None], 0.0)
        with np.errstate(divide="ignore"):
            LSE_w = np.where(L > 0, m[:, 0] + np.log(L), -np.inf)
        return O_w, LSE_w

    no_o = tiled(alpha_o=False)
    no_l = tiled(alpha_l=False)
    lane = not_summed()
    own_max = lane_max()
    nan_O = np.where(blind[:, None], np.nan, O)
    t = torch.from_numpy
    return ([(M_NO_ALPHA_O, t(no_o[0])), (M_NO_ALPHA_L, t(no_l[0])), (M_L_NOT_SUMMED, t(lane[0])),
             (M_NO_GUARD, t(nan_O)), (M_LANE_MAX, t(own_max[0]))],
            [(M_NO_ALPHA_L, t(no_l[1])), (M_L_NOT_SUMMED, t(lane[1])), (M_LANE_MAX, t(own_max[1])),
             (M_NO_GUARD, t(np.where(blind, np.nan, LSE))),
             (M_BASE2, t(LSE / math.log(2))), (M_BASE2, t(lse_log2))])  # fmt: skip


def run_case(candidate, Nq, N, q_offset, causal, logits, rng):
    from ...toolbox.cuda import PLACEHOLDER

    source = source_of(candidate)
    if PLACEHOLDER in source:
        raise NotImplementedError(f"the kernel still has its // {PLACEHOLDER}")
    where = "GPU" if on_gpu() else "CPU emulation"
    what = f"causal, q_offset = {q_offset}" if causal else "not causal"
    case = (f"{where}: Nq = {Nq}, N = {N}, {what}"
            + (f", |S| up to ~{2.5 * logits:.0f}" if logits > 1 else ""))  # fmt: skip
    Q, K, V = _inputs(rng, Nq, N, logits)
    O_want, LSE_want, S, visible, Vd = _reference(Q, K, V, q_offset, causal)
    scale = 1.0 / math.sqrt(LOOP_D)
    if on_gpu():
        O = torch.full((Nq, LOOP_D), math.nan, device="cuda")
        LSE = torch.full((Nq,), math.nan, device="cuda")
        got = invoke(candidate, H + "run_warp_flash", Q.cuda(), K.cuda(), V.cuda(), O, LSE, Nq,
                     N, q_offset, scale, int(causal))  # fmt: skip
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailure(case, "the launch returned no (O, LSE)", None)
        O, LSE = got
    else:
        O = torch.full((Nq, LOOP_D), math.nan)
        LSE = torch.full((Nq,), math.nan)
        emulated.run_case(candidate, LOOP_KERNEL, ((Nq + 15) // 16,), (32,), Q, K, V, O, LSE, Nq,
                          N, q_offset, scale, int(causal), case=case)  # fmt: skip
    slips_O, slips_LSE = _mistakes(S, visible, Vd, O_want, LSE_want)
    dev = O.device if isinstance(O, torch.Tensor) else "cpu"
    compare("LSE", LSE, torch.from_numpy(LSE_want).to(dev), case=case, atol=2e-3, rtol=1e-4,
            dtype=torch.float32, hint=HINT_CUDA, poisoned=True, mistakes=slips_LSE)  # fmt: skip
    compare("O", O, torch.from_numpy(O_want).to(dev), case=case, atol=2e-2, rtol=2e-2,
            dtype=torch.float32, hint=HINT_CUDA, poisoned=True, mistakes=slips_O)  # fmt: skip


def _fresh_rng():
    return np.random.default_rng(random.getrandbits(63))


def _case(*problems):
    def run(candidate):
        rng = _fresh_rng()
        for problem in problems:
            run_case(candidate, *problem, rng)

    return run


def _fresh(candidate):
    rng = _fresh_rng()
    for _ in range(2):
        Nq, N = int(rng.integers(1, 70)), int(rng.integers(LOOP_BC + 1, 5 * LOOP_BC))
        causal = bool(rng.integers(2))
        q_offset = int(rng.integers(-20, N)) if causal else 0
        run_case(candidate, Nq, N, q_offset, causal, float(rng.choice([1.0, 24.0])), rng)


# (Nq, N, q_offset, causal, logits): every visible case has several key tiles of 32
warp_loop_cuda.case("Nq = 40, N = 77: ragged rows and keys, 3 key tiles, |S| ~ 10")(
    _case((40, 77, 0, False, 4.0))
)
warp_loop_cuda.case("causal, q_offset = -6: 6 rows see no key, |S| ~ 60")(
    _case((35, 70, -6, True, 24.0))
)
warp_loop_cuda.case("causal bottom-right (q_offset = N - Nq), N = 100, |S| ~ 60")(
    _case((20, 100, 80, True, 24.0))
)
warp_loop_cuda.case("N = 1; Nq = 1", hidden=True)(
    _case((16, 1, 0, False, 1.0), (1, 50, 0, True, 1.0))
)
warp_loop_cuda.case("fresh random Nq, N, causal, q_offset", hidden=True)(_fresh)

__all__ = ["run_case", "warp_loop_cuda"]
