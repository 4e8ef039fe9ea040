"""Occupancy: how many blocks of a kernel fit on one SM at once, and what stops more.

A block stays on its SM from its first instruction to its last, holding its registers, its
shared memory and its warp slots the whole time. So the number of blocks an SM can hold at once
is the smallest of four limits: registers, shared memory, warps (threads) and blocks.

``active_blocks(registers, shared_bytes, threads)`` computes it in pure Python (no GPU) for the
GPUs students meet: the T4 and RTX 20 (``SM75``), the A100 (``SM80``), RTX 30 / A10 (``SM86``),
RTX 40 / L4 (``SM89``) and the H100 (``SM90``), and says which limit binds; ``arch_limits`` finds
the limits from a name such as ``"sm_86"`` or a compute capability such as ``(8, 6)``.
``driver_active_blocks`` asks the CUDA driver the same question about a compiled kernel (GPU
only). The FlashAttention budget helpers (``fa_registers_per_thread``, ``fa_shared_bytes``) are
the by-hand arithmetic of chapter 06.

Sources of the numbers (all checked against NVIDIA's own material):
- CUDA C++ Programming Guide, "Technical Specifications per Compute Capability": 64K 32-bit
  registers per SM and per block, at most 255 registers per thread and 1024 threads per block
  on all five. Resident warps / blocks per SM: 32 / 16 (7.5), 64 / 32 (8.0 and 9.0), 48 / 16
  (8.6), 48 / 24 (8.9). Shared memory per SM and the most one block may opt into (above the
  default 48 KB): 64 / 64 KB (7.5), 164 / 163 KB (8.0), 100 / 99 KB (8.6 and 8.9), 228 / 227 KB
  (9.0); the driver reserves 1 KB of shared memory per block from 8.0 on (none on 7.5).
- ``cuda_occupancy.h`` (the header behind the CUDA occupancy calculator): registers are
  allocated per warp in units of 256 (so per-thread counts round up to a multiple of 8), in 4
  sub-partitions of the register file, each holding whole warps; a block must also fit the
  per-block limit of 64K registers with its warps rounded up to a multiple of 4; shared memory
  is allocated in units of 256 bytes on 7.x and 128 bytes on 8.x and 9.0, the reserved 1 KB
  included.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ARCHS",
    "SM75",
    "SM80",
    "SM86",
    "SM89",
    "SM90",
    "ArchLimits",
    "Occupancy",
    "active_blocks",
    "arch_limits",
    "driver_active_blocks",
    "driver_resources",
    "fa_registers_per_thread",
    "fa_shared_bytes",
]


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM and per-block limits of one GPU architecture (sizes in bytes)."""

    name: str
    registers_per_sm: int = 65536  # 64K 32-bit registers
    registers_per_block: int = 65536
    max_registers_per_thread: int = 255
    register_unit: int = 256  # registers are handed to a warp in units of 256 (8 per thread)
    register_partitions: int = 4  # the register file is split into 4 quarters, one per scheduler
    warp_size: int = 32
    max_warps_per_sm: int = 64  # 2048 threads
    max_threads_per_block: int = 1024
    max_blocks_per_sm: int = 32
    shared_per_sm: int = 228 * 1024
    max_shared_per_block: int = 227 * 1024  # with the opt-in; 48 KiB without it
    reserved_shared_per_block: int = 1024  # the driver's own use, counted against the SM
    shared_unit: int = 128  # shared memory is allocated in units of 128 bytes (256 on 7.x)
    default_shared_per_block: int = 48 * 1024  # without the opt-in (cudaFuncSetAttribute)
    bf16_tensor_cores: bool = True  # mma.sync on bf16 (and cp.async, ldmatrix .trans): sm_80+


SM90 = ArchLimits("sm_90 (H100)")
SM80 = ArchLimits("sm_80 (A100)", shared_per_sm=164 * 1024, max_shared_per_block=163 * 1024)
SM75 = ArchLimits("sm_75 (T4, RTX 20)", max_warps_per_sm=32, max_blocks_per_sm=16,
                  shared_per_sm=64 * 1024, max_shared_per_block=64 * 1024,
                  reserved_shared_per_block=0, shared_unit=256, bf16_tensor_cores=False)
