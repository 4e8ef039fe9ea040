"""The worker's socket filter: what it refuses, what still works, and its program on paper.

A seccomp filter cannot be removed, so every test that installs one does it in a fresh
``python -c`` process: the code before ``deny_sockets()`` is the control (the same thing works
without the filter), the code after it the check. A listener the test runs here tells whether
anything got out. The filter's program is also run through a small BPF interpreter below, which
checks the aarch64 table on any machine.
"""

import importlib.util
import json
import os
import platform
import socket
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from course_utils import seccomp

ROOT = Path(__file__).resolve().parents[1]
linux = pytest.mark.skipif(sys.platform != "linux", reason="seccomp filters are Linux only")

# Helpers for the child: refused() tells PermissionError (the filter) from every other error.
PRELUDE = """
import json, os, socket, sys

def refused(make, *args):
    try:
        made = make(*args)
    except PermissionError:
        return True
    if hasattr(made, "close"):
        made.close()
    return False
"""
INSTALL = """
from course_utils.grading.seccomp import deny_sockets
STATUS = deny_sockets()
assert STATUS.startswith("seccomp: sockets denied"), STATUS
"""


def child_env() -> dict[str, str]:
    """The environment, with this checkout's course_utils first on the child's path."""
    path = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    return {**os.environ, "PYTHONPATH": path}


def run_child(after: str, before: str = "", install: str = INSTALL, timeout: float = 120):
    """Run ``before``, install the filter, run ``after`` in a fresh interpreter; its stdout."""
    code = "".join(textwrap.dedent(part) for part in (PRELUDE, before, install, after))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=child_env())  # fmt: skip
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def filtered():
    """Skip (with the reason) where the filter cannot be installed: another arch, no seccomp."""
    if sys.platform != "linux":
        pytest.skip("seccomp filters are Linux only")
    proc = subprocess.run([sys.executable, "-c",
                           "from course_utils.grading.seccomp import deny_sockets;"
                           "print(deny_sockets())"], capture_output=True, text=True, cwd=ROOT,
                          env=child_env(), timeout=60)  # fmt: skip
    status = proc.stdout.strip()
    if not status.startswith("seccomp: sockets denied"):
        pytest.skip(f"no filter here: {status or proc.stderr}")
    return status


# ============================================================================= in a fresh process


@linux
def test_status_names_the_arch(filtered):
    assert filtered == f"seccomp: sockets denied ({seccomp.native_arch().name})"
    assert seccomp.native_arch().name == {"amd64": "x86_64", "arm64": "aarch64"}.get(
        platform.machine().lower(), platform.machine().lower())


@linux
def test_every_address_family_is_refused(filtered):
    out = run_child(
        before="""
        kinds = {"inet tcp": (socket.AF_INET, socket.SOCK_STREAM),
                 "inet udp": (socket.AF_INET, socket.SOCK_DGRAM),
                 "inet6 tcp": (socket.AF_INET6, socket.SOCK_STREAM),
                 "inet6 udp": (socket.AF_INET6, socket.SOCK_DGRAM),
                 "unix stream": (socket.AF_UNIX, socket.SOCK_STREAM),
                 "unix dgram": (socket.AF_UNIX, socket.SOCK_DGRAM),
                 "unix seqpacket": (socket.AF_UNIX, socket.SOCK_SEQPACKET),
                 "netlink": (socket.AF_NETLINK, socket.SOCK_RAW),
                 "packet": (socket.AF_PACKET, socket.SOCK_RAW),
                 "vsock": (getattr(socket, "AF_VSOCK", 40), socket.SOCK_STREAM)}
        possible = {}
        for name, (family, kind) in kinds.items():
            try:
                socket.socket(family, kind).close()  # the control: it works without the filter
                possible[name] = (family, kind)
            except OSError:
                pass
        """,
        after="""
        made = [name for name, args in possible.items() if not refused(socket.socket, *args)]
        print(json.dumps({"checked": sorted(possible), "made": made}))
        """)
    result = json.loads(out)
    assert result["made"] == []
    must = {"inet tcp", "inet udp", "unix stream", "unix dgram", "unix seqpacket", "netlink"}
    if os.geteuid() == 0:
        must.add("packet")  # root may lack CAP_NET_RAW in a container: then the control fails
    missing = must - set(result["checked"])
    assert missing <= {"packet"}, f"the control could not make {missing} even without the filter"


