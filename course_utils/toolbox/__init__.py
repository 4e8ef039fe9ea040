"""The GPU toolbox: tools that know no chapter (docs/ARCHITECTURE.md).

Building CUDA C++ (``cuda``: nvcc through torch's ``load_inline``, NVRTC, ptxas reports, build
errors made readable; its parts are the ``cuda_*`` modules), CUDA C++ run on the CPU
(``cuda_cpu``), timing and FLOP counts (``bench``), the memory-access tracer of the simulator
(``trace``), occupancy (``occupancy``), device facts and profiler counters (``hardware``), the
compile matrix over GPU generations (``portability``) and what this machine can run
(``doctor``). Imports only the core (the package's root modules).
"""