SM86 = ArchLimits("sm_86 (RTX 30, A10, A40)", max_warps_per_sm=48, max_blocks_per_sm=16,
                  shared_per_sm=100 * 1024, max_shared_per_block=99 * 1024)
SM89 = ArchLimits("sm_89 (RTX 40, L4, L40)", max_warps_per_sm=48, max_blocks_per_sm=24,
                  shared_per_sm=100 * 1024, max_shared_per_block=99 * 1024)
ARCHS = {"sm_75": SM75, "sm_80": SM80, "sm_86": SM86, "sm_89": SM89, "sm_90": SM90}


def arch_limits(arch) -> ArchLimits:
    """The limits of ``arch``: an ``ArchLimits`` (returned as it is), a name (``"sm_86"``), a
    compute capability (``(8, 6)``, ``"8.6"``, ``86``), or ``torch.cuda.get_device_capability()``
    of the GPU at hand."""
    if isinstance(arch, ArchLimits):
        return arch
    key = None
    if isinstance(arch, str):
        text = arch.strip().lower()
        if text.startswith("sm_") and text[3:].isdigit():
            key = text
        elif text.replace(".", "", 1).isdigit() and "." in text:
            major, minor = text.split(".")
            key = f"sm_{major}{minor}"
    elif isinstance(arch, tuple) and len(arch) == 2 and all(isinstance(x, int) for x in arch):
        key = f"sm_{arch[0]}{arch[1]}"
    elif isinstance(arch, int) and not isinstance(arch, bool):
        key = f"sm_{arch}"
    if key in ARCHS:
        return ARCHS[key]
    raise ValueError(f"arch={arch!r}: the course knows the limits of {', '.join(ARCHS)} (compute "
                     "capability 7.5, 8.0, 8.6, 8.9, 9.0); pass one of those names, a (major, "
                     "minor) pair, or an ArchLimits of your own")