@linux
def test_a_udp_datagram_never_arrives(filtered):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.settimeout(5)
        address = listener.getsockname()
        out = run_child(
            before=f"""
            address = {address!r}
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.connect(address)
            udp.send(b"before")
            """,
            after="""
            print("new socket refused:", refused(socket.socket, socket.AF_INET, socket.SOCK_DGRAM))
            print("addressed sendto refused:", refused(udp.sendto, b"addressed", address))
            udp.send(b"open")  # a descriptor opened before the filter still works (documented)
            """)
        assert "new socket refused: True" in out and "addressed sendto refused: True" in out
        got = [listener.recv(100), listener.recv(100)]
        listener.settimeout(0.3)
        with pytest.raises(TimeoutError):
            got.append(listener.recv(100))
    assert got == [b"before", b"open"]


@linux
def test_unix_listeners_outside_cannot_be_reached(filtered, tmp_path):
    stream_path, dgram_path = str(tmp_path / "s.sock"), str(tmp_path / "d.sock")
    abstract = f"\0course-seccomp-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stream, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hidden, \
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as dgram:  # fmt: skip
        stream.bind(stream_path)
        hidden.bind(abstract)
        dgram.bind(dgram_path)
        stream.listen(8)
        hidden.listen(8)
        out = run_child(
            before=f"""
            stream_path, abstract, dgram_path = {stream_path!r}, {abstract!r}, {dgram_path!r}
            for family, kind, address in [(socket.AF_UNIX, socket.SOCK_STREAM, stream_path),
                                          (socket.AF_UNIX, socket.SOCK_STREAM, abstract)]:
                with socket.socket(family, kind) as s:
                    s.connect(address)
                    s.send(b"before")
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(b"before", dgram_path)
            """,
            after="""
            import errno
            checks = {}
            for kind in ("SOCK_STREAM", "SOCK_DGRAM", "SOCK_SEQPACKET"):
                checks["socket " + kind] = refused(socket.socket, socket.AF_UNIX,
                                                   getattr(socket, kind))
            # A datagram pair would send to any address given with sendmsg: refused.
            checks["datagram socketpair"] = refused(socket.socketpair, socket.AF_UNIX,
                                                    socket.SOCK_DGRAM)
            a, b = socket.socketpair()
            checks["connect a pair's end"] = refused(a.connect, stream_path)
            checks["connect a pair's end (abstract)"] = refused(a.connect, abstract)
            checks["sendto from a pair's end"] = refused(a.sendto, b"x", dgram_path)
            try:
                a.sendmsg([b"x"], [], 0, dgram_path)  # the filter cannot see this address...
                checks["kernel refuses sendmsg's address"] = False
            except OSError as e:  # ...the kernel refuses it on a connected stream socket
                checks["kernel refuses sendmsg's address"] = e.errno == errno.EISCONN
            c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            c.sendmsg([b"seq"], [], 0, dgram_path)  # a seqpacket pair ignores the address
            checks["seqpacket goes to its peer"] = d.recv(10) == b"seq"
            print(json.dumps(checks))
            """)
        checks = json.loads(out)
        assert all(checks.values()), checks
        for listener in (stream, hidden):
            listener.settimeout(5)
            conn, _ = listener.accept()
            assert conn.recv(10) == b"before"
            conn.close()
            listener.settimeout(0.3)
            with pytest.raises(TimeoutError):
                listener.accept()
        dgram.settimeout(5)
        assert dgram.recv(10) == b"before"
        dgram.settimeout(0.3)
        with pytest.raises(TimeoutError):
            dgram.recv(10)


@linux
def test_pairs_pipes_files_and_processes_still_work(filtered, tmp_path):
    out = run_child(f"""
        import asyncio, multiprocessing, subprocess
        a, b = socket.socketpair()
        a.sendall(b"pair")
        assert b.recv(10) == b"pair"
        r, w = os.pipe()
        os.write(w, b"pipe")
        assert os.read(r, 10) == b"pipe"
        path = {str(tmp_path / "f.txt")!r}
        with open(path, "w") as f:
            f.write("file")
        assert open(path).read() == "file"
        assert asyncio.run(asyncio.sleep(0, "loop")) == "loop"  # it wakes itself via a pair
        left, right = multiprocessing.Pipe()
        left.send({{"x": 1}})
        assert right.recv() == {{"x": 1}}
        assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True,
                              text=True).stdout == "1\\n"
        print("all worked")
        """)
    assert "all worked" in out


@linux
def test_children_inherit_the_filter(filtered):
    out = run_child("""
        import subprocess
        child = ("import socket\\n"
                 "try:\\n    socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\\n"
                 "except PermissionError:\\n    print('child refused')\\n"
                 "print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])")
        print(subprocess.run([sys.executable, "-c", child], capture_output=True,
                             text=True).stdout)
        """)
    assert out.split() == ["child", "refused", "2"]  # 2: SECCOMP_MODE_FILTER


