"""The parts of chapter 09's Triton FlashAttention-2 (``kernels.flash_attention_triton``).

``tiles`` (constants, ``tile_dot``, ``batch_head``, the causal splits) at the bottom; ``kernels``
(the ``@triton.jit`` forward, D, dK/dV and dQ kernels and their inner loops); ``configs`` (search
spaces, pruning, autotuning, launches); ``checks`` (input and output checks, the causal argument,
the GPU's capability). Import them through ``flash_attention_triton``, which re-exports every
name and holds the host functions and the autograd Function. This ``__init__`` imports nothing,
so the parts can import each other without a circle.
"""
