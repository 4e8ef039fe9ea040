"""Chapter 13's shared helpers: registering a case, and reading a returned tuple.

Its own room so that ``ch13`` and ``ch13_ring`` share them without an import circle: both
import this bottom module.
"""

from __future__ import annotations

from ..checks import CheckFailure


def _add(exercise, name, make, *args, hidden=False, **kwargs):
    """Register the case ``make(name, *args, **kwargs)`` under ``name``."""
    exercise.case(name, hidden=hidden)(make(name, *args, **kwargs))


def _tuple(result, case, names):
    if not isinstance(result, (tuple, list)) or len(result) != len(names):
        raise CheckFailure(case, f"expected the tuple ({', '.join(names)}), got "
                           f"{type(result).__name__}", f"return {', '.join(names)}")
    return result