@linux
def test_threads_started_before_the_filter_are_covered(filtered):
    out = run_child(
        before="""
        import threading
        go, result = threading.Event(), {}

        def worker():
            go.wait()
            result["refused"] = refused(socket.socket, socket.AF_INET, socket.SOCK_STREAM)
            status = open(f"/proc/self/task/{threading.get_native_id()}/status").read()
            result["mode"] = status.split("Seccomp:")[1].split()[0]

        thread = threading.Thread(target=worker)
        thread.start()
        """,
        after="""
        go.set()
        thread.join()
        print(json.dumps(result))
        """)
    assert json.loads(out) == {"refused": True, "mode": "2"}


@linux
def test_without_seccomp_syscall_prctl_covers_the_calling_thread(filtered):
    """The fallback, forced by a syscall number that does not exist (ENOSYS, as before 3.17)."""
    out = run_child(
        before="""
        import dataclasses, threading
        from course_utils import seccomp
        arch = seccomp.native_arch()
        seccomp.ARCHES[arch.name] = dataclasses.replace(arch, seccomp=0x3FF)  # not a syscall
        go, result = threading.Event(), {}

        def early():
            go.wait()
            result["early thread refused"] = refused(socket.socket, socket.AF_INET,
                                                     socket.SOCK_DGRAM)

        thread = threading.Thread(target=early)
        thread.start()
        """,
        install="""
        from course_utils.grading.seccomp import deny_sockets
        STATUS = deny_sockets()
        """,
        after="""
        print(STATUS)
        go.set()
        thread.join()
        later = threading.Thread(target=lambda: result.update(
            {"later thread refused": refused(socket.socket, socket.AF_INET, socket.SOCK_DGRAM)}))
        later.start()
        later.join()
        result["caller refused"] = refused(socket.socket, socket.AF_INET, socket.SOCK_DGRAM)
        print(json.dumps(result))
        """)
    status, result = out.splitlines()
    assert "sockets denied" in status and "calling thread only" in status
    # The limit the status names: a thread that already ran keeps its sockets.
    assert json.loads(result) == {"early thread refused": False, "later thread refused": True,
                                  "caller refused": True}  # fmt: skip


@linux
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_and_numpy_still_work(filtered):
    out = run_child("""
        import numpy as np
        import torch
        assert float(torch.ones(3) @ torch.ones(3)) == 3.0
        x = torch.randn(256, 256)
        assert torch.allclose(x @ torch.eye(256), x)  # big enough for torch's thread pool
        assert np.allclose(np.linalg.inv(np.eye(4) * 2), np.eye(4) / 2)
        print("torch", torch.__version__, "numpy", np.__version__)
        """)
    assert out.startswith("torch ")


@linux
@pytest.mark.skipif(importlib.util.find_spec("numpy") is None, reason="numpy is not installed")
def test_numpy_alone_still_works(filtered):
    assert "ok" in run_child("import numpy as np; assert np.arange(4).sum() == 6; print('ok')")


# i386(nr, a, b, c): an i386 syscall from this 64-bit process, int 0x80 with the System V
# arguments moved to eax, ebx, ecx, edx: push rbx; mov eax, edi; mov ebx, esi; xchg edx, ecx;
# int 0x80; pop rbx (callee-saved); ret. It returns -errno on failure, as the kernel does.
I386_CALL = (
    "import mmap; page = mmap.mmap(-1, mmap.PAGESIZE, prot=7); "  # read, write, execute
    "page.write(bytes.fromhex('53 89f8 89f3 87d1 cd80 5b c3')); "
    "i386 = ctypes.CFUNCTYPE(*[ctypes.c_int] * 5)("
    "ctypes.addressof(ctypes.c_char.from_buffer(page)))"
)


@linux
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86_64's other ABIs")
def test_i386_and_x32_syscalls_are_refused(filtered):
    """``int 0x80`` reaches the i386 table (socketcall, socket 359); x32 sets bit 30."""
    if not _int80_works():
        pytest.skip("int 0x80 faults here: a kernel without i386 emulation")
    out = run_child(
        before=f"""
        import ctypes
        {I386_CALL}
        libc = ctypes.CDLL(None, use_errno=True)
        result = {{"i386 before": i386(20, 0, 0, 0) == os.getpid()}}  # the control: getpid
        """,
        after="""
        result["i386 getpid"] = i386(20, 0, 0, 0)
        result["i386 socket"] = i386(359, socket.AF_INET, socket.SOCK_DGRAM, 0)
        result["i386 socketcall"] = i386(102, 1, 0, 0)
        ctypes.set_errno(0)
        made = libc.syscall(0x40000000 | 41, socket.AF_INET, socket.SOCK_DGRAM, 0)  # x32 socket
        result["x32 socket"] = (made, ctypes.get_errno())
        print(json.dumps(result))
        """)
    result = json.loads(out)
    assert result.pop("i386 before") is True
    eperm = -1  # errno.EPERM, negated: int 0x80 returns -errno in eax
    assert result == {"i386 getpid": eperm, "i386 socket": eperm, "i386 socketcall": eperm,
                      "x32 socket": [-1, 1]}  # fmt: skip