@dataclass(frozen=True)
class Occupancy:
    """What ``active_blocks`` found.

    blocks: active blocks per SM (0: the block cannot launch at all). limit: the binding
    resource, one of "warps", "blocks", "registers", "shared memory" (ties: the first of these),
    or why it cannot launch. warps: active warps per SM. occupancy: warps / max warps per SM.
    by_limit: the block count each resource alone allows.
    """

    blocks: int
    limit: str
    warps: int
    occupancy: float
    by_limit: dict

    def __str__(self) -> str:
        return (
            f"{self.blocks} blocks/SM, {self.warps} warps, occupancy {self.occupancy:.0%} "
            f"(limited by {self.limit})"
        )


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def active_blocks(registers, shared_bytes, threads, arch=SM90) -> Occupancy:
    """Active blocks per SM for a kernel using ``registers`` per thread, ``shared_bytes`` of
    shared memory per block (static + dynamic) and ``threads`` per block, on ``arch`` (an
    ``ArchLimits`` or anything :func:`arch_limits` takes, e.g. ``"sm_86"``).

    The rules of NVIDIA's occupancy calculator (default cache configuration, kernel opted into
    the large shared-memory limit). Returns an ``Occupancy``.
    """
    arch = arch_limits(arch)
    registers, shared_bytes, threads = int(registers), int(shared_bytes), int(threads)
    if threads < 1 or registers < 0 or shared_bytes < 0:
        raise ValueError("threads must be >= 1, registers and shared_bytes >= 0")
    warps = -(-threads // arch.warp_size)  # a partial warp still takes a whole warp slot

    # Warps: 64 warp slots per SM.
    by_warps = arch.max_warps_per_sm // warps if threads <= arch.max_threads_per_block else 0

    # Registers: per warp, rounded up to the allocation unit; each of the 4 register-file
    # quarters holds whole warps.
    per_warp = _round_up(registers * arch.warp_size, arch.register_unit)
    too_many = (
        registers > arch.max_registers_per_thread
        or per_warp * _round_up(warps, arch.register_partitions) > arch.registers_per_block
    )
    if too_many:
        by_registers = 0
    elif per_warp == 0:
        by_registers = arch.max_blocks_per_sm
    else:
        warps_per_quarter = arch.registers_per_sm // arch.register_partitions // per_warp
        by_registers = warps_per_quarter * arch.register_partitions // warps

    # Shared memory: the block's own bytes plus the reserved 1 KiB, in 128-byte units.
    allocated = _round_up(shared_bytes + arch.reserved_shared_per_block, arch.shared_unit)
    if shared_bytes > arch.max_shared_per_block:
        by_shared = 0
    elif allocated == 0:  # no shared memory and nothing reserved (7.x): no limit from it
        by_shared = arch.max_blocks_per_sm
    else:
        by_shared = arch.shared_per_sm // allocated

    by_limit = {  # on a tie the first one is named: full warp slots are not a "limit" to fix
        "warps": by_warps,
        "blocks": arch.max_blocks_per_sm,
        "registers": by_registers,
        "shared memory": by_shared,
    }
    blocks = min(by_limit.values())
    limit = min(by_limit, key=by_limit.get)
    if blocks == 0:
        limit = f"{limit}: one block needs more than a block may have (cannot launch)"
    active_warps = blocks * warps
    return Occupancy(blocks, limit, active_warps, active_warps / arch.max_warps_per_sm, by_limit)


def _core_kernel(kernel):
    """The cuda.core Kernel behind ``kernel`` (a CudaKernel or already a cuda.core Kernel), with
    torch's device made current."""
    if hasattr(kernel, "core_kernel"):  # a course_utils.toolbox.cuda.CudaKernel
        return kernel.core_kernel()
    import torch
    from cuda.core import Device

    Device(torch.cuda.current_device()).set_current()  # the primary context, the one torch uses
    return kernel


def driver_active_blocks(kernel, threads: int, dynamic_shared_bytes: int = 0) -> int:
    """Active blocks per SM as the CUDA driver computes them (GPU only).

    ``kernel``: a ``course_utils.toolbox.cuda.CudaKernel`` (from ``compile_kernel``) or a
    ``cuda.core`` Kernel. Uses cuda.core's ``Kernel.occupancy.max_active_blocks_per_
    multiprocessor(block_size, dynamic_shared_memory_size)``, which calls
    ``cuOccupancyMaxActiveBlocksPerMultiprocessor``.
    """
    occupancy = _core_kernel(kernel).occupancy
    return int(
        occupancy.max_active_blocks_per_multiprocessor(int(threads), int(dynamic_shared_bytes))
    )


def driver_resources(kernel) -> dict:
    """What the driver says the loaded kernel uses (GPU only): registers per thread, static
    shared bytes per block, local (stack) bytes per thread."""
    attributes = _core_kernel(kernel).attributes
    return {
        "registers": int(attributes.num_regs),
        "shared_bytes": int(attributes.shared_size_bytes),
        "local_bytes": int(attributes.local_size_bytes),
    }


# ----------------------------------------------------------------------------- FA budgets


def fa_registers_per_thread(Br: int, d: int, threads: int) -> int:
    """32-bit registers per thread for a FlashAttention forward block's running state.

    The block owns Br rows of O (Br x d, float32) and their running max m and sum l. Its
    ``threads`` threads split O evenly: each holds ceil(Br * d / threads) floats of O. Each
    thread also keeps m and l for every row it holds part of: ceil(Br / threads) rows (1 when
    several threads share a row). This is a floor: the S tile, the Q fragment, addresses and loop
    counters come on top.
    """
    return -(-(Br * d) // threads) + 2 * -(-Br // threads)


def fa_shared_bytes(Br: int, Bc: int, d: int, dtype_bytes: int) -> int:
    """Shared-memory bytes per block for the Q_i (Br x d), K_j and V_j (Bc x d) tiles."""
    return (Br * d + 2 * Bc * d) * dtype_bytes
