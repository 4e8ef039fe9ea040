"""Ring attention (chapter 13): R gloo processes on the CPU against one float64 attention.

One process group per world size checks every case inside it (spawning costs seconds).
"""

import math

import pytest
import torch

from course_utils import reference, ring

CASES = [  # (N, causal, layout, dtype[, H, Hkv]): N total rows; n = N / R per rank
    (8, True, "zigzag", "float64"),
    (8, True, "zigzag", "float64", 4, 2),  # GQA 4:2: K/V travel at 2 heads
    (8, False, "contiguous", "float64", 4, 1),  # multi-query
    (12, False, "zigzag", "float64", 6, 2),
    (12, True, "contiguous", "float64", 4, 2),
    (64, True, "zigzag", "float32", 4, 2),
    (64, False, "contiguous", "float32", 4, 2),
    (8, False, "zigzag", "float64"),
    (12, True, "contiguous", "float64"),
    (2, True, "contiguous", "float64"),  # one row per rank
    (4, True, "zigzag", "float64"),  # the smallest zig-zag: one row per chunk
    (6, False, "contiguous", "float64"),
    (64, True, "zigzag", "float32"),  # float32 through chapter 12's tiled PyTorch path
]
CASES_R3 = [(12, True, "zigzag", "float64"), (9, True, "contiguous", "float64"),
            (6, False, "zigzag", "float64"), (12, True, "zigzag", "float64", 4, 2)]


def _case(i, N, causal, layout, dtype, H=2, Hkv=None):
    d = 8 if dtype == "float64" else 16  # the PyTorch path takes d in ops.SUPPORTED_D
    return dict(B=2, H=H, Hkv=Hkv or H, N=N, d=d, causal=causal, layout=layout, seed=100 + i,
                dtype=dtype)


