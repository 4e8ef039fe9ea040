"""Chapter 14, Hopper: the consumer's overlapped loop (graded exercise; filled in by issue 40)."""

from __future__ import annotations

__all__: list[str] = []
