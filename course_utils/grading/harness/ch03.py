"""Chapter 03's student-side helper: counting a kernel's global reads and writes.

``03.fused_kernel`` must read each ``x[i]`` once and write each ``y[i]`` once; the grader's case
(``course_utils.grading.specs.ch03``) counts them with ``count_accesses`` through ``grader.invoke``,
in the worker, on data only.
"""

from __future__ import annotations

from .ch02 import count_accesses

__all__ = ["count_accesses"]
