"""Chapter 11's decode headline: split-KV decoding against SDPA, recorded as ``11_decode_headline``.

Decoding reads the whole KV cache once per step and does little else, so its figure is bytes per
second (K and V of the visible keys plus q and O, over the step's time) against the GPU's nominal
HBM bandwidth and against a lean read of 2 GiB in the same run (``read_tbps``: a Triton kernel, one
program per 16 KB block, load + sum, one float stored; ``copy_tbps`` is a plain ``copy_``, which
reads and writes every byte, so it counts both and is no ceiling for a read-only kernel).

* **timing** on a GPU: a CUDA graph of :data:`STEPS` steps cycling over copies of the caches (at
  least 200 MB in all: consecutive steps miss L2), per round the median of 3 replays, the rounds
  interleaved across the implementations of a shape; in Triton's interpreter (``small=True``, CPU
  mode) one ``time.perf_counter`` call per round;
* **the kernel** (:mod:`.kernels.flash_decoding`) is fixed before the rows: a sweep of
  ``(BLOCK_N, warps, stages)``, programs per SM and merge (``kernel``; ``pdl``, the merge kernel
  with programmatic dependent launch; ``fused``) at five shapes, and each row takes the fastest at
  the same Hkv and the nearest swept B and length (``rule``, ``chosen``);
* **baselines**: SDPA's flash, efficient and cuDNN backends with ``enable_gqa`` (a backend that
  refuses goes to the row's ``errors``), with no mask among Lq > 1 new tokens (``sdpa_note``); on
  the skewed batch, a per-sequence plan against one split count;
* **correctness first**: each implementation's O against ``serving.reference_decode`` (float64)
  on the first two sequences; a wrong one goes to ``correctness_failures`` and is not timed.

    python -m course_utils.library.decode_headline   # on a GPU; COURSE_RECORD=1 saves
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import triton
import triton.language as tl

from .. import recorded, runtime
from ..toolbox.hardware import nominal_hbm_tbps
from . import serving

NAME = "11_decode_headline"
STEPS, REPLAYS, L2_MISS_BYTES = 20, 3, 200_000_000
SDPA = ("sdpa flash", "sdpa efficient", "sdpa cudnn")
MERGES = ("kernel", "pdl", "fused")
SDPA_NOTE = "SDPA timed with enable_gqa and no mask among the Lq new tokens"
RULE = "config: the sweep's fastest at the same Hkv and nearest swept B and length"
FULL = dict(Hq=32, d=128, long=131072, short=32768, Bs=(1, 4, 16, 64), hkv=8, hkv2=4, big=16,
            page=256, skew=1024, per_sm=(1, 2, 3), configs=(
                (32, 2, 3), (32, 4, 3), (64, 2, 3), (64, 4, 3), (64, 4, 4), (128, 4, 2),
                (128, 4, 3), (128, 8, 3)))
SMALL = dict(Hq=8, d=16, long=256, short=128, Bs=(1, 2), hkv=2, hkv2=1, big=2, page=16, skew=32,
             per_sm=(1,), configs=((16, 4, 1), (32, 4, 1)))

__all__ = ["NAME", "measure"]


@triton.jit
def _lean_read(X, OUT, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + pid, tl.sum(tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32), 0))


def _timer(fns, gpu):
    """``(time() -> us per step, how)`` of the steps ``fns``, called in turn."""
    if not gpu:
        def once():
            t = time.perf_counter()
            fns[0]()
            return (time.perf_counter() - t) * 1e6
        return once, "perf_counter"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:  # warm-up and compilation outside the graph
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(STEPS):
            fns[i % len(fns)]()

    def replays():
        ts = []
        for _ in range(REPLAYS):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            graph.replay()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / STEPS)
        return statistics.median(ts)
    return replays, "cuda graph"


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip() or '-').splitlines()[0][:200]}"


def _interleaved(impls: dict, rounds: int, gpu: bool):
    """``(us, how, errors)``: per impl one time per round, the rounds interleaved; an impl that
    raises goes to ``errors`` (``"Type: message"``)."""
    timers, how, errors = {}, {}, {}
    for name, fns in impls.items():
        try:
            timers[name], how[name] = _timer(fns, gpu)
        except Exception as e:
            errors[name] = _why(e)
    us = {name: [] for name in timers}
    for _ in range(rounds):
        for name, t in list(timers.items()):
            try:
                us[name].append(t())
            except Exception as e:  # on a CPU the first call is the first round
                errors[name] = _why(e)
                del timers[name], us[name], how[name]
    return us, how, errors


def _bandwidth(gpu, dtype):
    """(lean read, copy_ read + write) in TB/s, of 2 GiB on a GPU (16 KB in the interpreter)."""
    dev, size = runtime.device(), torch.empty((), dtype=dtype).element_size()
    n, block = ((2 << 30) if gpu else 16384) // size, 16384 // size
    xs = [torch.randn(n, device=dev, dtype=dtype) for _ in range(2)]
    sink = torch.empty(triton.cdiv(n, block), device=dev)
    reads = [lambda x=x: _lean_read[(triton.cdiv(n, block),)](x, sink, n, BLOCK=block,
                                                               num_warps=8) for x in xs]
    us = _interleaved({"read": reads, "copy": [lambda: xs[1].copy_(xs[0])]}, 3, gpu)[0]
    return n * size / statistics.median(us["read"]) / 1e6, \
        2 * n * size / statistics.median(us["copy"]) / 1e6


class _Shape:
    """One decode shape: inputs, cache copies enough to miss L2, the float64 reference, impls."""

    def __init__(self, s, B, Hkv, N, gpu, dtype, *, Lq=1, lens=None, paged=False):
        dev, seed = runtime.device(), B * 1000 + Hkv * 10 + Lq
        if gpu:
            torch.cuda.empty_cache()  # the previous shape's caches
        g = torch.Generator(device=dev).manual_seed(seed)
        self.B, self.Hkv, self.Lq, self.Hq, self.d = B, Hkv, Lq, s["Hq"], s["d"]
        self.lens, self.paged, self.table = list(lens or [N] * B), paged, None
        size = torch.empty((), dtype=dtype).element_size()
        self.bytes = 2 * size * self.d * (sum(self.lens) * Hkv + B * Lq * self.Hq)
        self.q = torch.randn((B, self.Hq, self.d) if Lq == 1 else (B, Lq, self.Hq, self.d),
                             generator=g, device=dev, dtype=dtype)
        k, v = (torch.randn(B, N, Hkv, self.d, generator=g, device=dev, dtype=dtype)
                for _ in range(2))
        self.seqlens = torch.tensor(self.lens, dtype=torch.int32, device=dev)
        first = slice(0, min(2, B))  # the reference's sequences, from the dense caches
        self.ref = serving.reference_decode(self.q[first].double(), k[first].double(),
                                            v[first].double(), self.seqlens[first])[0]
        if paged:
            k, v, self.table = serving.paginate(k, v, self.lens, s["page"],
                                                generator=torch.Generator().manual_seed(seed))
        copies = max(1, -(-L2_MISS_BYTES // self.bytes)) if gpu else 1
        self.kv = [(k, v)] + [(k.clone(), v.clone()) for _ in range(copies - 1)]

    def ours(self, fd, cfg, **kw):
        config, merge = tuple(cfg["config"]), cfg["merge"]
        return [lambda k=k, v=v: fd.decode_attention(
            self.q, k, v, self.seqlens, block_table=self.table, config=config,
            merge="fused" if merge == "fused" else "kernel", pdl=merge == "pdl",
            check_values=False, **kw)[0] for k, v in self.kv]

    def sdpa(self, name):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        be = {"sdpa flash": SDPBackend.FLASH_ATTENTION, "sdpa cudnn": SDPBackend.CUDNN_ATTENTION,
              "sdpa efficient": SDPBackend.EFFICIENT_ATTENTION}[name]
        q = self.q[:, :, None] if self.Lq == 1 else self.q.transpose(1, 2)  # (B, Hq, Lq, d)

        def run(k, v):
            with sdpa_kernel(be):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
            return o[:, :, 0] if self.Lq == 1 else o.transpose(1, 2)
        return [lambda k=k, v=v: run(k, v) for k, v in self.kv]

    def time(self, impls, rounds, gpu, failures, label):
        """Check each impl against the reference, then time the right ones: (us, how, errors).
        SDPA with Lq > 1 (no mask among the new tokens) is checked on the last token only."""
        good = {}
        for name, fns in impls.items():
            try:
                o = fns[0]()[: self.ref.shape[0]].double()
            except Exception:  # the timing records the error
                good[name] = fns
                continue
            o, ref = (o[:, -1], self.ref[:, -1]) if name in SDPA and self.Lq > 1 else (o, self.ref)
            tol = 1e-3 if self.q.dtype == torch.float32 else 2e-2
            err = (o - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
            if err <= tol:
                good[name] = fns
            else:
                failures.append(f"{label}, {name}: max error {err:.2e} of max |O| (> {tol:g})")
        return _interleaved(good, rounds, gpu)


def _sweep(fd, s, rounds, gpu, dtype, failures, progress):
    entries, chosen, default = [], {}, tuple(fd.decode_config(dtype))
    file_merge = "pdl" if fd.decode_pdl(runtime.device()) else "kernel"
    for B, Hkv, N in [(1, s["hkv"], s["long"]), (1, s["hkv"], s["short"]),
                      (1, s["hkv2"], s["long"]), (1, s["hkv2"], s["short"]),
                      (s["big"], s["hkv"], s["long"])]:
        sh, impls, meta = _Shape(s, B, Hkv, N, gpu, dtype), {}, {}
        for config in s["configs"]:
            seen = set()
            for per_sm in s["per_sm"]:
                splits = fd.default_num_splits(B, Hkv, N, block_n=config[0], programs_per_sm=per_sm)
                for merge in MERGES if splits not in seen else ():
                    key = f"{config} {merge} {per_sm}"
                    cfg = {"config": list(config), "merge": merge, "programs_per_sm": per_sm}
                    impls[key] = sh.ours(fd, cfg, num_splits=splits)
                    meta[key] = dict(cfg, num_splits=splits, file_default=(
                        config == default and per_sm == fd.decode_programs_per_sm()
                        and merge == file_merge))
                seen.add(splits)
        us = sh.time(impls, rounds, gpu, failures, f"sweep B={B} Hkv={Hkv} N={N}")[0]
        mine = [{"B": B, "Hkv": Hkv, "N": N, **meta[k], "us": statistics.median(v),
                 "tbps": sh.bytes / statistics.median(v) / 1e6} for k, v in us.items()]
        entries += mine
        if mine:
            best = min(mine, key=lambda e: e["us"])
            chosen[f"B={B},Hkv={Hkv},N={N}"] = {k: best[k] for k in
                                                ("config", "programs_per_sm", "merge")}
        if progress:
            print(f"sweep B={B} Hkv={Hkv} N={N}: {len(mine)} configurations timed", flush=True)
    return entries, chosen


def _config_for(fd, chosen, B, Hkv, N, dtype):
    """The configuration of the nearest swept shape at the same Hkv, and where it came from."""
    swept = [tuple(int(x.split("=")[1]) for x in k.split(",")) for k in chosen]
    same = [t for t in swept if t[1] == Hkv] or swept
    if not same:
        merge = "pdl" if fd.decode_pdl(runtime.device()) else "kernel"
        return ({"config": list(fd.decode_config(dtype, B * Hkv)), "merge": merge,
                 "programs_per_sm": fd.decode_programs_per_sm()}, "file default")
    b = min({t[0] for t in same}, key=lambda x: (abs(math.log(x / B)), x))
    b, hkv, n = min((t for t in same if t[0] == b), key=lambda t: (abs(math.log(t[2] / N)), t))
    return dict(chosen[f"B={b},Hkv={hkv},N={n}"]), f"sweep B={b} N={n}"


def _row(fd, s, label, B, Hkv, N, rounds, gpu, dtype, chosen, failures, *, Lq=1, lens=None,
         paged=False):
    from ..toolbox.bench import ratio_summary

    sh = _Shape(s, B, Hkv, N, gpu, dtype, Lq=Lq, lens=lens, paged=paged)
    cfg, origin = _config_for(fd, chosen, B, Hkv, N, dtype)
    splits = fd.default_num_splits(B, Hkv, N, block_n=cfg["config"][0], paged=paged,
                                   programs_per_sm=cfg["programs_per_sm"])
    row = {"label": label, "B": B, "lens": lens, "N": N, "Hq": sh.Hq, "Hkv": Hkv, "d": sh.d,
           "Lq": Lq, "paged": paged, "bytes": sh.bytes}
    impls = {"ours": sh.ours(fd, cfg, num_splits=splits)}
    if lens:
        plan = fd.decode_plan(sh.lens, Hkv, new_tokens=Lq, block_n=cfg["config"][0],
                              programs_per_sm=cfg["programs_per_sm"]
                              * (fd.PAGED_PROGRAMS_PER_SM if paged else 1))
        impls = {"ours": sh.ours(fd, cfg, plan=plan), "one split count": impls["ours"]}
    elif not paged:
        impls.update({name: sh.sdpa(name) for name in SDPA})
    us, how, errors = sh.time(impls, rounds, gpu, failures, label)
    row.update(us=us, errors=errors, how=how, config=cfg["config"],
               programs_per_sm=cfg["programs_per_sm"], merge=cfg["merge"], config_from=origin)
    if lens:
        row["plan_splits"] = list(plan.splits)
    row["num_splits"] = splits
    row["median_us"] = {k: statistics.median(v) for k, v in us.items()}
    if lens and "ours" in us and "one split count" in us:
        row["vs_one_split_count"] = ratio_summary(us, "ours", "one split count")
    sdpa = [k for k in SDPA if k in us]
    if sdpa and "ours" in us:
        row["sdpa_best"] = min(sdpa, key=lambda k: row["median_us"][k])
        row["vs_sdpa_best"] = ratio_summary(us, "ours", row["sdpa_best"])
    return row


def _rows(s):
    """(label, B, Hkv, N, options) of every row, in the recording's order."""
    L, S, hkv, sk = s["long"], s["short"], s["hkv"], s["skew"]
    k = (lambda n: f"{n // 1024}k") if L >= 1024 else str
    out = [(f"skewed B=4 ({', '.join(map(k, [L, sk, sk, sk]))}) Hkv={hkv} {kind}, plan", 4, hkv,
            L, {"lens": [L, sk, sk, sk], "paged": kind == "paged"}) for kind in ("dense", "paged")]
    for N in (L, S):
        out += [(f"decode B={B} N={k(N)} Hkv={hkv} dense", B, hkv, N, {}) for B in s["Bs"]]
        out.append((f"decode B=1 N={k(N)} Hkv={s['hkv2']} dense", 1, s["hkv2"], N, {}))
    out += [(f"decode B={B} N={k(L)} Hkv={hkv} paged", B, hkv, L, {"paged": True})
            for B in (1, s["big"])]
    for B, N in ((1, L), (s["big"], S)):
        out += [(f"decode Lq={q} B={B} N={k(N)} Hkv={hkv} dense", B, hkv, N, {"Lq": q})
                for q in (1, 2, 4, 8)]
    return out