def _expected(case):
    """Float64 O, LSE (course_utils.reference) and dQ, dK, dV (autograd of the formula)."""
    Q, K, V, dO = ring.sequence_inputs(case["B"], case["H"], case["N"], case["d"],
                                       torch.float64, "cpu", case["seed"])
    K, V = K[:, : case["Hkv"]], V[:, : case["Hkv"]]  # as check_worker draws GQA's K/V
    Q, K, V = (t.to(getattr(torch, case["dtype"])).double() for t in (Q, K, V))
    group = case["H"] // case["Hkv"]  # query head h reads K/V head h // group
    O, LSE = reference.attention(Q, K.repeat_interleave(group, 1),
                                 V.repeat_interleave(group, 1), causal=case["causal"])
    Q, K, V = (t.requires_grad_() for t in (Q, K, V))
    Kx, Vx = K.repeat_interleave(group, 1), V.repeat_interleave(group, 1)
    S = (Q @ Kx.transpose(-1, -2)) / math.sqrt(case["d"])
    if case["causal"]:
        S = S.masked_fill(~torch.ones(S.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    (torch.softmax(S, -1) @ Vx).backward(dO)
    return {"O": O, "LSE": LSE, "dQ": Q.grad, "dK": K.grad, "dV": V.grad}


def _check_world(R, cases):
    specs = [_case(i, *c) for i, c in enumerate(cases)]
    results = ring.launch(ring.check_worker, R, specs)
    for i, case in enumerate(specs):
        want = _expected(case)
        tol = {"float64": 1e-12, "float32": 2e-5}.get(case["dtype"], 4e-2)  # bf16: 4e-2
        for name in ("O", "LSE", "dQ", "dK", "dV", "dQ_fetch", "dK_fetch", "dV_fetch", "O_ag",
                     "dQ_ag", "dK_ag", "dV_ag"):
            got = ring.unshard([results[r][i][name] for r in range(R)], case["layout"], dim=2)
            ref = want[name.split("_")[0]]
            err = (got.double() - ref).abs().max().item()
            assert err < tol, f"R={R} {case}: {name} off by {err:.1e} (tolerance {tol:.0e})"


def test_ring_forward_backward_two_ranks():
    _check_world(2, CASES)


def test_ring_forward_backward_three_ranks():
    _check_world(3, CASES_R3)


# Each knob (ring.KNOBS, environment variables the ranks inherit) keeps the results: float64
# cases (the schedule), and bf16 through chapter 12's CPU path (the dK/dV wire dtype matters
# only below float32) against float64, with the knob set and unset.
KNOB_CASES = [(8, True, "zigzag", "float64", 4, 2), (12, True, "contiguous", "float64"),
              (8, False, "zigzag", "float64"), (64, True, "zigzag", "bfloat16", 4, 2)]


@pytest.mark.parametrize("setting", [None, ("DKV_WIRE", "working"),
                                     ("POST", "after")])
def test_ring_knobs_keep_the_results(setting, monkeypatch):
    for name in ring.KNOBS:
        monkeypatch.delenv(f"COURSE_RING_{name}", raising=False)
    if setting:
        monkeypatch.setenv(f"COURSE_RING_{setting[0]}", setting[1])
    _check_world(2, KNOB_CASES)
    if setting and setting[0] != "DKV_WIRE":  # the schedule knobs at R = 3 as well
        _check_world(3, CASES_R3[:2])


def test_a_wrong_kv_last_is_a_clear_error(one_rank_group):
    q, k, v, do = ring.sequence_inputs(1, 2, 4, 8, torch.float64, "cpu", 0)
    O, LSE, kv = ring.ring_attention_forward(q, k, v, causal=True, return_kv=True)
    assert kv.shape == (2, *k.shape)
    for bad in (kv[:1], kv.float(), "kv"):
        with pytest.raises(ValueError, match="kv_last .*return_kv=True"):
            ring.ring_attention_backward(do, q, k, v, O, LSE, causal=True, kv_last=bad)


def test_a_knob_with_another_value_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("COURSE_RING_DKV_WIRE", raising=False)
    assert ring.knob("DKV_WIRE") == "float32"  # unset: the default
    monkeypatch.setenv("COURSE_RING_POST", "sometimes")
    with pytest.raises(ValueError, match="COURSE_RING_POST"):
        ring.knob("POST")


def test_one_rank_is_plain_attention_and_records_a_timeline(one_rank_group):
    case = _case(0, 6, True, "contiguous", "float64")
    want = _expected(case)
    q, k, v, do = ring.sequence_inputs(2, 2, 6, 8, torch.float64, "cpu", case["seed"])
    events = []
    O, LSE = ring.ring_attention_forward(q, k, v, causal=True, timeline=events)
    dQ, dK, dV = ring.ring_attention_backward(do, q, k, v, O, LSE, causal=True)
    for name, got in (("O", O), ("LSE", LSE), ("dQ", dQ), ("dK", dK), ("dV", dV)):
        assert (got - want[name]).abs().max() < 1e-12, name
    assert [e["what"] for e in events] == ["post", "compute", "wait"]
    assert all(e["end"] >= e["start"] for e in events)


def test_shard_unshard_round_trip_and_layouts():
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    for R in (1, 2, 3, 4):
        for layout in ring.LAYOUTS:
            if 24 % (R * (2 if layout == "zigzag" else 1)):
                continue
            parts = ring.shard(x, R, layout, dim=1)
            assert all(p.shape == (2, 24 // R, 3) for p in parts)
            assert torch.equal(ring.unshard(parts, layout, dim=1), x)
    zz = ring.positions(8, 2, "zigzag")
    assert zz[0].tolist() == [0, 1, 6, 7] and zz[1].tolist() == [2, 3, 4, 5]


def test_work_counts_match_the_plan_and_zigzag_is_balanced():
    R, n = 4, 8
    for layout in ring.LAYOUTS:
        work = ring.step_work(R, layout, causal=True, n=n) * n * n
        for r in range(R):
            for s in range(R):
                plan = ring.block_plan(r, (r - s) % R, R, n, True, layout)
                if plan is None:
                    entries = 0
                else:
                    rows, cols, masked = plan
                    a, b = rows.stop - rows.start, cols.stop - cols.start
                    entries = a * (a + 1) // 2 if masked else a * b
                assert work[r, s] == entries, (layout, r, s)
    per_rank = {layout: ring.step_work(R, layout, n=64).sum(1) for layout in ring.LAYOUTS}
    assert per_rank["zigzag"].max() - per_rank["zigzag"].min() < 1e-6
    assert per_rank["contiguous"].max() / per_rank["contiguous"].min() > 2 * R - 2


def test_merge_with_a_base2_lse_is_wrong_and_shows_by_how_much():
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    O_ref, LSE_ref = reference.attention(q, k, v)
    scale = 1 / 4
    O_1, LSE_1 = ring.block_forward(q, k[:, :, :4], v[:, :, :4], False, scale)
    O_2, LSE_2 = ring.block_forward(q, k[:, :, 4:], v[:, :, 4:], False, scale)
    O_0, LSE_0 = torch.zeros_like(q), torch.full(q.shape[:3], -math.inf, dtype=q.dtype)
    O, LSE = ring.merge(*ring.merge(O_0, LSE_0, O_1, LSE_1), O_2, LSE_2)
    assert (O - O_ref).abs().max() < 1e-12 and (LSE - LSE_ref).abs().max() < 1e-12
    O_bad, _ = ring.merge(*ring.merge(O_0, LSE_0, O_1, LSE_1), O_2, LSE_2 / math.log(2))
    err = (O_bad - O_ref).abs().max().item()
    print(f"a base-2 LSE in a natural-log merge: |O - O_ref| = {err:.2e}")
    assert err > 1e-2


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of 4"):
        ring.positions(6, 2, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        ring.shard(torch.zeros(4, 2), 2, "striped")
    with pytest.raises(ValueError, match="R="):
        ring.positions(4, 0)
    q = torch.zeros(1, 1, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="n even"):
        ring.ring_attention_forward(q, q, q, causal=True, layout="zigzag")
    with pytest.raises(ValueError, match="one shape"):
        ring.ring_attention_forward(q, q[:, :, :2], q[:, :, :2])
    q4 = torch.zeros(1, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="multiple of Hkv"):  # GQA: 4 query heads, 3 K/V heads
        ring.allgather_attention(q4, q4[:, :3], q4[:, :3])
    with pytest.raises(RuntimeError, match="not initialised"):
        ring.ring_attention_forward(q, q, q)
    with pytest.raises(ValueError, match="backend"):
        ring.launch(ring.check_worker, 2, [], backend="mpi")


def _in_main(rank, world_size):  # pretend to be a notebook cell's function
    return rank


_in_main.__module__ = "__main__"


def test_launch_refuses_a_function_spawn_cannot_import():
    with pytest.raises(ValueError, match="__main__"):
        ring.launch(_in_main, 2)


# ----------------------------------------------------------------------------- graded ranks
# course_utils.grading.ranks: the grader's own rank processes for 13.ring_forward.

_PROBE = '''
import glob, os, socket
import torch
import torch.distributed as dist


def probe(x):
    found = []
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
        found.append(1.0)
    except OSError:
        found.append(0.0)
    readable = 0.0
    for path in glob.glob("../*") + glob.glob("../store/*"):
        try:
            with open(path, "rb") as f:
                f.read(1)
            readable = 1.0
        except OSError:
            pass
    found.append(readable)
    got = torch.empty_like(x)
    r, R = dist.get_rank(), dist.get_world_size()
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (r + 1) % R),
                                     dist.P2POp(dist.irecv, got, (r - 1) % R)]):
        w.wait()
    return torch.tensor(found), got
'''


def _stray():
    from course_utils import sandbox
    from course_utils.grading.sandbox import zygote

    # the zygotes outlive the cases
    return {p for p in sandbox.descendants(__import__("os").getpid())} - zygote.pids()


def test_ranks_are_locked_in_and_pass_blocks_over_the_sockets_they_opened():
    from course_utils import ranks, sandbox

    before = _stray()
    shards = [(torch.full((3,), float(r)),) for r in range(3)]
    out = ranks.run(_PROBE, "probe", shards)
    for r, ((found, got), log) in enumerate(out):
        assert torch.equal(got, torch.full((3,), float((r - 1) % 3)))  # the ring still works
        if sandbox.landlock_abi() >= 1:
            assert found.tolist() == [0.0, 0.0], (r, found)  # no socket, no other rank's files
        assert [e["ev"] for e in log] == ["post", "wait", "end"]
        assert log[0]["sends"] == [[(r + 1) % 3, 12]]
    assert _stray() <= before


def test_a_deadlocked_ring_times_out_and_leaves_nothing(monkeypatch):
    import os
    import tempfile

    from course_utils import ranks

    ranks._zygote()  # the process's zygote (and its folder) outlive the case: started first
    before = _stray()
    made, real = [], tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(ranks.tempfile, "mkdtemp", mkdtemp)
    hang = ("import torch.distributed as dist\n\n\ndef hang(x):\n"
            "    import os\n    if os.fork() == 0:\n        os.setsid()\n"
            "        import time\n        time.sleep(60)\n"
            "    for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, "
            "(dist.get_rank() + 1) % 2)]):\n        w.wait()\n")
    with pytest.raises(ranks.RankFailure) as info:
        ranks.run(hang, "hang", [(torch.zeros(2),), (torch.zeros(2),)], seconds=25)
    assert info.value.status in ("timed out", "error"), info.value
    assert _stray() <= before
    assert made and not any(os.path.exists(p) for p in made)  # store and scratch deleted


@pytest.mark.parametrize("R", [1, 2, 3])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_allgather_pieces_cover_the_mask_once(R, layout, causal):
    """The all-gather's local blocks (own K/V) and the rest (gathered K/V) together compute
    every (query, key) pair of the mask once, and no other."""
    n = 4
    N = n * R
    pos = ring.positions(N, R, layout)
    for r in range(R):
        seen = torch.zeros(n, N, dtype=torch.int64)
        local, rest = ring._allgather_pieces(r, R, n, causal, layout)
        for rows, keys, masked in local:
            q_glob, k_glob = pos[r][rows], pos[r][keys]
            ok = (k_glob[None, :] <= q_glob[:, None]) if masked else torch.ones(
                len(q_glob), len(k_glob), dtype=torch.bool)
            for i, qi in enumerate(range(rows.start, rows.stop)):
                seen[qi, k_glob[ok[i]]] += 1
        for rows, keys in rest:
            if causal:
                k_glob = torch.arange(N)[keys]  # global rows, in sequence order
            else:  # every other rank's keys
                k_glob = torch.cat([pos[j] for j in range(R) if j != r])
            seen[rows.start:rows.stop, k_glob] += 1
        want = ((torch.arange(N)[None, :] <= pos[r][:, None]) if causal
                else torch.ones(n, N, dtype=torch.bool)).long()
        assert torch.equal(seen, want), (r, seen, want)


def test_block_kernel_names_and_gqa_blocks_match_expanded_heads():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 16, 16, generator=gen)
    k, v = (torch.randn(1, 2, 16, 16, generator=gen) for _ in range(2))
    assert ring.block_kernel(q) == "torch" and ring.block_kernel(q.double()) == "dense"
    assert set(ring.KERNEL_NAMES) >= {"dense", "torch", "triton", "hopper"}
    scale = 0.25
    O, LSE = ring.block_forward(q, k, v, True, scale)
    kx, vx = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    O_x, LSE_x = ring.block_forward(q, kx, vx, True, scale)
    assert torch.allclose(O, O_x) and torch.allclose(LSE, LSE_x)
    dO = torch.randn(q.shape, generator=gen)
    dq, dk, dv = ring.block_backward(dO, q, k, v, O, LSE, True, scale)
    dq_x, dk_x, dv_x = ring.block_backward(dO, q, kx, vx, O, LSE, True, scale)
    assert dk.shape == k.shape and dv.shape == v.shape
    assert torch.allclose(dq, dq_x, atol=1e-6)
    assert torch.allclose(dk, dk_x.view(1, 2, 2, 16, 16).sum(2), atol=1e-5)
    assert torch.allclose(dv, dv_x.view(1, 2, 2, 16, 16).sum(2), atol=1e-5)
