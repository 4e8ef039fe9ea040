"""The suite's warm notebook kernels (tests/kernel_zygote.py): a kernel is forked from the server
in the notebook's folder with nbval's environment, an interrupt reaches it, killing the launcher
ends it, and a kernel asking for another thread setting gets a plain kernel instead."""

import os
import time

import kernel_zygote
import pytest

jupyter_client = pytest.importorskip("jupyter_client")

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kernels") / "server")
    proc = kernel_zygote.start(path, env={**os.environ, **ONE_THREAD})
    assert os.path.exists(path), "the kernel server did not come up"
    yield proc, path
    proc.kill()
    proc.wait()


def _start(path, cwd, **extra_env):
    class Specs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return KernelSpec(**kernel_zygote.kernel_spec(path), display_name="warm",
                              language="python")

    km = KernelManager(kernel_name="warm", kernel_spec_manager=Specs())
    km.start_kernel(cwd=str(cwd), env={**os.environ, **ONE_THREAD, **extra_env})
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return km, kc


def _run(kc, code, timeout=30):
    """Execute ``code``; return (stdout, the reply's status and ename)."""
    out = []
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=lambda m: out.append(
        m["content"].get("text", "")) if m["msg_type"] == "stream" else None)
    return "".join(out), reply["content"]["status"], reply["content"].get("ename", "")


def _gone(pid, seconds=10):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_kernel_is_forked_in_the_notebooks_folder_with_its_environment(server, tmp_path):
    proc, path = server
    seen = []
    for i in range(2):
        km, kc = _start(path, tmp_path, COURSE_TEST_MARK=f"mark{i}")
        try:
            out, status, _ = _run(kc, "import os, sys, numpy\nprint(os.getpid(), os.getppid(), "
                                      "'torch' in sys.modules, os.getcwd(), "
                                      "os.environ['COURSE_TEST_MARK'], numpy.random.rand())")
            assert status == "ok", out
            pid, ppid, warm, cwd, mark, draw = out.split()
            assert int(pid) != km.provisioner.process.pid and int(ppid) == proc.pid
            assert warm == "True" and cwd == str(tmp_path) and mark == f"mark{i}"
            seen.append(draw)
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=False)
        assert _gone(int(pid))
    assert seen[0] != seen[1]  # each kernel draws fresh random numbers


def test_an_interrupt_reaches_the_kernel_and_a_kill_ends_it(server, tmp_path):
    _, path = server
    km, kc = _start(path, tmp_path)
    try:
        out, _, _ = _run(kc, "import os; print(os.getpid())")
        pid = int(out)
        msg_id = kc.execute("import time; time.sleep(60)")
        time.sleep(1)
        km.interrupt_kernel()  # SIGINT to the launcher's group: forwarded to the kernel
        reply = kc.get_shell_msg(timeout=20)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["ename"] == "KeyboardInterrupt"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)  # SIGKILL to the launcher's group only
    assert _gone(pid), "the kernel outlived its launcher"


def test_a_kernel_that_asks_for_other_threads_starts_plain(server, tmp_path):
    proc, path = server
    km, kc = _start(path, tmp_path, OMP_NUM_THREADS="2")
    try:
        out, status, _ = _run(kc, "import os, sys; print(os.getpid(), os.getppid(), "
                                  "'torch' in sys.modules)")
        pid, ppid, warm = out.split()
        assert int(pid) == km.provisioner.process.pid and int(ppid) != proc.pid
        assert warm == "False"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