def measure(*, rounds=7, sweep=True, save=True, small=False, progress=False) -> dict:
    """Sweep, check and time chapter 11's decode kernel against SDPA (the module's text);
    ``small``: tiny shapes (Triton's interpreter). Saved as :data:`NAME` while recording."""
    from .kernels import flash_decoding as fd

    t0, gpu = time.perf_counter(), runtime.on_gpu()
    s, dtype = (SMALL if small or not gpu else FULL), (torch.bfloat16 if gpu else torch.float32)
    device = torch.cuda.get_device_name(0) if gpu else "CPU"
    read, copy = _bandwidth(gpu, dtype)
    failures: list[str] = []
    entries, chosen = _sweep(fd, s, rounds, gpu, dtype, failures, progress) if sweep else ([], {})
    rows = []
    for label, B, Hkv, N, opts in _rows(s):
        rows.append(_row(fd, s, label, B, Hkv, N, rounds, gpu, dtype, chosen, failures, **opts))
        if progress:
            print(label, {k: round(v, 1) for k, v in rows[-1]["median_us"].items()}, flush=True)
    data = {"device": device,
            "sms": torch.cuda.get_device_properties(0).multi_processor_count if gpu else None,
            "dtype": str(dtype), "Hq": s["Hq"], "d": s["d"], "rounds": rounds,
            "timing": ("CUDA graph of many calls per timing (caches copied so that consecutive "
                       f"calls miss L2); median of {REPLAYS} replays per round" if gpu else
                       "one call per round, time.perf_counter (Triton's interpreter)"),
            "copy_tbps": copy, "read_tbps": read,
            "nominal_tbps": nominal_hbm_tbps(device),
            "sdpa_note": SDPA_NOTE, "rule": RULE if sweep else "config: decode_config's default",
            "chosen": chosen, "correctness_failures": failures, "sweep": entries, "rows": rows,
            "seconds": time.perf_counter() - t0}
    if save:
        recorded.save(NAME, data)
    return data


if __name__ == "__main__":
    runtime.setup()
    measure(progress=True)
