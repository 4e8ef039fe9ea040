"""Small drawing helpers: who-does-what maps as text, and result plots.

Text maps print the same in a terminal, a notebook and a test log, so they are used for the
"picture before each kernel". ``lines`` draws measured series (time or TFLOP/s against size).
"""

from __future__ import annotations


def thread_map(n: int, block_dim: int) -> str:
    """Which element each thread of a 1D launch owns: ``i = blockIdx.x * blockDim.x + threadIdx.x``.

    One row per block; threads whose ``i >= n`` are shown as ``--`` (they must do nothing).
    """
    blocks = -(-n // block_dim)
    width = max(2, len(str(blocks * block_dim - 1)))
    rows = []
    for b in range(blocks):
        cells = []
        for t in range(block_dim):
            i = b * block_dim + t
            cells.append(str(i).rjust(width) if i < n else "-" * width)
        rows.append(f"block {b}: " + " ".join(cells))
    header = "thread:  " + " ".join(str(t).rjust(width) for t in range(block_dim))
    return "\n".join([header, *rows])


def matrix_map(values, title: str = "", cell_width: int | None = None) -> str:
    """A 2D integer tensor/array printed as a compact grid (e.g. which block owns each element)."""
    rows = [[int(v) for v in row] for row in values.tolist()]
    w = cell_width or max(len(str(v)) for row in rows for v in row)
    lines = [title] if title else []
    lines += [" ".join(str(v).rjust(w) for v in row) for row in rows]
    return "\n".join(lines)


def lines(x, series: dict, *, xlabel: str, ylabel: str, title: str = "",
          logx: bool = False, logy: bool = False, ax=None):
    """Plot several named series against ``x``; returns the matplotlib Axes.

    A linear y axis starts at 0 (bar heights and line heights then compare as ratios); a
    logarithmic one (``logy=True``) cannot.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.8))
    for name, ys in series.items():
        ax.plot(x, ys, marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    else:  # a linear axis starts at zero, so that heights compare as ratios
        ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return ax


# One H100 (SXM5) SM, as NVIDIA's Hopper whitepaper draws it: what sm_diagram labels.
H100_SM = {
    "SMs": 132,
    "partitions": 4,
    "registers per partition": 16_384,  # 32-bit each: 64 KiB
    "FP32 lanes per partition": 32,
    "INT32 lanes per partition": 16,
    "FP64 lanes per partition": 16,
    "max warps per SM": 64,
    "L1 + shared (KiB)": 256,
    "max shared per SM (KiB)": 228,
    "max shared per block (KiB)": 227,
}


def sm_diagram(ax=None, sm: dict = H100_SM):
    """Draw one streaming multiprocessor: 4 sub-partitions over a shared L1 / shared-memory array.

    Each sub-partition has a warp scheduler and dispatch unit, a quarter of the register file,
    FP32, INT32 and FP64 lanes, one tensor core, and LD/ST and SFU units. Returns the Axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 7))
    parts, regs = sm["partitions"], sm["registers per partition"]
    fp32, int32, fp64 = (sm[f"{k} lanes per partition"] for k in ("FP32", "INT32", "FP64"))
    warps_per_scheduler = sm["max warps per SM"] // parts

    def box(x, y, w, h, text, color, size=8.5, weight="normal"):
        ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", lw=0.8))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size,
                weight=weight)

    for p in range(parts):  # 2 x 2, like the whitepaper's drawing
        x0, y0 = 0.5 + (p % 2) * 50, 38 + (1 - p // 2) * 31
        ax.add_patch(Rectangle((x0, y0), 49, 30, facecolor="#f4f4f4", edgecolor="black", lw=1.2))
        ax.text(x0 + 1, y0 + 28.6, f"sub-partition {p}", fontsize=8, va="top", style="italic")
        box(x0 + 1, y0 + 20.5, 47, 5.5, f"warp scheduler + dispatch unit\n"
            f"picks 1 of up to {warps_per_scheduler} warps, 1 instruction / clock", "#ffd9a8")
        box(x0 + 1, y0 + 14, 47, 5.5, f"register file: {regs:,} x 32-bit ({regs * 4 // 1024} KiB)",
            "#c9e4ff")
        box(x0 + 1, y0 + 7.5, 18, 5.5, f"FP32 x {fp32}", "#c8f0c8", weight="bold")
        box(x0 + 20, y0 + 7.5, 13.5, 5.5, f"INT32 x {int32}", "#e6f5e6")
        box(x0 + 34.5, y0 + 7.5, 13.5, 5.5, f"FP64 x {fp64}", "#e6f5e6")
        box(x0 + 1, y0 + 1, 25, 5.5, "tensor core\n(4th gen)", "#f7c6d9", weight="bold")
        box(x0 + 27, y0 + 1, 10, 5.5, "LD/ST", "#eeeeee")
        box(x0 + 38, y0 + 1, 10, 5.5, "SFU", "#eeeeee")

    total, shared = sm["L1 + shared (KiB)"], sm["max shared per SM (KiB)"]
    ax.text(50, 36.5, f"{total} KiB combined L1 data cache / shared memory (shared by all 4)",
            ha="center", va="top", fontsize=9, weight="bold")
    split = 99 * shared / total  # the split is configurable; drawn at its largest shared part
    box(0.5, 23, split, 9, f"shared memory: up to {shared} KiB per SM\n"
        f"(at most {sm['max shared per block (KiB)']} KiB per block)", "#d9ccf2")
    box(0.5 + split, 23, 99 - split, 9, f"L1:\nthe rest\n(\u2265 {total - shared} KiB)",
        "#fff3b0", size=7.5)
    ax.text(50, 21.5, "the split is chosen per kernel: shared 0, 8, 16, 32, 64, 100, 132, 164, "
            f"196 or {shared} KiB, L1 the rest", ha="center", va="top", fontsize=8,
            style="italic")
    threads = sm["max warps per SM"] * 32
    ax.text(50, 16.5, f"{parts} x {fp32} = {parts * fp32} FP32 lanes   ·   {parts} x {regs:,} = "
            f"{parts * regs:,} registers ({parts * regs * 4 // 1024} KiB)\n"
            f"up to {sm['max warps per SM']} warps = {threads:,} threads resident per SM   ·   "
            f"{sm['SMs']} SMs (H100 SXM) = {sm['SMs'] * threads:,} threads in flight",
            ha="center", va="top", fontsize=9)
    ax.set_xlim(0, 100)
    ax.set_ylim(6, 100)
    ax.set_aspect("auto")
    ax.axis("off")
    ax.set_title("One H100 streaming multiprocessor (SM)", fontsize=11)
    return ax
