"""The GPU benchmark of chapter 13 (NCCL, bf16): :func:`benchmark_worker` (cuDNN on one GPU,
the block kernel, the zig-zag ring, the all-gather variant, PyTorch's ``context_parallel``, the
link) and :func:`check_gpu_worker` (bf16 against a float64 GQA reference on the GPU).

Its own room: the recorded GPU numbers' code, which only a machine with GPUs runs.
"""

from __future__ import annotations

import math
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from .ring_allgather import allgather_attention, allgather_attention_backward
from .ring_blocks import (
    _HOPPER_BUILD_ERROR,
    KERNEL_NAMES,
    block_backward,
    block_forward,
    block_kernel,
)
from .ring_comm import TAG_KV, _exchange, _peer
from .ring_layouts import LAYOUTS, positions, shard
from .ring_pass import ring_attention_backward, ring_attention_forward

# =============================================================================================
# Timing and the link
# =============================================================================================


def _fwd_bwd_time(fn, device, repeats):
    """Median seconds over ranks' max: ``fn()`` on every rank, between barriers."""
    fn()  # warm-up (autotuning)
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        t = torch.tensor([time.perf_counter() - t0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return sorted(times)[len(times) // 2]


def _max_over_ranks(value, device):
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _ms_per_call(fn, device, reps):
    """Milliseconds per call of ``fn()``, ``reps`` calls back to back between a barrier and a
    synchronise, the slowest rank's (a distributed step ends with its slowest rank)."""
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return _max_over_ranks((time.perf_counter() - t0) * 1e3 / reps, device)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _every_rank_ok(ok, device):
    t = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item() == 1.0)


def _link_fns(rank, R, nbytes, device):
    """Two transfers of ``nbytes``: rank 0 -> rank 1 alone ("one way"), and every rank to the
    next at once (the ring's hop: with R = 2 both directions of the link)."""
    buf = torch.empty(max(1, nbytes // 2), dtype=torch.bfloat16, device=device)
    into = torch.empty_like(buf)

    def one_way():
        ops = []
        if rank == 0:
            ops = [dist.P2POp(dist.isend, buf, _peer(None, 1))]
        elif rank == 1:
            ops = [dist.P2POp(dist.irecv, into, _peer(None, 0))]
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()

    def ring_hop():
        for w in _exchange([(buf, TAG_KV)], [(into, TAG_KV)], None, (rank + 1) % R,
                           (rank - 1) % R):
            w.wait()

    return one_way, ring_hop


def _sdpa_fwd_bwd(Q, K, V, dO, backends, gqa):
    """SDPA forward + backward, K/V at Hkv heads: ``enable_gqa`` or K/V expanded in the graph."""
    from torch.nn import functional as F
    from torch.nn.attention import sdpa_kernel

    q, k, v = (t.detach().requires_grad_() for t in (Q, K, V))
    group = Q.shape[1] // K.shape[1]
    with sdpa_kernel(backends):
        if group == 1:
            O = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif gqa == "enable_gqa":
            O = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            O = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                               v.repeat_interleave(group, 1), is_causal=True)
    O.backward(dO)
    return O


def _attention_kernels(fn):
    """The CUDA kernels of one call of ``fn`` whose names say attention (profiler), to name the
    backend that ran."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - a name is a note, not a result
        return [f"(profiler failed: {type(error).__name__}: {error})"[:200]]
    words = ("attn", "attention", "fmha", "flash", "cudnn", "sdpa", "sm90", "hopper")
    names = sorted({e.key for e in prof.key_averages()
                    if any(w in e.key.lower() for w in words)})
    return [n[:90] for n in names][:6]


def _gqa_reference(Q, K, V, dO, positions_r):
    """Float64 O, dQ, dK, dV of causal GQA attention on the GPU, rows of one rank kept."""
    group = Q.shape[1] // K.shape[1]
    q, k, v = (t.double().requires_grad_() for t in (Q, K, V))
    kx, vx = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    S = (q @ kx.transpose(-1, -2)) / math.sqrt(Q.shape[-1])
    N = Q.shape[2]
    S = S.masked_fill(~torch.ones(N, N, dtype=torch.bool, device=Q.device).tril(), -math.inf)
    O = torch.softmax(S, -1) @ vx
    O.backward(dO.double())
    rows = positions_r.to(Q.device)
    return {name: t.detach().index_select(2, rows)
            for name, t in (("O", O), ("dQ", q.grad), ("dK", k.grad), ("dV", v.grad))}


def check_gpu_worker(rank, R, cases):
    """Ring (zig-zag and contiguous) and all-gather forward + backward in bf16 on NCCL against
    a float64 GQA reference on the GPU: per case the largest ``|got - float64| / max|float64|``
    of O, dQ, dK, dV over the ranks, and the block kernel that ran."""
    device = torch.device("cuda", rank)
    out = []
    for case in cases:
        B, H, Hkv, N, d = (case[k] for k in ("B", "H", "Hkv", "N", "d"))
        gen = torch.Generator(device=device).manual_seed(case.get("seed", 0))
        Q, dO = (torch.randn(B, H, N, d, generator=gen, device=device).bfloat16()
                 for _ in range(2))
        K, V = (torch.randn(B, Hkv, N, d, generator=gen, device=device).bfloat16()
                for _ in range(2))
        row = {"case": case, "kernel": None, "rel": {}}
        for layout in LAYOUTS:
            want = _gqa_reference(Q, K, V, dO, positions(N, R, layout)[rank])
            q, k, v, do = (shard(t, R, layout)[rank].contiguous() for t in (Q, K, V, dO))
            row["kernel"] = KERNEL_NAMES[block_kernel(q)]
            O, LSE, kv = ring_attention_forward(q, k, v, causal=True, layout=layout,
                                                return_kv=True)
            got = dict(zip(("dQ", "dK", "dV"), ring_attention_backward(
                do, q, k, v, O, LSE, causal=True, layout=layout, kv_last=kv), strict=True), O=O)
            O2, LSE2 = allgather_attention(q, k, v, causal=True, layout=layout)
            got2 = dict(zip(("dQ", "dK", "dV"), allgather_attention_backward(
                do, q, k, v, O2, LSE2, causal=True, layout=layout), strict=True), O=O2)
            for variant, res in ((f"ring {layout}", got), (f"all-gather {layout}", got2)):
                for name in ("O", "dQ", "dK", "dV"):
                    rel = ((res[name].double() - want[name]).abs().max()
                           / want[name].abs().max()).item()
                    row["rel"][f"{variant} {name}"] = _max_over_ranks(rel, device)
            del want
            torch.cuda.empty_cache()
        out.append(row)
    return out


def benchmark_worker(rank, R, shapes, B=1, d=128, rounds=5, reps=2):
    """The GPU benchmark (NCCL, bf16, causal, forward + backward), milliseconds.

    For each ``dict(n, H, Hkv)`` (n tokens per GPU, N = R n): one GPU with cuDNN (SDPA, the
    whole sequence), one GPU with the block kernel (:func:`block_kernel`, chapter 14's on
    Hopper), the zig-zag ring, the all-gather variant (zig-zag), PyTorch's
    ``context_parallel``, and the link (a K/V block one way, and the ring's hop), in ``rounds``
    interleaved rounds of ``reps`` calls each. Returns ``{"rows": [...], ...}`` with per-round
    milliseconds, the backends named, and every error a variant raised.
    """
    gpu = dist.get_backend() == "nccl"  # gloo: the same code on the CPU (a smoke test)
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    torch.manual_seed(0)
    result = {"rows": [], "B": B, "d": d, "rounds": rounds, "reps": reps, "R": R,
              "device": torch.cuda.get_device_name(device) if gpu else "CPU"}
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (R,))
    except Exception as error:  # noqa: BLE001 - recorded, the benchmark goes on
        mesh, result["mesh_error"] = None, f"{type(error).__name__}: {error}"[:300]
    for shape in shapes:
        result["rows"].append(_benchmark_row(rank, R, shape, B, d, rounds, reps, mesh, device))
        torch.cuda.empty_cache()
    return result


def _benchmark_row(rank, R, shape, B, d, rounds, reps, mesh, device):
    from torch.nn.attention import SDPBackend

    n, H, Hkv = shape["n"], shape["H"], shape["Hkv"]
    N, scale = n * R, 1.0 / math.sqrt(d)
    gen = torch.Generator(device=device).manual_seed(n + H)
    Q, dO = (torch.randn(B, H, N, d, generator=gen, device=device).bfloat16() for _ in range(2))
    K, V = (torch.randn(B, Hkv, N, d, generator=gen, device=device).bfloat16()
            for _ in range(2))
    local = [shard(t, R, "zigzag")[rank].contiguous() for t in (Q, K, V, dO)]
    kv_bytes = 2 * B * Hkv * n * d * 2
    row = {"n_per_gpu": n, "N": N, "H": H, "Hkv": Hkv, "kv_block_bytes": kv_bytes,
           "block_kernel": KERNEL_NAMES[block_kernel(local[0])], "errors": {}, "notes": {}}
    if _HOPPER_BUILD_ERROR:
        row["errors"]["chapter 14's kernels"] = _HOPPER_BUILD_ERROR[0]
    fns = {}

    def add(name, fn):  # warm up once on every rank; drop the variant if any rank failed
        try:
            fn()
            _sync(device)
            ok = True
        except Exception as error:  # noqa: BLE001 - recorded, the benchmark goes on
            row["errors"][name] = f"{type(error).__name__}: {error}"[:400]
            ok = False
        if _every_rank_ok(ok, device):
            fns[name] = fn
        return name in fns

    # One GPU, cuDNN, whole sequence: GQA through enable_gqa if cuDNN takes it, else expanded.
    cudnn = [SDPBackend.CUDNN_ATTENTION]
    gqa = "enable_gqa"
    if H != Hkv and not add("cudnn 1 GPU", partial(_sdpa_fwd_bwd, Q, K, V, dO, cudnn, gqa)):
        gqa = "expanded K/V (repeat_interleave in the timed graph)"
        row["errors"]["cudnn 1 GPU (enable_gqa)"] = row["errors"].pop(
            "cudnn 1 GPU", "failed on another rank")
        add("cudnn 1 GPU", partial(_sdpa_fwd_bwd, Q, K, V, dO, cudnn, gqa))
    elif H == Hkv:
        add("cudnn 1 GPU", partial(_sdpa_fwd_bwd, Q, K, V, dO, cudnn, gqa))
    row["notes"]["cudnn gqa"] = "H == Hkv" if H == Hkv else gqa
    if "cudnn 1 GPU" in fns and device.type == "cuda":
        row["notes"]["cudnn kernels"] = _attention_kernels(fns["cudnn 1 GPU"])

    def block_1gpu():
        O, LSE = block_forward(Q, K, V, True, scale)
        block_backward(dO, Q, K, V, O, LSE, True, scale)

    add("block kernel 1 GPU", block_1gpu)

    def ring_zigzag():
        O, LSE, kv = ring_attention_forward(*local[:3], causal=True, layout="zigzag",
                                            return_kv=True)
        ring_attention_backward(local[3], *local[:3], O, LSE, causal=True, layout="zigzag",
                                kv_last=kv)

    def all_gather():
        O, LSE = allgather_attention(*local[:3], causal=True, layout="zigzag")
        allgather_attention_backward(local[3], *local[:3], O, LSE, causal=True,
                                     layout="zigzag")

    add("ring zigzag", ring_zigzag)
    add("all-gather zigzag", all_gather)
    if mesh is not None:
        _add_context_parallel(add, row, mesh, Q, K, V, dO, local, R, rank, device)
    one_way, hop = _link_fns(rank, R, kv_bytes, device)
    add("link one way", one_way)
    add("link ring hop", hop)
    ms = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            ms[name].append(_ms_per_call(fn, device, reps))
    row["ms"] = ms
    row["summary"] = summarize_row(row)
    return row


def _spread(values):
    return {"median": statistics.median(values), "lo": min(values), "hi": max(values)}


def summarize_row(row):
    """What a row's per-round milliseconds say, each as ``{"median", "lo", "hi"}`` over rounds:
    ``ms`` per variant; ``pct_ideal`` (one GPU with cuDNN / (R x variant), round by round) and
    ``pct_ideal_block`` (the same against the block kernel on one GPU); ``vs_cudnn`` (the block
    kernel's speed against cuDNN); ``allgather_over_cp`` (the all-gather's time over
    ``context_parallel``'s); the link in GB/s one way and as the ring's hop. A pure function of
    ``row["ms"]`` (R from the row's N / n), so any recording can be summarised again."""
    from course_utils.toolbox.bench import ratio_summary

    ms, R = row["ms"], row["N"] // row["n_per_gpu"]
    variants = ("ring zigzag", "all-gather zigzag", "torch context_parallel")

    def ideal(bar):
        return {k: {key: (v / R if key != "rounds" else v)
                    for key, v in ratio_summary(ms, k, bar).items()}
                for k in variants if k in ms and bar in ms}

    out = {"ms": {k: _spread(v) for k, v in ms.items() if v},
           "pct_ideal": ideal("cudnn 1 GPU"), "pct_ideal_block": ideal("block kernel 1 GPU")}
    if "block kernel 1 GPU" in ms and "cudnn 1 GPU" in ms:
        out["vs_cudnn"] = {"block kernel 1 GPU": ratio_summary(ms, "block kernel 1 GPU",
                                                               "cudnn 1 GPU")}
    if "all-gather zigzag" in ms and "torch context_parallel" in ms:
        out["allgather_over_cp"] = ratio_summary(ms, "torch context_parallel",
                                                 "all-gather zigzag")
    for key in ("link one way", "link ring hop"):
        if key in ms and row.get("kv_block_bytes"):
            out[key + " GB/s"] = _spread([row["kv_block_bytes"] / t / 1e6 for t in ms[key]])
    return out


def _add_context_parallel(add, row, mesh, Q, K, V, dO, local, R, rank, device):
    """PyTorch's ``context_parallel`` (SDPA under its ring/all-gather dispatch): GQA through
    ``enable_gqa`` if it runs, else K/V expanded to H heads before sharding (named in notes).
    Its O on this rank is compared with the zig-zag ring's (both bf16)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn import functional as F

    group = Q.shape[1] // K.shape[1]
    captured = {}

    def make(expand):
        k, v = (t.repeat_interleave(group, 1) if expand else t for t in (K, V))
        buffers = [t.clone() for t in (Q, k, v, dO)]  # sharded in place, restored after

        def torch_cp():
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):
                q, k, v = (t.detach().requires_grad_() for t in buffers[:3])
                kw = {"enable_gqa": True} if (group > 1 and not expand) else {}
                O = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
                O.backward(buffers[3])
                captured["O"] = O.detach()

        return torch_cp

    name = "torch context_parallel"
    how = "H == Hkv" if group == 1 else "enable_gqa (K/V at Hkv heads)"
    ok = add(name, make(expand=False))
    if not ok and group > 1:
        row["errors"][name + " (enable_gqa)"] = row["errors"].pop(name, "failed on another rank")
        how = "K/V expanded to H heads before sharding (enable_gqa did not run)"
        ok = add(name, make(expand=True))
    row["notes"]["context_parallel gqa"] = how
    if not ok:
        return
    if device.type == "cuda":
        row["notes"]["context_parallel kernels"] = _attention_kernels(make(expand=(
            "expanded" in how)))
    O_ring, _ = ring_attention_forward(*local[:3], causal=True, layout="zigzag")
    O_cp = captured["O"]
    if O_cp.shape == O_ring.shape:
        rel = ((O_cp.double() - O_ring.double()).abs().max() / O_ring.double().abs().max())
        row["notes"]["context_parallel O vs ring zigzag O (max rel)"] = _max_over_ranks(
            rel.item(), device)
    else:
        row["notes"]["context_parallel O shape"] = list(O_cp.shape)
