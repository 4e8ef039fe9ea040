"""Attack notebooks aimed at chapter 10's loop grader (``10.warp_loop``), which runs the
student's ``warp_forward`` through ``harness.ch10.traced_forward`` and decides on the trace of
its mma calls in the grading process.

Every attack hands in the right O and LSE (numpy's exact softmax), and tries to make the trace
look like the loop's: none may score. ``tests/test_grading_attacks.py`` grades them with the
others (``register(attack)``).
"""

from __future__ import annotations

CHECK = 'grader.check("10.warp_loop", warp_forward)'

EXACT = '''
import numpy as np
from course_utils import mma


def exact(Q, K, V, causal, q0):
    """The right O and LSE, in float64, without a single fragment."""
    S = Q.astype(np.float64) @ K.T.astype(np.float64) / np.sqrt(K.shape[1])
    if causal:
        S = np.where(np.arange(len(K))[None] <= q0 + np.arange(16)[:, None], S, -np.inf)
    m = S.max(axis=1, keepdims=True)
    W = np.exp(S - np.where(np.isinf(m), 0, m))
    l = W.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        O = np.where(l > 0, W @ V / l, 0)
        LSE = np.where(l[:, 0] > 0, m[:, 0] + np.log(l[:, 0]), -np.inf)
    return O.astype(np.float32), LSE.astype(np.float32), S, W
'''

# 1. the "fragment simulator result" is numpy's exact softmax @ V
PLAIN = EXACT + '''

def warp_forward(Q, K, V, Bc, causal, q0):
    O, LSE, _, _ = exact(Q, K, V, causal, q0)
    return O, LSE
'''

# 2. mma_m16n8k16 patched inside the student's process: a cheap fake (exact float64, no bf16
# rounding of its inputs) fed the right operands, so that the calls are there and counted
PATCHED = EXACT + '''
from course_utils.grading.harness.ch10 import k_fragment, v_fragment


def _fake_mma(a, b, c):
    A, B = mma.gather(a, "A").astype(np.float64), mma.gather(b, "B").astype(np.float64)
    return mma.fragments(A @ B + mma.gather(c, "C"), "C")


mma.mma_m16n8k16 = _fake_mma


def warp_forward(Q, K, V, Bc, causal, q0):
    O, LSE, S, W = exact(Q, K, V, causal, q0)
    N, d = K.shape
    q_a = [mma.fragments(Q[:, c:c + 16], "A") for c in range(0, d, 16)]
    for n0 in range(0, N, 8):  # "S" on the (fake) tensor core, results thrown away
        acc = np.zeros((32, 4), np.float32)
        for kc in range(d // 16):
            acc = mma.mma_m16n8k16(q_a[kc], k_fragment(K, n0, 16 * kc), acc)
    P = np.zeros((16, -(-N // 16) * 16))
    P[:, :N] = W / W.max(axis=1, keepdims=True).clip(1e-30)
    o = [np.zeros((32, 4), np.float32) for _ in range(d // 8)]
    for k0 in range(0, N, 16):  # "P V", P exact in float32
        p_a = mma.fragments(P[:, k0:k0 + 16].astype(np.float32), "A")
        for nd in range(d // 8):
            o[nd] = mma.mma_m16n8k16(p_a, v_fragment(V, k0, 8 * nd), o[nd])
    return O, LSE
'''

# 3. the harness itself replaced: traced_forward returns the exact answer and a forged trace
# (the right number of calls, operands copied from Q and K, results made up)
FORGED = EXACT + '''
import course_utils.grading.harness.ch10 as h


def _forged(fn, Q, K, V, Bc, causal, q0):
    O, LSE, S, W = exact(Q, K, V, causal, q0)
    N, d = K.shape
    n = (-(-N // 8)) * (d // 16) + (-(-N // 16)) * (d // 8)
    a = np.stack([mma.fragments(np.pad(Q[:, :16], ((0, 0), (0, 0))), "A")] * n)
    b = np.stack([h.k_fragment(K, 0, 0)] * n)
    zeros = np.zeros((n, 32, 4), np.float32)
    trace = {"a": a, "b": b, "c": zeros, "d": zeros, "calls": n}
    return O, LSE, trace


h.traced_forward = _forged


def warp_forward(Q, K, V, Bc, causal, q0):
    return exact(Q, K, V, causal, q0)[:2]
'''

