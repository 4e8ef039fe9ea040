"""No sockets in the grading worker: a seccomp-BPF filter that makes socket syscalls fail.

Landlock (ABI 4+) refuses TCP bind and connect, and nothing else of the network: a worker
locked in by it can still send UDP datagrams, talk netlink, or connect to a Unix socket file of
a process outside (Landlock controls creating such a file, not connecting to an existing one).
The worker needs no socket at all: it talks to the grader over pipes it inherits. So
``deny_sockets()`` installs a filter, irreversibly, for every thread of the process and every
process it starts, under which these syscalls return EPERM:

- ``socket``, for every address family: with it goes every new way out (UDP, TCP, Unix,
  netlink, packet, vsock ...). Python raises ``PermissionError``, which libraries handle as a
  refusal (glibc's resolver falls back to the files when it cannot reach nscd); killing the
  process instead would turn a harmless probe into a crash the student cannot read.
- ``io_uring_setup``: io_uring runs socket, connect and accept itself (socket since 5.19),
  without passing through those syscalls.
- ``pidfd_getfd``: it copies a descriptor, a socket included, out of another process that this
  one may ptrace.
- ``connect``, ``bind``, ``listen``, ``accept``, ``accept4``: without ``socket`` the only
  sockets the worker can hold are connected pairs, where these have no use, but ``connect``
  would re-aim a datagram socket at any address; denied in depth.
- ``sendto`` with a destination address: for the same reason (on a connected stream socket the
  kernel refuses the address anyway). ``sendto`` without one is what ``send`` is made of.
- ``socketpair`` of anything but an AF_UNIX stream or seqpacket pair; see below.
- Every syscall of another ABI than the process's own: i386's ``int 0x80`` and x32 on x86_64,
  AArch32 on arm64. They have socket syscalls of their own (``socketcall`` among them, whose
  arguments sit in memory where a filter cannot read them), and reaching them is the classic
  way around filters that check numbers only; a 64-bit Python never uses them.

What stays allowed, and why that is safe:

- ``socketpair(AF_UNIX, SOCK_STREAM or SOCK_SEQPACKET)``: it makes two sockets connected to each
  other and to nothing else, both in this process: a fancier pipe. The kernel cannot re-connect
  them, and it ignores (seqpacket) or refuses (stream) a destination address given with the
  data, so they can only ever reach their peer, which lives inside the sandbox. asyncio's event
  loop wakes itself through one, and ``multiprocessing.Pipe()`` is one. Datagram pairs are
  refused: a Unix datagram socket sends to any address given with ``sendmsg``, whose address
  sits in memory where the filter cannot check it.
- ``send``/``recv``/``sendmsg``/``recvmsg`` and the socket options: on those pairs they only
  carry data (and descriptors, ``SCM_RIGHTS``) between processes of the sandbox. Pipes never use
  them, but asyncio's wake-up and ``multiprocessing``'s descriptor passing do.

What it leaves:

- Descriptors already open: a socket inherited from the parent still works, and so do the
  grader's pipes. The worker is started with only its two pipes (``subprocess`` closes the rest).
- Everything that is not a socket: files, pipes, FIFOs, shared memory, signals and ptrace. Which
  of those reach outside is Landlock's business (the file system, signals, ptrace).
- What needs a socket breaks, loudly: ``multiprocessing`` managers and the forkserver, passing a
  tensor's descriptor to another process (torch's default sharing strategy), gloo's rendezvous
  (``ring.launch``; Landlock ABI 4 already refuses its TCP).
- ``PR_SET_NO_NEW_PRIVS`` comes first (the kernel requires it for an unprivileged filter): a
  setuid program the worker runs gains no privileges. Landlock sets it too.

On a machine other than 64-bit x86_64 or aarch64 (little-endian) there is no table of syscall
numbers, and nothing is installed: the status says so. So does it, beginning with
``"unavailable"``, where the kernel refuses.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import sys
from dataclasses import dataclass

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000  # x32 syscalls arrive as x86_64 ones with this bit in the number

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2  # prctl's name for it
SECCOMP_SET_MODE_FILTER = 1  # seccomp()'s name for it
SECCOMP_FILTER_FLAG_TSYNC = 1
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000

AF_UNIX = 1
SOCK_STREAM, SOCK_SEQPACKET = 1, 5
SOCK_TYPE_MASK = 0xF  # the rest of socketpair's type is SOCK_NONBLOCK / SOCK_CLOEXEC

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]. The two
# architectures here are little-endian, so an argument's low word comes first.
NR_OFFSET, ARCH_OFFSET, ARGS_OFFSET = 0, 4, 16

# Classic BPF, the only instructions the filter uses.
BPF_LD_W_ABS = 0x20  # A = the 32-bit word at offset k of seccomp_data
BPF_JEQ_K = 0x15  # pc += (A == k) ? jt : jf
BPF_JGE_K = 0x35  # pc += (A >= k) ? jt : jf (unsigned)
BPF_AND_K = 0x54  # A &= k
BPF_RET_K = 0x06  # return k


@dataclass(frozen=True)
class Arch:
    """One architecture's syscall numbers: they differ between x86_64 and the generic table."""

    name: str
    audit: int  # AUDIT_ARCH_*, what the kernel puts in seccomp_data.arch
    seccomp: int  # the seccomp() syscall
    denied: dict[str, int]  # always EPERM
    socketpair: int  # EPERM unless an AF_UNIX stream or seqpacket pair
    sendto: int  # EPERM with a destination address
    x32: bool = False  # deny numbers with X32_SYSCALL_BIT


