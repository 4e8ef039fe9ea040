"""Chapter 07's student-side helpers and the constants its notebooks import.

The grader's cases (``course_utils.grading.specs.ch07``) call these through ``grader.invoke``; they
run where the candidate lives (the sandboxed worker while grading), take and return data only, and
never see an expected value.
"""

from __future__ import annotations

from ... import paths

ONLINE_D = 16  # head dim of 07.online_update's kernel (its local arrays are sized by it)
ONLINE_BR = 16  # query rows per block = threads per block
ONLINE_BC = 8  # keys per K/V tile

KERNEL_PATH = paths.KERNELS / "flash_attention_forward.cu"

COMBINE_KERNEL = "combine_splits"  # 07.combine_splits: the kernel's name in the student's source


def largest_tensor(fn, Q, K, V, kwargs):
    """Run ``fn(Q, K, V, **kwargs)``; return ``(O, LSE, largest)``.

    ``largest`` is the largest tensor created during the call (see
    :func:`harness.largest_created`): a forward pass that materialises the Nq x Nk score matrix
    shows it here, whatever torch route built it.
    """
    from . import largest_created

    result, largest = largest_created(fn, Q, K, V, **kwargs)
    O, LSE = result if isinstance(result, (tuple, list)) and len(result) == 2 else (result, None)
    return O, LSE, largest


_compiled: dict = {}


def run_combine(source, O_parts, LSE_parts, O, LSE):
    """Compile the student's ``combine_splits`` (NVRTC) and launch it; return ``(O, LSE)``.

    ``source`` is the candidate itself: the CUDA source, or a function returning it.
    ``O_parts`` is ``(S, R, d)``, ``LSE_parts`` ``(S, R)`` (float32, CUDA); ``O`` ``(R, d)`` and
    ``LSE`` ``(R,)`` are the (poisoned) outputs. Launch: one block per row, ``d`` threads.
    """
    import torch

    from ...toolbox.cuda import compile_kernel
    from . import source_text

    text = source_text(source)
    if text not in _compiled:  # one NVRTC build per source, whatever the number of cases
        _compiled[text] = compile_kernel(text, COMBINE_KERNEL)
    kernel = _compiled[text]
    n_splits, rows, d = O_parts.shape
    kernel((rows,), (d,), O_parts, LSE_parts, O, LSE, n_splits, rows, d)
    torch.cuda.synchronize()
    return O, LSE
