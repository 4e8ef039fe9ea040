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