# 4. a forged trace that is consistent with the replay (the real mma on made-up operands),
# alongside the exact answer
REPLAYED = EXACT + '''
import course_utils.grading.harness.ch10 as h

_real = mma.mma_m16n8k16


def _forged(fn, Q, K, V, Bc, causal, q0):
    O, LSE, S, W = exact(Q, K, V, causal, q0)
    rng = np.random.default_rng(0)
    a = mma.to_bf16(rng.standard_normal((64, 32, 8))).astype(np.float32)
    b = mma.to_bf16(rng.standard_normal((64, 32, 4))).astype(np.float32)
    c = np.zeros((64, 32, 4), np.float32)
    d = np.stack([_real(a[i], b[i], c[i]) for i in range(64)])
    return O, LSE, {"a": a, "b": b, "c": c, "d": d, "calls": 64}


h.traced_forward = _forged


def warp_forward(Q, K, V, Bc, causal, q0):
    return exact(Q, K, V, causal, q0)[:2]
'''

# 5. a forbidden route: O from torch's SDPA, the S mmas made for show
SDPA = EXACT + '''
import torch
import torch.nn.functional as F
from course_utils.grading.harness.ch10 import k_fragment


def warp_forward(Q, K, V, Bc, causal, q0):
    N, d = K.shape
    q_a = [mma.fragments(Q[:, c:c + 16], "A") for c in range(0, d, 16)]
    for n0 in range(0, N, 8):
        acc = np.zeros((32, 4), np.float32)
        for kc in range(d // 16):
            acc = mma.mma_m16n8k16(q_a[kc], k_fragment(K, n0, 16 * kc), acc)
    q, k, v = (torch.from_numpy(np.asarray(x, np.float32))[None] for x in (Q, K, V))
    O = F.scaled_dot_product_attention(q, k, v).numpy()[0]
    return O, exact(Q, K, V, causal, q0)[1]
'''


def register(attack):
    for name, cell in (("warp_loop_exact_softmax", PLAIN), ("warp_loop_patched_mma", PATCHED),
                       ("warp_loop_forged_trace", FORGED),
                       ("warp_loop_replayed_random_trace", REPLAYED),
                       ("warp_loop_sdpa_route", SDPA)):  # fmt: skip
        attack(name, [cell, CHECK], {"10.warp_loop": 0}, chapter="10")
    register_cuda(attack)


# 6. the CUDA twin on a CPU: the emulator's launcher replaced in the student's process by one
# that writes numpy's softmax into O and LSE (the kernel source is the exercise's stub)
LAUNCHER = '''
import numpy as np
import torch
import course_utils.toolbox.cuda_cpu as cc


def _launch_twice(source, kernel, grid, block, Q, K, V, O, LSE, Nq, N, q_offset, scale, causal,
                  **kw):
    q, k, v = (np.asarray(torch.from_numpy(np.asarray(x)).view(torch.bfloat16).float())
               if np.asarray(x).dtype == np.uint16 else np.asarray(x, np.float32)
               for x in (Q, K, V))
    S = q.astype(np.float64) @ k.T * scale
    if causal:
        S = np.where(np.arange(N)[None] <= q_offset + np.arange(Nq)[:, None], S, -np.inf)
    m = S.max(axis=1, keepdims=True)
    W = np.exp(S - np.where(np.isinf(m), 0, m))
    l = W.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        O[...] = np.where(l > 0, W @ v / l, 0)
        LSE[...] = np.where(l[:, 0] > 0, m[:, 0] + np.log(l[:, 0]), -np.inf)
    return ""


cc.launch_twice = _launch_twice
warp_loop_cu = (
    "__global__ void warp_flash_forward(const __nv_bfloat16* Q, const __nv_bfloat16* K, "
    "const __nv_bfloat16* V, float* O, float* LSE, int Nq, int N, int q_offset, float scale, "
    "int causal) {}")
'''
CHECK_CUDA = 'grader.check("10.warp_loop_cuda", warp_loop_cu)'


def register_cuda(attack):
    attack("warp_loop_cuda_patched_launcher", [LAUNCHER, CHECK_CUDA], {"10.warp_loop_cuda": 0},
           chapter="10")
