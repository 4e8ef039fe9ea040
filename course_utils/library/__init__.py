"""What the chapters build (docs/ARCHITECTURE.md): the attention front door (``attention``),
the kernels (``kernels/``: CUDA C++ and Triton), the CPU models of the tensor cores (``mma``)
and of Hopper's shared memory and asynchronous pipeline (``hopper``, ``hopper_pipeline``),
serving (``serving``, ``kv_cache``), the custom operator and the tiny GPT (``ops``,
``tinygpt``), ring attention (``ring`` and its ``ring_*`` parts) and Ulysses (``ulysses``), and
the headline benchmarks (``headlines``). Imports the toolbox and the core, never the grader.
"""