# io_uring_setup and pidfd_getfd come from the table that every architecture shares since 5.1.
_SHARED = {"io_uring_setup": 425, "pidfd_getfd": 438}

ARCHES = {
    "x86_64": Arch(
        "x86_64", AUDIT_ARCH_X86_64, seccomp=317, socketpair=53, sendto=44, x32=True,
        denied={"socket": 41, "connect": 42, "accept": 43, "bind": 49, "listen": 50,
                "accept4": 288, **_SHARED}),
    "aarch64": Arch(
        "aarch64", AUDIT_ARCH_AARCH64, seccomp=277, socketpair=199, sendto=206,
        denied={"socket": 198, "bind": 200, "listen": 201, "accept": 202, "connect": 203,
                "accept4": 242, **_SHARED}),
}  # fmt: skip


def native_arch() -> Arch | None:
    """This process's architecture, or None where the filter has no table for it.

    The machine is not enough: a 32-bit Python on an x86_64 kernel makes i386 syscalls, which
    an x86_64 filter would refuse, every one of them.
    """
    machine = platform.machine().lower()
    name = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    if sys.byteorder != "little" or struct.calcsize("P") != 8:
        return None
    return ARCHES.get(name)


def filter_program(arch: Arch) -> list[tuple[int, int, int, int]]:
    """The filter as classic BPF instructions ``(code, jt, jf, k)``.

    Branches name their targets ("allow", "deny", "socketpair", "sendto") and are resolved to
    forward offsets at the end; classic BPF has no backward jumps and offsets of a byte.
    """
    deny = SECCOMP_RET_ERRNO | errno.EPERM
    arg_lo = lambda i: ARGS_OFFSET + 8 * i
    arg_hi = lambda i: ARGS_OFFSET + 8 * i + 4
    code: list[tuple[int, object, object, int]] = []  # jt/jf: an offset or a label
    labels: dict[str, int] = {}

    def op(c, k, jt=0, jf=0):
        code.append((c, jt, jf, k))

    # Another ABI than the native one (i386, AArch32): refused whole, see the module docstring.
    op(BPF_LD_W_ABS, ARCH_OFFSET)
    op(BPF_JEQ_K, arch.audit, jf="deny")
    op(BPF_LD_W_ABS, NR_OFFSET)
    if arch.x32:
        op(BPF_JGE_K, X32_SYSCALL_BIT, jt="deny")
    for nr in arch.denied.values():
        op(BPF_JEQ_K, nr, jt="deny")
    op(BPF_JEQ_K, arch.socketpair, jt="socketpair")
    op(BPF_JEQ_K, arch.sendto, jt="sendto")
    op(BPF_RET_K, SECCOMP_RET_ALLOW)

    labels["socketpair"] = len(code)  # socketpair(domain, type, protocol, sv)
    op(BPF_LD_W_ABS, arg_lo(0))  # the domain is an int: the kernel reads the low word only
    op(BPF_JEQ_K, AF_UNIX, jf="deny")
    op(BPF_LD_W_ABS, arg_lo(1))
    op(BPF_AND_K, SOCK_TYPE_MASK)
    op(BPF_JEQ_K, SOCK_STREAM, jt="allow")
    op(BPF_JEQ_K, SOCK_SEQPACKET, jt="allow", jf="deny")

    labels["sendto"] = len(code)  # sendto(fd, buf, len, flags, dest_addr, addrlen)
    op(BPF_LD_W_ABS, arg_lo(4))  # dest_addr is a pointer: both words must be 0
    op(BPF_JEQ_K, 0, jf="deny")
    op(BPF_LD_W_ABS, arg_hi(4))
    op(BPF_JEQ_K, 0, jt="allow", jf="deny")

    labels["allow"] = len(code)
    op(BPF_RET_K, SECCOMP_RET_ALLOW)
    labels["deny"] = len(code)
    op(BPF_RET_K, deny)

    def offset(pc, target):
        if isinstance(target, int):
            return target
        jump = labels[target] - pc - 1
        assert 0 <= jump <= 255, f"branch to {target} out of reach"
        return jump

    return [(c, offset(pc, jt), offset(pc, jf), k) for pc, (c, jt, jf, k) in enumerate(code)]


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]  # fmt: skip


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def deny_sockets() -> str:
    """Install the filter for every thread of this process and its future children; irreversible.

    Returns a status: ``"seccomp: sockets denied (x86_64)"`` when every thread is covered, the
    same with ``"calling thread only"`` on a kernel without the seccomp() syscall (before 3.17:
    threads that already run are not covered, those it starts later are), or
    ``"unavailable (why)"`` when nothing was installed.
    """
    if sys.platform != "linux":
        return f"unavailable (not Linux: {sys.platform})"
    arch = native_arch()
    if arch is None:
        bits = 8 * struct.calcsize("P")
        return (f"unavailable (no syscall table for {platform.machine()}, {bits}-bit "
                f"{sys.byteorder}-endian: filter not installed)")  # fmt: skip
    program = filter_program(arch)
    instructions = (_SockFilter * len(program))(*(_SockFilter(*ins) for ins in program))
    fprog = _SockFprog(len(program), instructions)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ulong = ctypes.c_ulong

    if libc.prctl(ctypes.c_int(PR_SET_NO_NEW_PRIVS), ulong(1), ulong(0), ulong(0), ulong(0)):
        return f"unavailable (no_new_privs: {os.strerror(ctypes.get_errno())})"
    # TSYNC: the threads that already run (torch's and OpenMP's pools, a student's) get the
    # filter too, or none does. A positive result names a thread it could not be given to.
    result = libc.syscall(ctypes.c_long(arch.seccomp), ulong(SECCOMP_SET_MODE_FILTER),
                          ulong(SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(fprog))  # fmt: skip
    if result == 0:
        return f"seccomp: sockets denied ({arch.name})"
    if result > 0:
        return f"unavailable (thread {result} has a filter of its own: TSYNC refused, none set)"
    error = ctypes.get_errno()
    if error != errno.ENOSYS:
        return f"unavailable (seccomp: {os.strerror(error)})"
    # No seccomp() syscall: prctl sets the filter on the calling thread alone.
    if libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog),
                  ulong(0), ulong(0)):  # fmt: skip
        return f"unavailable (prctl PR_SET_SECCOMP: {os.strerror(ctypes.get_errno())})"
    return (f"seccomp: sockets denied ({arch.name}, calling thread only: no seccomp() syscall for "
            f"TSYNC, so threads already running are not covered)")  # fmt: skip