def _int80_works() -> bool:
    """Whether an i386 getpid through int 0x80 returns the pid, in a child (no filter there).

    Where the kernel has no i386 emulation, int 0x80 faults: the child dies, not the test.
    """
    probe = "import ctypes, mmap, os\n" + I386_CALL + "\nprint(i386(20, 0, 0, 0) == os.getpid())"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    return proc.returncode == 0 and proc.stdout.strip() == "True"


@linux
def test_an_unknown_arch_installs_nothing(filtered):
    out = run_child(
        before="""
        import platform
        platform.machine = lambda: "riscv64"
        """,
        install="""
        from course_utils.grading.seccomp import deny_sockets
        STATUS = deny_sockets()
        """,
        after="""
        print(STATUS)
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()
        status = open("/proc/self/status").read()
        print(status.split("Seccomp:")[1].split()[0], status.split("NoNewPrivs:")[1].split()[0])
        """)
    status, modes = out.splitlines()
    assert status.startswith("unavailable (no syscall table for riscv64")
    assert modes.split() == ["0", "0"]  # neither a filter nor no_new_privs


def test_not_linux_installs_nothing(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert seccomp.deny_sockets() == "unavailable (not Linux: darwin)"


# ============================================================================= the program on paper

ALLOW, EPERM = seccomp.SECCOMP_RET_ALLOW, seccomp.SECCOMP_RET_ERRNO | 1
AUDIT_ARCH_I386, AUDIT_ARCH_ARM = 0x40000003, 0x40000028
READ = {"x86_64": 0, "aarch64": 63}
COMPAT = {"x86_64": AUDIT_ARCH_I386, "aarch64": AUDIT_ARCH_ARM}


def run_bpf(program, nr, arch, args=(0, 0, 0, 0, 0, 0)):
    """What the kernel's classic BPF would return for ``seccomp_data(nr, arch, args)``."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args)
    a, pc = 0, 0
    for _ in range(len(program)):  # no backward jumps: at most one pass
        code, jt, jf, k = program[pc]
        if code == seccomp.BPF_RET_K:
            return k
        if code == seccomp.BPF_LD_W_ABS:
            (a,) = struct.unpack_from("<I", data, k)
        elif code == seccomp.BPF_AND_K:
            a &= k
        elif code in (seccomp.BPF_JEQ_K, seccomp.BPF_JGE_K):
            taken = a == k if code == seccomp.BPF_JEQ_K else a >= k
            pc += jt if taken else jf
        else:
            raise AssertionError(f"unknown instruction {code:#x}")
        pc += 1
    raise AssertionError("the program ran off its end")


@pytest.mark.parametrize("name", sorted(seccomp.ARCHES))
def test_the_program_decides_as_designed(name):
    arch = seccomp.ARCHES[name]
    program = seccomp.filter_program(arch)
    assert len(program) < 4096 and program[-1][0] == seccomp.BPF_RET_K
    run = lambda nr, *args, on=arch.audit: run_bpf(program, nr, on, (*args, 0, 0, 0, 0, 0, 0)[:6])
    for call, nr in arch.denied.items():
        assert run(nr) == EPERM, call
    assert set(arch.denied) >= {"socket", "connect", "bind", "listen", "accept", "accept4",
                                "io_uring_setup"}  # fmt: skip
    assert run(READ[name]) == ALLOW
    flags = 0x80000 | 0x800  # SOCK_CLOEXEC | SOCK_NONBLOCK, as Linux defines them on both
    for kind, verdict in [(1, ALLOW), (5, ALLOW), (2, EPERM), (3, EPERM), (1 | flags, ALLOW)]:
        assert run(arch.socketpair, 1, kind) == verdict, kind  # AF_UNIX pairs by type
    assert run(arch.socketpair, 2, 1) == EPERM  # AF_INET (or any family but AF_UNIX)
    assert run(arch.sendto, 3, 0x1000, 4, 0, 0, 0) == ALLOW  # send(): no address
    assert run(arch.sendto, 3, 0x1000, 4, 0, 0x7FFF_0000_1000, 16) == EPERM
    assert run(arch.sendto, 3, 0x1000, 4, 0, 0x7FFF_0000_0000, 16) == EPERM  # high word only
    assert run(READ[name], on=COMPAT[name]) == EPERM  # another ABI: refused whole
    assert run(READ[name], on=0xDEADBEEF) == EPERM
    if arch.x32:
        assert run(0x40000000 | 41) == EPERM and run(0x40000000) == EPERM
        assert run(0x3FFFFFFF) == ALLOW  # not a syscall: the kernel's ENOSYS, not ours
