"""Where a class's grades live while it is graded: one file per submission, written atomically.

``OUT/results/<key>.json`` holds one notebook's report with what it was graded from: the
notebook's path, the SHA-256 of its bytes and the course's version (a hash of the grading code).
A rerun finds a submission's file, compares both hashes and skips it when they match: an
interrupted run loses nothing it finished, an edited notebook or a changed grader is graded
again. Files are written beside their final name and renamed over it, so a reader (or a crash)
sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

from ... import paths

RESULTS = "results"  # the folder of per-submission files, inside the output folder


@lru_cache(maxsize=1)
def course_version() -> str:
    """A hash of every source file of the package (Python, CUDA, headers): two runs with the
    same value graded with the same code, cases and references."""
    h = hashlib.sha256()
    root = paths.PACKAGE
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".cu", ".h", ".cuh") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(root)).encode())
            h.update(b"\0")
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()[:16]


def fingerprint(path) -> str:
    """SHA-256 of a file's bytes, read in blocks (a large notebook is never held whole)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` beside ``path`` and rename it over: readers see old or new, never half."""
    from ..grader import atomic_text

    with atomic_text(path) as f:
        f.write(text)


class ResultStore:
    """The per-submission files of one output folder."""

    def __init__(self, out):
        self.folder = Path(out) / RESULTS
        self.folder.mkdir(parents=True, exist_ok=True)

    def _file(self, notebook: str) -> Path:
        key = hashlib.sha256(str(Path(notebook).resolve()).encode()).hexdigest()[:24]
        return self.folder / f"{key}.json"

    def done(self, notebook: str, sha256: str, version: str) -> dict | None:
        """The stored report of ``notebook`` if it was graded from these bytes by this version
        of the course; else None (never graded, edited since, or graded by other code)."""
        try:
            entry = json.loads(self._file(notebook).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or entry.get("sha256") != sha256 or \
                entry.get("course_version") != version or "report" not in entry:
            return None
        return entry["report"]

    def save(self, notebook: str, sha256: str, version: str, report: dict,
             seconds: float, where: dict | None = None) -> None:
        entry = {"notebook": str(notebook), "sha256": sha256, "course_version": version,
                 "seconds": round(seconds, 3), "where": where or {}, "report": report}
        write_atomic(self._file(notebook), json.dumps(entry, ensure_ascii=False))
