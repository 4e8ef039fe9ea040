"""Grading in a sandbox (being written): see grader.py."""

from __future__ import annotations

_WORKER = None


def in_worker() -> bool:
    """True inside a sandboxed grading worker."""
    return _WORKER is not None
