"""What every part of the results page shares: the recordings, a headline, number formats.

The bottom of :mod:`course_utils.publishing.results`'s parts: :class:`Recordings` (one folder
of ``recorded/*.json``, read once), :class:`Headline` (one chapter's figure with its device,
runs, date and source), the number formats of every table and headline (``x``, ``span``,
``pct``, ``num``, ``sizes``, ``ks``), the nominal HBM bandwidth by device, and the few helpers
that both the headlines and the renderers read (``_profile_part``, ``_from_headline_file``).
Its own room so that the headline modules and the renderers import it and not each other.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ... import paths
from ...recorded import FOLDER
from ...toolbox.hardware import NOMINAL_HBM_TBPS, nominal_hbm_tbps  # noqa: F401 (re-exported)

ROOT = paths.REPO


@dataclass(frozen=True)
class Headline:
    """One chapter's figure: ``text`` names the kernel, the figure and the shapes."""

    text: str
    baseline: str  # what the figure is measured against
    device: str  # e.g. "H100 80GB HBM3" or "2 x H100 80GB HBM3"
    runs: str  # "one run", "3 seeds", "medians of 5 interleaved rounds"
    date: str
    source: str  # the recording(s) it comes from

    def cell(self) -> str:
        return f"{self.text} ({self.device}, {self.runs}, {self.date}; `{self.source}`)"


class Recordings:
    """The recordings of one folder, read once (``folder`` defaults to the package's)."""

    def __init__(self, folder: Path | str = FOLDER):
        self.folder = Path(folder)
        self._cache: dict[str, dict] = {}

    def names(self) -> list[str]:
        return sorted(p.stem for p in self.folder.glob("*.json"))

    def has(self, name: str) -> bool:
        return (self.folder / f"{name}.json").exists()

    def payload(self, name: str) -> dict:
        if name not in self._cache:
            path = self.folder / f"{name}.json"
            self._cache[name] = json.loads(path.read_text(encoding="utf-8"))
        return self._cache[name]

    def data(self, name: str) -> dict:
        return self.payload(name)["data"]

    def device(self, name: str) -> str:
        return short_device(self.payload(name)["environment"]["device"])

    def date(self, name: str) -> str:
        return self.payload(name)["environment"]["date"]


def short_device(name: str) -> str:
    return name.removeprefix("NVIDIA ").strip()


# ---------------------------------------------------------------- number formats

def x(ratio: float) -> str:
    """A speed ratio: ``0.71x``."""
    return f"{ratio:.2f}x"


def span(values, fmt: Callable[[float], str] = x) -> str:
    """``lo-hi`` of ``values`` in ``fmt`` (one value when they round alike)."""
    lo, hi = fmt(min(values)), fmt(max(values))
    if lo == hi:
        return lo
    if fmt is x:
        return f"{lo[:-1]}-{hi}"
    return f"{lo}-{hi}"


def pct(value: float) -> str:
    return f"{value:.0%}"


def num(value) -> str:
    """A measured value in a table: ints as they are, floats to about three digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        a = abs(value)
        if a == 0:
            return "0"
        if a >= 100:
            return f"{value:.0f}"
        if a >= 10:
            return f"{value:.1f}"
        if a >= 0.01:
            return f"{value:.3g}"
        return f"{value:.3g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def sizes(values) -> str:
    v = sorted(set(values))
    return f"{v[0]}-{v[-1]}" if len(v) > 1 else str(v[0])


def ks(values) -> str:
    """Sequence lengths in k (1024 -> 1k)."""
    out = sorted(set(values))
    word = (lambda n: f"{n // 1024}k" if n % 1024 == 0 else str(n))
    return f"{word(out[0])}-{word(out[-1])}" if len(out) > 1 else word(out[0])


SDPA_NAMES = {"sdpa cudnn": "cuDNN", "sdpa flash": "SDPA flash",
              "sdpa efficient": "SDPA efficient"}


def _rounds_text(s: dict, fmt: Callable[[float], str] = x) -> str:
    """``0.96x (0.95-0.97)``: a ``ratio_summary``'s median and its lowest and highest round."""
    return f"{fmt(s['median'])} ({span([s['lo'], s['hi']], fmt)})"

def _tbps(nbytes: float, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e12


# ---------------------------------------------------------------- shared by headlines and renderers

def _per_head_dim(rows: list[dict], value: Callable[[dict], float | None]) -> str:
    """``d = 64 0.96-1.13x, d = 128 0.99-1.11x``: the span of ``value(row)`` over each head dim's
    rows, head dims in order (a row whose value is None is left out)."""
    parts = []
    for D in sorted({r["D"] for r in rows}):
        values = [v for r in rows if r["D"] == D and (v := value(r)) is not None]
        parts.append(f"d = {D} {span(values)}")
    return ", ".join(parts)


def _from_headline_file(rec: Recordings, name: str, what: str, baseline: str,
                        label: str) -> Headline:
    """A headline from ``recorded/NN_headline.json`` (schema in
    :mod:`course_utils.library.headlines`)."""
    d = rec.data(name)
    rows = [r for r in d["rows"] if r["mode"] == "fwd"]
    per_d = _per_head_dim(rows, lambda r: r["ratio"][baseline]["median"])
    lo = min(r["ratio"][baseline]["lo"] for r in rows)
    hi = max(r["ratio"][baseline]["hi"] for r in rows)
    rounds = sorted({r["ratio"][baseline]["rounds"] for r in d["rows"]})
    rounds_text = "/".join(str(n) for n in rounds)
    train = [r["ratio"][baseline]["median"] for r in d["rows"] if r["mode"] == "fwd+bwd"]
    also = f"; forward + backward {span(train)}" if train else ""
    return Headline(
        f"{what} against {label}, medians of the rounds per shape: {per_d} "
        f"(single rounds {span([lo, hi])}; {len(rows)} shapes, {d['dtype']}, "
        f"N {ks(r['N'] for r in rows)}, causal and not){also}",
        label, short_device(d["device"]), f"{rounds_text} interleaved rounds",
        rec.date(name), name)

def _profile_part(d) -> dict | None:
    """The profile of a ``12_profile`` recording with its rows as a dict by name: the data
    itself (rows a list, each with its ``name``) or, in older recordings, ``data["profile"]``
    (rows a dict); None for other data."""
    if not isinstance(d, dict):
        return None
    p = d.get("profile", d)
    rows = p.get("rows") if isinstance(p, dict) else None
    if isinstance(rows, list) and rows and all(isinstance(r, dict) and "name" in r
                                               and "step_ms" in r for r in rows):
        return {**p, "rows": {r["name"]: r for r in rows}}
    if isinstance(rows, dict) and rows and "profile" in d:
        return p
    return None
