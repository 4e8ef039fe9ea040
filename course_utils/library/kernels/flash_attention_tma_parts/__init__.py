"""The parts of chapter 14's Triton kernels (``kernels.flash_attention_tma``).

``configs`` (the fixed tiles of every kernel, their checks, the TMA descriptors) at the bottom;
``forward`` (rungs 1-3: the TMA forward, one tile or a persistent grid), ``fp8`` (e4m3 inputs
with per-block scales) and ``backward`` (dK/dV and dQ with descriptors) above it. Import them
through ``flash_attention_tma``, which re-exports every name and holds the autograd Function.
This ``__init__`` imports nothing, so the parts can import each other without a circle.
"""
