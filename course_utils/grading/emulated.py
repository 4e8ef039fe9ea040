"""The grader's side of a CUDA C++ case without a GPU: the kernel runs on the CPU emulation.

:mod:`course_utils.toolbox.cuda_cpu` compiles a kernel's body with g++ and runs its threads as
fibers; :func:`run_case` runs that launch where the candidate lives (through :func:`invoke` and
:func:`course_utils.grading.harness.cuda_cpu_launch.launch`) and turns what the emulation found
(a race, a barrier not every thread reaches, an access out of bounds, a hang) into a
:class:`CheckFailure` with a hint.
"""

from __future__ import annotations

from ..toolbox import cuda_cpu
from .checks import CheckFailure, brief
from .types import invoke


def run_case(candidate, kernel: str, grid, block, *args, case: str, hints=None,
             timeout: float = cuda_cpu.DEFAULT_TIMEOUT_S) -> dict:
    """The grader's side of an emulated launch: run it where the candidate lives (through
    ``grader.invoke`` and :func:`course_utils.grading.harness.cuda_cpu_launch.launch`, which runs it
    twice, in two thread orders) and turn what went wrong into a CheckFailure for ``case``
    with the emulator's message and a hint (``hints[kind]``, else :data:`cuda_cpu.HINTS`). Returns
    the report of a launch that ran (with its ``shared_bytes`` and ``barriers``)."""
    report = invoke(candidate, "course_utils.grading.harness.cuda_cpu_launch:launch", kernel, grid,
                    block, *args, timeout=timeout)  # fmt: skip
    if not isinstance(report, dict) or not isinstance(report.get("kind"), str):
        raise CheckFailure(case, f"the CPU launch returned {brief(report)}, not its report", None)
    kind = report["kind"]
    if kind:
        hint = (hints or {}).get(kind) or cuda_cpu.HINTS.get(kind)
        raise CheckFailure(case, f"on the CPU emulation ({kind}): {report.get('message', '')}",
                           hint)  # fmt: skip
    return report
