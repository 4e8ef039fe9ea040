"""Attack notebooks aimed at chapter 13's ring grader (``13.ring_forward``), whose cells run in
rank processes that the grader starts (``course_utils.grading.ranks``).

Each attack hands in the honest ring only if its forbidden capability worked (and zeros
otherwise), so a score of 0 proves that the rank's lock held; the others leave a process behind
or hang, and must cost that exercise only. ``tests/test_grading_attacks.py`` grades them with
the others (``register(attack)``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "13_ring_attention.ipynb"
CHECK = 'grader.check("13.ring_forward", ring_forward_gqa)'
ORPHAN_MARK = "course-grade-orphan-test"  # as in test_grading_attacks (the fixture's probe)


def _honest() -> str:
    """The solution's ring cell, renamed ``_honest_ring`` (the attacks call it when they win)."""
    for cell in json.loads(_SOLUTION.read_text())["cells"]:
        text = "".join(cell["source"])
        if "def ring_forward_gqa" in text:
            text = re.sub(r"(?m)^[ \t]*### (BEGIN|END) SOLUTION[ \t]*\n", "", text)
            return text.replace("def ring_forward_gqa(", "def _honest_ring(")
    raise LookupError("no ring cell in the solution notebook")


def _guarded(test: str) -> str:
    """A ring cell that runs ``test`` (code setting ``won``) in the rank, then answers honestly
    only if ``won``."""
    body = "\n".join("    " + line for line in test.strip().splitlines())
    return (_honest() + "\n\n\ndef ring_forward_gqa(q, k, v, causal=False):\n"
            "    won = False\n" + body + "\n"
            "    if won:\n"
            "        return _honest_ring(q, k, v, causal)\n"
            "    B, H, n, d = q.shape\n"
            "    return torch.zeros_like(q), torch.zeros(B, H, n)\n")


READ_OTHERS = """
import glob, os
def _memory(pid):  # the first readable mapping of another process (its shards live there)
    with open(f"/proc/{pid}/maps") as f:
        lo = next(int(line.split("-")[0], 16) for line in f if line.split()[1].startswith("r"))
    with open(f"/proc/{pid}/mem", "rb") as f:
        f.seek(lo)
        return f.read(16)
others = [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid()]
for pid in [os.getppid(), *others]:  # the grader drew every shard; the sibling ranks hold theirs
    try:
        if _memory(pid):
            won = True
    except (OSError, StopIteration, ValueError):
        pass
for path in glob.glob("../*") + glob.glob("../*/*") + glob.glob("../store/*"):
    try:  # the other ranks' folders and the group's store
        with open(path, "rb") as f:
            if f.read(1):
                won = True
    except OSError:
        pass
"""

OTHER_NOTEBOOK = """
import socket
try:
    with socket.create_connection(("127.0.0.1", NET_PORT), timeout=3):
        won = True
except OSError:
    pass
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(b"x", ("127.0.0.1", NET_PORT))
    won = True
except OSError:
    pass
"""


def _via_file(source: str) -> str:
    """A notebook cell that writes ``source`` (with the prelude's NET_PORT and ORPHAN_TARGET
    filled in) to a module in the worker's folder and imports ``ring_forward_gqa`` from it: the
    ranks run the defining file, so the values must be in its text."""
    return ("import importlib.util, pathlib\n"
            f"_source = {source!r}\n"
            "_source = _source.replace('__NET_PORT__', str(NET_PORT))"
            ".replace('__TARGET__', ORPHAN_TARGET)\n"
            "pathlib.Path('ring_attack.py').write_text(_source)\n"
            "_spec = importlib.util.spec_from_file_location('ring_attack', 'ring_attack.py')\n"
            "_module = importlib.util.module_from_spec(_spec)\n"
            "_spec.loader.exec_module(_module)\n"
            "ring_forward_gqa = _module.ring_forward_gqa")


BACK_CHECK = 'grader.check("13.ring_backward", ring_backward_gqa)'


def _guarded_backward(test: str) -> str:
    """The backward's honest cell renamed ``_honest_back``, answered only if ``test`` won."""
    for cell in json.loads(_SOLUTION.read_text())["cells"]:
        text = "".join(cell["source"])
        if "def ring_backward_gqa" in text:
            text = re.sub(r"(?m)^[ \t]*### (BEGIN|END) SOLUTION[ \t]*\n", "", text)
            honest = text.replace("def ring_backward_gqa(", "def _honest_back(")
            break
    else:
        raise LookupError("no backward cell in the solution notebook")
    body = "\n".join("    " + line for line in test.strip().splitlines())
    return (honest + "\n\n\ndef ring_backward_gqa(q, k, v, dO, O, LSE, causal=False):\n"
            "    won = False\n" + body + "\n"
            "    if won:\n"
            "        return _honest_back(q, k, v, dO, O, LSE, causal)\n"
            "    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)\n")


# The ranks are forked by a zygote (a Python with torch imported, the grader's child): a rank
# that found the zygote's socket could ask it for a fresh, unlocked process. Every inherited
# socket is tried, and the zygote's memory read.
ZYGOTE = """
import json, os, socket
for fd in range(1024):
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        continue
    if s.family != socket.AF_UNIX:  # gloo's TCP mesh: leave the ring working
        continue
    try:
        s.settimeout(0.5)
        socket.send_fds(s, [json.dumps({"cwd": "/", "env": {}}).encode()], [0, 1, 2])
        if b"pid" in s.recv(4096):
            won = True
    except OSError:
        pass
try:
    with open(f"/proc/{os.getppid()}/mem", "rb") as f:
        won = won or bool(f.read(1))
except OSError:
    pass
"""


def register(attack):
    attack("ring_rank_asks_the_zygote_for_a_process", [_guarded_backward(ZYGOTE), BACK_CHECK],
           {"13.ring_backward": 0}, chapter="13")
    attack("ring_rank_reads_other_ranks", [_guarded(READ_OTHERS), CHECK], {"13.ring_forward": 0},
           chapter="13")
    attack("ring_rank_reaches_another_notebook",
           [_via_file(_guarded("NET_PORT = __NET_PORT__\n" + OTHER_NOTEBOOK)), CHECK],
           {"13.ring_forward": 0}, chapter="13")
    attack("ring_rank_leaves_a_process", [
        _via_file(_guarded("import subprocess, sys, os\n"
                 "subprocess.Popen([sys.executable, '-c', 'import time, sys; time.sleep(4); "
                 "open(sys.argv[1], \"w\").write(\"escaped\")', '__TARGET__', "
                 + repr(ORPHAN_MARK) + "], start_new_session=True,\n"
                 "                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,"
                 " stderr=subprocess.DEVNULL)\n"
                 "if os.fork() == 0:\n"
                 "    os.setsid()\n"
                 "    if os.fork() == 0:\n"
                 "        import time\n"
                 "        time.sleep(6)\n"
                 "    os._exit(0)\n")), CHECK], {"13.ring_forward": 0}, chapter="13")
    attack("ring_rank_hangs", [
        "import torch\nimport torch.distributed as dist\n\n\n"
        "def ring_forward_gqa(q, k, v, causal=False):\n"
        "    got = torch.empty_like(k)\n"
        "    for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, (dist.get_rank() + 1)"
        " % dist.get_world_size())]):\n"
        "        w.wait()  # nobody sends: a deadlock\n"
        "    return q, q[..., 0]", CHECK], {"13.ring_forward": 0}, chapter="13")
