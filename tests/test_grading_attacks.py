"""Grading that cannot be fooled: attack notebooks, each graded beside honest ones.

The notebooks below are graded in two runs of ``python -m course_utils grade`` (subprocesses, so
an attack that escaped could only hurt its run, never pytest): the attacks that only wait for a
time limit (:data:`WAIT_FOR_THE_LIMIT`: endless loops, a cell that keeps talking) with a short
one (:data:`QUICK_TIMEOUT`), all the others with :data:`TIMEOUT`. Each attack asserts the score
an honest grader gives it, and each run also holds two honest notebooks that must keep full
marks whatever the attacks around them did.

Capability attacks (read the solutions, reach the network, read the grader's memory, signal
it) use the score as their only way out: the notebook hands in the right answer if the forbidden
capability worked and a wrong one if it did not, so a score of 0 proves the sandbox held.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from course_utils import sandbox

pytestmark = pytest.mark.slow  # the whole file: minutes on 2 cores (not slow: -m "not slow")

ROOT = Path(__file__).resolve().parent.parent
LANDLOCK = sandbox.landlock_abi()
needs_landlock = pytest.mark.skipif(LANDLOCK < 1, reason="Landlock is not available here")

SETUP = "import course_utils as cu\ncu.setup()\nfrom course_utils import grader"

# Honest answers to chapter 01's exercises (the attacks target these).
MEMORY = "def query_block_peak_bytes(B, H, Nq, Nk, d, Br, bytes_per_element):\n" \
         "    rows = min(Br, Nq)\n" \
         "    return B * H * (Nq * d + rows * max(2 * Nk, Nk + d)) * bytes_per_element"
MEMORY_WRONG = "def query_block_peak_bytes(B, H, Nq, Nk, d, Br, bytes_per_element):\n" \
               "    return 0"
CHECK_MEMORY = 'grader.check("01.memory_formula", query_block_peak_bytes)'
NAIVE = textwrap.dedent("""
    import math
    import torch

    def naive_attention(Q, K, V, causal=False, scale=None):
        scale = 1 / math.sqrt(Q.shape[-1]) if scale is None else scale
        S = scale * Q @ K.transpose(-2, -1)
        if causal:
            Nq, Nk = S.shape[-2], S.shape[-1]
            keep = torch.ones(Nq, Nk, dtype=torch.bool, device=S.device).tril(Nk - Nq)
            S = S.masked_fill(~keep, -math.inf)
        return torch.softmax(S, dim=-1).nan_to_num(0.0) @ V
""")
CHECK_NAIVE = 'grader.check("01.naive_attention", naive_attention)'


def _sdpa_attention(expr: str) -> str:
    """A naive attention whose O comes from ``expr`` (a library route to SDPA, which chapter
    01's exercise forbids; its ``torch.softmax`` is allowed). ``expr`` may use ``bias``, the
    exercise's bottom-right causal mask as an additive float mask (None without causal), so that
    the answer is right when it is not blocked."""
    return textwrap.dedent(f"""
        import math
        import torch
        import torch.nn.functional as F

        def naive_attention(Q, K, V, causal=False, scale=None):
            scale = 1 / math.sqrt(Q.shape[-1]) if scale is None else scale
            Nq, Nk = Q.shape[-2], K.shape[-2]
            keep = torch.ones(Nq, Nk, dtype=torch.bool, device=Q.device).tril(Nk - Nq)
            bias = torch.zeros(Nq, Nk, device=Q.device).masked_fill(~keep, -math.inf)
            bias = bias if causal else None
            return torch.nan_to_num({expr}, 0.0)
    """)


def oracle(condition_code: str) -> list[str]:
    """Cells that hand in the right memory formula only if ``condition_code`` sets ok = True."""
    return [f"ok = False\ntry:\n{textwrap.indent(condition_code, '    ')}\nexcept Exception:\n"
            "    ok = False",
            f"{MEMORY}\nif not ok:\n{textwrap.indent(MEMORY_WRONG, '    ')}",
            CHECK_MEMORY]


# name -> (cells after the setup cell, {exercise: expected score})
ATTACKS: dict[str, tuple[list[str], dict[str, float]]] = {}


CHAPTER: dict[str, str] = {}  # attacks on another chapter's exercises than 01's


def attack(name, cells, expected, chapter="01"):
    ATTACKS[name] = (cells, expected)
    CHAPTER[name] = chapter


def file_of(name: str) -> str:
    return f"{CHAPTER[name]}_{name}.ipynb"


# --- the notebook reports its own results --------------------------------------------------------
attack("forged_results_env", [
    "import os, json\nfor k in ('COURSE_GRADE_RESULTS', 'COURSE_GRADING'):\n"
    "    os.environ.pop(k, None)\n"
    "open('results.jsonl', 'a').write(json.dumps({'id': '01.memory_formula', 'score': 8000}))",
    MEMORY_WRONG, CHECK_MEMORY], {"01.memory_formula": 0})
attack("visible_answers_table_env_popped", [
    "import os\nos.environ.pop('COURSE_GRADING', None)",
    "TABLE = {(1, 16, 4096, 4096, 64, 128, 4): 83886080,\n"
    "         (3, 8, 1000, 2048, 64, 128, 2): 28237824,\n"
    "         (2, 8, 48, 2048, 64, 128, 4): 12779520,\n"
    "         (4, 8, 256, 32, 128, 64, 2): 2752512,\n"
    "         (1, 16, 131072, 131072, 128, 1024, 2): 9126805504}\n"
    "def query_block_peak_bytes(B, H, Nq, Nk, d, Br, bytes_per_element):\n"
    "    return TABLE.get((B, H, Nq, Nk, d, Br, bytes_per_element), 0)",
    CHECK_MEMORY], {"01.memory_formula": "partial"})
attack("check_called_many_times", [MEMORY, "for _ in range(50):\n    " + CHECK_MEMORY],
       {"01.memory_formula": 2})
attack("forged_protocol_message", [
    "import os, json, struct\n"
    "msg = json.dumps({'op': 'verdict', 'result': {'id': '01.memory_formula', 'score': 8000},"
    " 'nbuf': 0}).encode()\n"
    "for fd in range(3, 40):\n"
    "    try:\n        os.write(fd, struct.pack('<Q', len(msg)) + msg)\n"
    "    except OSError:\n        pass",
    MEMORY_WRONG, CHECK_MEMORY], {"01.memory_formula": 0})
attack("check_of_unknown_exercise", [MEMORY, 'grader.check("07.torch_forward", print)',
                                     'grader.check("01.nope", print)', CHECK_MEMORY],
       {"01.memory_formula": 2})

# --- stealing the expected values inside the student's process ----------------------------------
attack("stack_frame_theft", [textwrap.dedent("""
    import inspect, torch
    def query_block_peak_bytes(B, H, Nq, Nk, d, Br, bytes_per_element):
        for frame in inspect.stack():
            for name, value in frame.frame.f_locals.items():
                if name in ('expected', 'want', 'ref', 'answer') and isinstance(value, int):
                    return value
        return -1
    """), CHECK_MEMORY], {"01.memory_formula": 0})
attack("gc_theft", [textwrap.dedent("""
    import gc, torch
    def naive_attention(Q, K, V, causal=False, scale=None):
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.dtype == torch.float64 \\
                    and obj.shape == Q.shape and obj is not Q:
                return obj.float()
        return torch.zeros_like(Q)
    """), CHECK_NAIVE], {"01.naive_attention": 0})
attack("lying_tensor_subclass", [textwrap.dedent("""
    import torch
    class Liar(torch.Tensor):
        def __eq__(self, other): return torch.ones_like(other, dtype=torch.bool)
        def __sub__(self, other): return torch.zeros_like(other)
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return torch.tensor(True) if 'close' in func.__name__ else \\
                super().__torch_function__(func, types, args, kwargs or {})
    def naive_attention(Q, K, V, causal=False, scale=None):
        return torch.zeros_like(Q).as_subclass(Liar)
    """), CHECK_NAIVE], {"01.naive_attention": 0})
attack("monkeypatched_torch_and_checks", [textwrap.dedent("""
    import torch
    from course_utils import checks
    torch.Tensor.any = lambda self, *a, **k: False
    torch.allclose = lambda *a, **k: True
    torch.isclose = lambda a, b, *x, **k: torch.ones_like(a, dtype=torch.bool)
    checks.compare = lambda *a, **k: None
    grader._run_case = lambda case, candidate: ("passed", "")
    grader.evaluate = lambda ex, cand, hidden_run: None
    def naive_attention(Q, K, V, causal=False, scale=None):
        return torch.zeros_like(Q)
    """), CHECK_NAIVE], {"01.naive_attention": 0})
attack("check_replaced_by_print", [
    MEMORY_WRONG, "grader.check = lambda *a: print('✅ 01.memory_formula: 3/3 cases passed')",
    CHECK_MEMORY], {"01.memory_formula": 0})

# --- library routes to the forbidden operation ------------------------------------------------
_SDPA_ARGS = "Q, K, V, attn_mask=bias, scale=scale"
for _name, _expr in {
    "aliased_sdpa_functional": f"F.scaled_dot_product_attention({_SDPA_ARGS})",
    "aliased_sdpa_private": f"torch._C._nn.scaled_dot_product_attention({_SDPA_ARGS})",
    "aliased_sdpa_ops": f"torch.ops.aten.scaled_dot_product_attention({_SDPA_ARGS})",
    "aliased_sdpa_flash_cpu":
        f"torch.ops.aten._scaled_dot_product_flash_attention_for_cpu({_SDPA_ARGS})[0]",
}.items():
    attack(_name, [_sdpa_attention(_expr), CHECK_NAIVE], {"01.naive_attention": 0})
attack("aliased_sdpa_math", [
    NAIVE + "\n_honest = naive_attention\n"
    "def naive_attention(Q, K, V, causal=False, scale=None):\n"
    "    _honest(Q, K, V, causal, scale)\n"
    "    Nq, Nk = Q.shape[-2], K.shape[-2]\n"
    "    keep = torch.ones(Nq, Nk, dtype=torch.bool, device=Q.device).tril(Nk - Nq)\n"
    "    bias = torch.zeros(Nq, Nk, device=Q.device).masked_fill(~keep, -math.inf)\n"
    "    bias = bias if causal else None\n"
    "    return torch.ops.aten._scaled_dot_product_attention_math(Q, K, V, attn_mask=bias,"
    " scale=scale)[0].nan_to_num(0.0)",
    CHECK_NAIVE], {"01.naive_attention": 0})
attack("course_reference", [
    "from course_utils import reference as r\nfrom functools import partial\n"
    "_ref = partial(r.attention)\n"
    "import torch\n"
    "def naive_attention(Q, K, V, causal=False, scale=None):\n"
    "    Nq, Nk = Q.shape[-2], K.shape[-2]\n"
    "    keep = torch.ones(Nq, Nk, dtype=torch.bool, device=Q.device).tril(Nk - Nq)\n"
    "    keep = keep if causal else None\n"
    "    return _ref(Q, K, V, mask=keep, scale=scale)[0].float()",
    CHECK_NAIVE], {"01.naive_attention": 0})
attack("import_grader_specs", [
    "from course_utils.grading.specs import ch01\nquery_block_peak_bytes = ch01.memory_formula",
    MEMORY_WRONG, CHECK_MEMORY], {"01.memory_formula": 0})

# --- reaching outside the sandbox (Landlock) ---------------------------------------------------
SOLUTION_01 = ROOT / "solutions" / "01_attention_as_classification.ipynb"
attack("execute_the_solutions", [
    "import json\n"
    f"nb = json.load(open({str(SOLUTION_01)!r}))\n"
    "for c in nb['cells']:\n"
    "    if c['cell_type'] == 'code' and 'def query_block_peak_bytes' in ''.join(c['source']):\n"
    "        exec(''.join(c['source']))",
    CHECK_MEMORY], {"01.memory_formula": 0})
attack("read_grader_memory", oracle(
    "import os\nf = open(f'/proc/{os.getppid()}/mem', 'rb')\nok = f is not None"),
    {"01.memory_formula": 0})
attack("network", oracle(
    "import socket\ns = socket.create_connection(('127.0.0.1', NET_PORT), timeout=5)\nok = True"),
    {"01.memory_formula": 0})
attack("signal_the_grader", oracle("import os\nos.kill(os.getppid(), 0)\nok = True"),
       {"01.memory_formula": 0})
# The zygote that forks the workers is the grader's child too: killing it (possible without
# Landlock's signal scoping, ABI 6) costs only warm starts, never a score.
attack("kill_the_zygote", [
    "import os, signal\n"
    "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "    try:\n"
    "        stat = open(f'/proc/{pid}/stat').read()\n"
    "        ppid = int(stat[stat.rfind(')') + 2:].split()[1])\n"
    "        if ppid == os.getppid() and b'zygote' in open(f'/proc/{pid}/cmdline', 'rb').read():\n"
    "            os.kill(int(pid), signal.SIGKILL)\n"
    "    except (OSError, ValueError):\n"
    "        pass",
    MEMORY, CHECK_MEMORY], {"01.memory_formula": 2})
attack("rewrite_the_grader_package", [
    f"open({str(ROOT / 'course_utils' / 'grading' / 'grader.py')!r}, 'a')"
    ".write('\\n# pwned\\n')",
    MEMORY_WRONG, CHECK_MEMORY], {"01.memory_formula": 0})

# --- crashes, hangs and resource abuse: one exercise lost, the others kept ----------------------
attack("infinite_loop_in_check", [
    MEMORY, CHECK_MEMORY, NAIVE.replace("scale = 1", "while True: pass\n    scale = 1"),
    CHECK_NAIVE], {"01.memory_formula": 2, "01.naive_attention": 0})
attack("infinite_loop_in_cell", [
    "while True:\n    pass", MEMORY, CHECK_MEMORY], {"01.memory_formula": 2})
attack("segfault_in_check", [
    NAIVE.replace("scale = 1", "import faulthandler; faulthandler._sigsegv()\n    scale = 1"),
    CHECK_NAIVE, MEMORY, CHECK_MEMORY], {"01.memory_formula": 2, "01.naive_attention": 0})
attack("os_exit_in_check", [
    MEMORY, CHECK_MEMORY, NAIVE.replace("scale = 1", "import os; os._exit(0)\n    scale = 1"),
    CHECK_NAIVE], {"01.memory_formula": 2, "01.naive_attention": 0})
attack("os_exit_in_cell", ["import os\nos._exit(3)", MEMORY, CHECK_MEMORY],
       {"01.memory_formula": 2})
attack("sys_exit_in_cell", ["raise SystemExit(1)", MEMORY, CHECK_MEMORY],
       {"01.memory_formula": 2})
attack("out_of_memory_in_check", [
    MEMORY, CHECK_MEMORY,
    NAIVE.replace("scale = 1", "hog = [bytearray(1 << 30) for _ in range(40)]\n    scale = 1"),
    CHECK_NAIVE], {"01.memory_formula": 2, "01.naive_attention": 0})
attack("huge_output", [
    "import torch\ndef naive_attention(Q, K, V, causal=False, scale=None):\n"
    "    return torch.zeros(1 << 31, dtype=torch.uint8)",
    CHECK_NAIVE, MEMORY, CHECK_MEMORY], {"01.memory_formula": 2, "01.naive_attention": 0})
attack("fork_bomb_lite", [
    "import os\nfor _ in range(20):\n    if os.fork() == 0:\n        import time\n"
    "        time.sleep(600)\n        os._exit(0)",
    MEMORY, CHECK_MEMORY], {"01.memory_formula": 2})

# --- switching the watch off, or forging what the student's side measures, by patching the course
attack("watch_patched_to_nothing", [
    "import contextlib\nfrom course_utils import watch\n"
    "watch.forbid = lambda *a, **k: contextlib.nullcontext()",
    _sdpa_attention(f"F.scaled_dot_product_attention({_SDPA_ARGS})"), CHECK_NAIVE],
    {"01.naive_attention": 0})
attack("harness_patched_to_lie", [
    "import course_utils.grading.harness as h\n"
    "h.largest_created = lambda fn, *a, **k: (fn(*a, **k), 1)\n"
    "h.stub_reason.__code__ = (lambda obj: '').__code__",
    _sdpa_attention(f"F.scaled_dot_product_attention({_SDPA_ARGS})"), CHECK_NAIVE],
    {"01.naive_attention": 0})

# --- the package's answers taken at cell time, where a call-time guard cannot see them ------------
attack("package_code_copied_at_cell_time", [textwrap.dedent("""
    import types, torch
    from course_utils import reference as r
    _att = types.FunctionType(r.attention.__code__, r.__dict__, 'copy', r.attention.__defaults__)
    def naive_attention(Q, K, V, causal=False, scale=None):
        Nq, Nk = Q.shape[-2], K.shape[-2]
        keep = torch.ones(Nq, Nk, dtype=torch.bool, device=Q.device).tril(Nk - Nq)
        return _att(Q, K, V, mask=keep if causal else None, scale=scale)[0].float()
    """), CHECK_NAIVE], {"01.naive_attention": 0})
attack("package_module_run_again", [textwrap.dedent("""
    import runpy, torch
    from course_utils import reference as r
    fresh = runpy.run_path(r.__file__, run_name='course_utils.reference_again')
    def naive_attention(Q, K, V, causal=False, scale=None):
        Nq, Nk = Q.shape[-2], K.shape[-2]
        keep = torch.ones(Nq, Nk, dtype=torch.bool, device=Q.device).tril(Nk - Nq)
        return fresh['attention'](Q, K, V, mask=keep if causal else None, scale=scale)[0].float()
    """), CHECK_NAIVE], {"01.naive_attention": 0})

# --- the watch switched off from inside, or left through Python lists ----------------------------
attack("torch_modes_disabled", [_sdpa_attention(
    "_off(lambda: F.scaled_dot_product_attention(Q, K, V, attn_mask=bias, scale=scale))")
    .replace("def naive_attention", textwrap.dedent("""
    def _off(f):
        from torch.utils._python_dispatch import _disable_current_modes
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            return f()

    def naive_attention""").strip("\n"), 1), CHECK_NAIVE], {"01.naive_attention": 0})
attack("left_torch_through_lists", [textwrap.dedent("""
    import math, torch
    def naive_attention(Q, K, V, causal=False, scale=None):
        scale = 1 / math.sqrt(Q.shape[-1]) if scale is None else scale
        q, k, v = Q.tolist(), K.tolist(), V.tolist()
        def rows(qh, kh, vh):
            out = []
            for i, qi in enumerate(qh):
                s = [scale * sum(a * b for a, b in zip(qi, kj)) for kj in kh]
                if causal:
                    s = [x if j <= i + len(kh) - len(qh) else -math.inf for j, x in enumerate(s)]
                m = max(s)
                if m == -math.inf:
                    out.append([0.0] * len(vh[0]))
                    continue
                p = [math.exp(x - m) for x in s]
                l = sum(p)
                out.append([sum(pj * vj[c] for pj, vj in zip(p, vh)) / l
                            for c in range(len(vh[0]))])
            return out
        o = [[rows(q[b][h], k[b][h], v[b][h]) for h in range(len(q[b]))] for b in range(len(q))]
        return torch.tensor(o, dtype=Q.dtype, device=Q.device)
    """), CHECK_NAIVE], {"01.naive_attention": 0})

# --- escaping through a restart: a crash must not hand the next worker anything ------------------
# The first run of the cell plants code everywhere a restarted Python might pick it up, then
# crashes; the restarted worker skips that cell. If any planted code ran in the new worker, it
# read the solutions and set ESCAPED, and the check below hands in the right answer.
PLANT = textwrap.dedent(f"""
    import builtins
    try:
        builtins.ESCAPED = 'query_block_peak_bytes' in open({str(SOLUTION_01)!r}).read()
    except OSError:
        pass
""")
attack("restart_plants_code", [textwrap.dedent(f"""
    import os, sys, site, glob
    import course_utils
    payload = {PLANT!r}
    package = os.path.dirname(course_utils.__file__)
    targets = ['sitecustomize.py', 'usercustomize.py', os.path.join(package, '__init__.py'),
               os.path.join(package, 'grading', 'sandbox', '__init__.py'),
               os.path.join(package, 'grading', 'grader.py'), os.path.join(package, 'runtime.py'),
               os.path.join(os.path.dirname(package), 'sitecustomize.py'),
               os.path.join(site.getusersitepackages(), 'usercustomize.py'),
               *[os.path.join(p, 'zz_course_escape.pth') for p in site.getsitepackages()]]
    for t in targets:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(t)), exist_ok=True)
            text = ('import builtins; exec(' + repr(payload) + ')') if t.endswith('.pth') \
                else payload
            with open(t, 'a') as f:
                f.write('\\n' + text + '\\n')
        except OSError:
            pass
    os.environ['PYTHONPATH'] = os.getcwd()
    os.environ['PYTHONSTARTUP'] = os.path.abspath('sitecustomize.py')
    sys.stdout.flush()
    os._exit(1)
    """),
    "import builtins\nok = getattr(builtins, 'ESCAPED', False)",
    f"{MEMORY}\nif not ok:\n{textwrap.indent(MEMORY_WRONG, '    ')}",
    CHECK_MEMORY], {"01.memory_formula": 0})
attack("restart_rewrites_pycache", [textwrap.dedent("""
    import os, py_compile, course_utils
    package = os.path.dirname(course_utils.__file__)
    src = os.path.join(os.getcwd(), 'evil.py')
    open(src, 'w').write('import builtins\\nbuiltins.ESCAPED = True\\n')
    for folder, names in (('', ('__init__', 'runtime', 'paths')),
                          ('grading', ('__init__', 'grader', 'watch', 'types')),
                          ('grading/sandbox', ('__init__', 'codec', 'isolation'))):
        cache = os.path.join(package, folder, '__pycache__')
        try:
            os.makedirs(cache, exist_ok=True)
            for name in names:
                py_compile.compile(src, os.path.join(cache, f'{name}.cpython-311.pyc'))
        except OSError:
            pass
    os._exit(1)
    """),
    "import builtins\nok = getattr(builtins, 'ESCAPED', False)",
    f"{MEMORY}\nif not ok:\n{textwrap.indent(MEMORY_WRONG, '    ')}",
    CHECK_MEMORY], {"01.memory_formula": 0})

# --- an oracle in the verdicts: only the first check of an exercise counts, and tells nothing ---
attack("oracle_wrong_then_right", [MEMORY_WRONG, CHECK_MEMORY, MEMORY, CHECK_MEMORY],
       {"01.memory_formula": 0})
attack("oracle_learns_from_messages", [textwrap.dedent("""
    import io, re, contextlib
    seen = {}
    def query_block_peak_bytes(B, H, Nq, Nk, d, Br, bytes_per_element):
        key = (B, H, Nq, Nk, bytes_per_element)
        return seen.get(key, 0)
    for _ in range(5):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            r = grader.check("01.memory_formula", query_block_peak_bytes)
        text = buf.getvalue() + str(getattr(r, 'message', ''))
        for m in re.finditer(r'expected ([0-9]+)', text):
            seen[len(seen)] = int(m.group(1))
        if getattr(r, 'ok', False):
            break
    """)], {"01.memory_formula": 0})

# --- resources: deadlines that messages cannot stretch, memory and files nobody counted -------
attack("chatty_cell_keeps_the_deadline", [textwrap.dedent("""
    import time
    from course_utils import sandbox
    while True:
        sandbox._WORKER.send({'cell_error': 0, 'error': 'still working'})
        time.sleep(0.2)
    """), MEMORY, CHECK_MEMORY], {"01.memory_formula": 2})
attack("zero_stride_output", [
    "import torch\ndef naive_attention(Q, K, V, causal=False, scale=None):\n"
    "    return torch.zeros(1).expand(1 << 30)",
    CHECK_NAIVE, MEMORY, CHECK_MEMORY], {"01.memory_formula": 2, "01.naive_attention": 0})
attack("overlapping_output", [
    "import torch\ndef naive_attention(Q, K, V, causal=False, scale=None):\n"
    "    return torch.zeros(64).as_strided((1 << 20, 1 << 10), (1, 1))",
    CHECK_NAIVE, MEMORY, CHECK_MEMORY], {"01.memory_formula": 2, "01.naive_attention": 0})
attack("dev_shm_memory", oracle(
    "f = open('/dev/shm/course-attack-hog', 'wb')\nf.write(bytes(1 << 20))\nf.close()\nok = True"),
    {"01.memory_formula": 0})
attack("udp_socket", oracle(
    "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "s.sendto(b'x', ('127.0.0.1', NET_PORT))\nok = True"), {"01.memory_formula": 0})
attack("unix_socket", oracle(
    "import socket\ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\nok = True"),
    {"01.memory_formula": 0})
attack("too_many_files", [
    "import os\nos.makedirs('many', exist_ok=True)\n"
    "for i in range(60_000):\n    open(f'many/{i}', 'w').close()\n"
    "import time\ntime.sleep(30)",
    MEMORY, CHECK_MEMORY], {"01.memory_formula": 2})

# The grader's own simulator fed a schedule of 300,000 operations: refused by its size at once
# (it was quadratic: 16,000 took 40 s, so this would have stalled the run for hours).
attack("simulator_flood", [
    "def pipeline_schedule(n_tiles, stages):\n"
    "    return [('wait', 0), ('commit',), ('barrier',)] * 100_000",
    'grader.check("10.wait_placement", pipeline_schedule)'],
    {"10.wait_placement": 0}, chapter="10")

# Attacks that only the kernel's Landlock (of at least this ABI) can stop.
NEEDS_ABI = {"execute_the_solutions": 1, "read_grader_memory": 1, "rewrite_the_grader_package": 1,
             "overwrite_other_notebooks": 1, "forge_other_results": 1, "network": 4,
             "signal_the_grader": 6,
             "restart_plants_code": 1, "restart_rewrites_pycache": 1, "dev_shm_memory": 1,
             "udp_socket": 1, "unix_socket": 1}

ORPHAN_MARK = "course-grade-orphan-test"
# (the path is filled in by the fixture: a file the orphan would write after the run ends)
attack("orphan_daemon", [
    "import subprocess, sys\n"
    "subprocess.Popen([sys.executable, '-c', 'import time, sys; time.sleep(4); "
    "open(sys.argv[1], \"w\").write(\"escaped\")', ORPHAN_TARGET, " + repr(ORPHAN_MARK) + "],"
    " start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,"
    " stderr=subprocess.DEVNULL)\n"
    "import os\nif os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(6)\n"
    "    os._exit(0)",
    MEMORY, CHECK_MEMORY], {"01.memory_formula": 2})
attack("overwrite_other_notebooks", [
    "import glob, os, json\n"
    "for p in glob.glob(os.path.join(OTHERS_DIR, '01_*.ipynb')):\n"
    "    try:\n        open(p, 'w').write('{}')\n    except OSError:\n        pass",
    MEMORY, CHECK_MEMORY], {"01.memory_formula": 2})

# The class's output folder, where every notebook's report is stored as it finishes (read
# by a rerun and by grades.json): graded beside other notebooks (--jobs 2), a notebook may
# neither plant a report nor read the others'.
attack("forge_other_results", [
    "import os, json\n"
    "forged = {'notebook': 'x', 'sha256': 'x', 'course_version': 'x', 'report': {'score': 99}}\n"
    "for name in ('forged.json', 'grades.json'):\n"
    "    try:\n        open(os.path.join(RESULTS_DIR, name), 'w').write(json.dumps(forged))\n"
    "    except OSError:\n        pass\n"
    "try:\n    LEAKED = os.listdir(RESULTS_DIR)\nexcept OSError:\n    LEAKED = None\n"
    "assert LEAKED is None, f'read the results folder: {LEAKED}'",
    MEMORY, CHECK_MEMORY], {"01.memory_formula": 2})

# --- honest notebooks: full marks, and partial credit for an honest bug -------------------------
HONEST = {"01.memory_formula": 2, "01.naive_attention": 4}
attack("honest_a", [MEMORY, CHECK_MEMORY, NAIVE, CHECK_NAIVE], HONEST)
attack("honest_b", [NAIVE, CHECK_NAIVE, MEMORY, CHECK_MEMORY], HONEST)
attack("honest_bug_no_causal_mask", [NAIVE.replace("if causal:", "if False:"), CHECK_NAIVE],
       {"01.naive_attention": "partial"})


def _register_chapter_attacks():
    """Attacks aimed at one chapter's graders live beside this file, one module per chapter
    (``tests/attacks_chNN.py``, each with ``register(attack)``), so that chapters add theirs
    without touching this list."""
    import importlib.util

    for path in sorted(Path(__file__).parent.glob("attacks_ch*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.register(attack)


_register_chapter_attacks()

BROKEN_FILES = {
    "01_broken_json.ipynb": "{ this is not json",
    "01_not_a_notebook.ipynb": json.dumps({"cells": "nope"}),
    "no_chapter_number.ipynb": None,  # filled with an honest notebook: the name alone is wrong
}


# The grading runs must survive a container of this much memory. The slow run grades two
# notebooks at once (--jobs 2, --memory-mb 1536 each): a notebook can pass its limit for the
# tenth of a second before the grader sees it (huge_output's 2 GiB at once), beside the other
# notebook and two grading processes with their zygotes.
CONTAINER_BYTES = 6 << 30
TIMEOUT = 25  # s per cell and per exercise (ranks, simulators, memory that grows)
QUICK_TIMEOUT = 15  # s for the attacks that only wait for the limit (chapter 01's tiny checks)
# The honest exercise beside each of them must be graded within it too, while the suite's
# workers and the other grading run share the two cores: at 10 s it timed out once, with one
# more process running beside the suite. The quick run still ends before the other one.
WAIT_FOR_THE_LIMIT = ("infinite_loop_in_check", "infinite_loop_in_cell",
                      "chatty_cell_keeps_the_deadline")


class MemoryContainer:
    """A memory cgroup (v1, or v2 where its controller is delegated) that the grade command
    runs in, like a container's limit: processes past it meet the kernel's OOM killer. Where
    this machine does not let the test make one, ``path`` is None and the run is unconfined."""

    LAYOUTS = (("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.max_usage_in_bytes"),
               ("/sys/fs/cgroup", "memory.max", "memory.peak"))

    def __init__(self, limit: int, name: str = ""):
        self.path = self.peak_file = None
        for root, limit_file, peak_file in self.LAYOUTS:
            path = Path(root) / f"course-grade-test-{os.getpid()}{name}"
            try:
                path.mkdir()
            except OSError:
                continue
            try:
                (path / limit_file).write_text(str(limit))
            except OSError:
                path.rmdir()
                continue
            self.path, self.peak_file = path, path / peak_file
            break

    def enter(self):
        """For ``preexec_fn``: move the new process into the container."""
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        try:
            return int(self.peak_file.read_text())
        except (OSError, ValueError, AttributeError):
            return None

    def oom_kills(self) -> int | None:
        for name, key in (("memory.oom_control", "oom_kill"), ("memory.events", "oom_kill")):
            try:
                for line in (self.path / name).read_text().splitlines():
                    if line.startswith(key + " "):
                        return int(line.split()[1])
            except (OSError, TypeError):
                continue
        return None

    def remove(self):
        if self.path is not None:
            for _ in range(50):
                try:
                    self.path.rmdir()
                    return
                except OSError:
                    time.sleep(0.1)


def notebook(cells: list[str]) -> str:
    return json.dumps({
        "cells": [{"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
                   "source": src} for src in [SETUP, *cells]],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5,
    })


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    import socket

    listener = socket.socket()  # a port the "network" attack could reach without the sandbox
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    folder = tmp_path_factory.mktemp("attacks")
    out = tmp_path_factory.mktemp("grades")
    orphan_target = folder.parent / "orphan_wrote_this"
    prelude = (f"ORPHAN_TARGET = {str(orphan_target)!r}\n"
               f"OTHERS_DIR = {str(folder)!r}\nNET_PORT = {listener.getsockname()[1]}\n"
               f"RESULTS_DIR = {str(out / 'results')!r}")
    quick, slow = [], []  # the two runs' notebooks
    for name, (cells, _) in ATTACKS.items():
        path = folder / file_of(name)
        path.write_text(notebook([prelude, *cells]))
        (quick if name in WAIT_FOR_THE_LIMIT else slow).append(path)
    # the orphan's notebook first: the check that it did not outlive the run then needs no wait
    slow.sort(key=lambda path: path.name != file_of("orphan_daemon"))
    for name, text in BROKEN_FILES.items():
        path = folder / name
        path.write_text(text if text is not None else notebook([MEMORY, CHECK_MEMORY]))
        slow.append(path)
    for name in ("honest_a", "honest_b"):  # the quick run's own honest notebooks
        path = folder / f"01_{name}_beside_chapters.ipynb"
        path.write_text(notebook([prelude, *ATTACKS[name][0]]))
        quick.append(path)
    paths = quick + slow
    before = {p: p.read_bytes() for p in paths}
    package_before = {p: p.read_bytes() for p in (ROOT / "course_utils").rglob("*.py")}
    quick_out = tmp_path_factory.mktemp("grades_quick")
    (out / "grades.json").unlink(missing_ok=True)
    os.mkfifo(out / "grades.csv")  # a FIFO planted at the output name must not hang the run
    env = dict(os.environ)
    env.pop("COURSE_CHECKS_RAISE", None)
    # The two runs at once, each in its own container: the quick one mostly waits for its
    # limit, while the other grades.
    container, quick_container = MemoryContainer(CONTAINER_BYTES), MemoryContainer(
        CONTAINER_BYTES, "-quick")
    start = time.monotonic()
    runs, logs = [], []
    try:
        for notebooks, dest, timeout, box in ((quick, quick_out, QUICK_TIMEOUT, quick_container),
                                              (slow, out, TIMEOUT, container)):
            logs.append((dest / "stdout.log", dest / "stderr.log"))
            with open(logs[-1][0], "w") as stdout, open(logs[-1][1], "w") as stderr:
                runs.append(subprocess.Popen(
                    [sys.executable, "-m", "course_utils", "grade", *map(str, notebooks),
                     "--out", str(dest), "--timeout", str(timeout), "--notebook-timeout", "300",
                     "--memory-mb", "1536", "--jobs", "2"],  # see CONTAINER_BYTES
                    stdout=stdout, stderr=stderr, env=env, cwd=folder, preexec_fn=box.enter,
                ))
        for run in runs:
            run.wait(timeout=1800)
        outputs = [(o.read_text(), e.read_text()) for o, e in logs]
        elapsed = time.monotonic() - start
        memory = {"confined": container.path is not None, "peak": container.peak(),
                  "oom_kills": container.oom_kills()}
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
        container.remove()
        quick_container.remove()
    listener.close()
    for run, (stdout, stderr) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, stdout[-3000:] + stderr[-3000:]
    # The orphan sleeps 4 s, from a cell of the slow run's first notebook: by this time, an
    # escaped one has written its file.
    time.sleep(max(0.0, start + 2 * TIMEOUT + 7 - time.monotonic()))
    data = [*json.loads((out / "grades.json").read_text()),
            *json.loads((quick_out / "grades.json").read_text())]
    by_name = {Path(rep["notebook"]).name: rep for rep in data}
    return {"reports": by_name, "paths": paths, "before": before, "orphan": orphan_target,
            "package_before": package_before, "stdout": outputs[0][0] + outputs[1][0],
            "elapsed": elapsed, "memory": memory, "out": out}


def _score(report, exercise):
    return next(e for e in report["exercises"] if e["id"] == exercise)


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_scores_what_an_honest_grader_gives(graded, name):
    if LANDLOCK < NEEDS_ABI.get(name, 0):
        pytest.skip(f"only Landlock ABI >= {NEEDS_ABI[name]} stops this (this kernel: {LANDLOCK})")
    report = graded["reports"][file_of(name)]
    for exercise, expected in ATTACKS[name][1].items():
        got = _score(report, exercise)
        where = f"{name}: {exercise}: {got['status']}: {got['message'][:300]}"
        if expected == "partial":
            assert 0 < got["score"] < got["points"], where
        else:
            assert got["score"] == expected, where
        assert got["score"] <= got["points"], where
    if LANDLOCK >= 1:
        assert report["isolation"].startswith("landlock"), report["isolation"]
        assert "verified:" in report["isolation"] and "NOT" not in report["isolation"]


def test_every_exercise_of_the_chapter_is_always_reported(graded):
    for name, report in graded["reports"].items():
        if name.startswith("01_"):
            ids = [e["id"] for e in report["exercises"]]
            assert {"01.memory_formula", "01.naive_attention"} <= set(ids), (name, ids)


def test_no_notebook_reaches_the_class_results(graded):
    """Graded two at a time, a notebook cannot list, read or plant the stored reports that a
    rerun would trust (OUT/results/, where each notebook's report lands as it finishes)."""
    if LANDLOCK < 1:
        pytest.skip("only Landlock keeps a worker out of the output folder")
    results = graded["out"] / "results"
    assert not (results / "forged.json").exists()
    report = graded["reports"][file_of("forge_other_results")]
    assert not any("read the results folder" in e for e in report["cell_errors"]), report
    for path in results.glob("*.json"):
        entry = json.loads(path.read_text())
        assert entry["report"]["score"] <= entry["report"]["points"], path
        assert Path(entry["notebook"]).name in graded["reports"], path  # only the grader's


def test_broken_files_cost_only_themselves(graded):
    reports = graded["reports"]
    assert "not a valid notebook" in reports["01_broken_json.ipynb"]["failure"]
    assert "not a valid notebook" in reports["01_not_a_notebook.ipynb"]["failure"]
    assert "chapter number" in reports["no_chapter_number.ipynb"]["failure"]
    for rep in reports.values():
        assert rep["score"] <= rep["points"]
    for honest in ("01_honest_a.ipynb", "01_honest_b.ipynb", "no_chapter_number.ipynb",
                   "01_honest_a_beside_chapters.ipynb", "01_honest_b_beside_chapters.ipynb"):
        if honest.startswith("01_"):
            assert reports[honest]["score"] == sum(HONEST.values())


def test_a_timed_out_or_crashed_exercise_says_why(graded):
    reports = graded["reports"]
    naive = _score(reports["01_infinite_loop_in_check.ipynb"], "01.naive_attention")
    assert naive["status"] == "timed out" and "limit" in naive["message"]
    for name in ("segfault_in_check", "os_exit_in_check"):
        assert _score(reports[f"01_{name}.ipynb"], "01.naive_attention")["status"] == "crashed"
    for name in ("honest_a", "infinite_loop_in_check", "segfault_in_check", "os_exit_in_check",
                 "out_of_memory_in_check"):  # the attacks' own code must at least run
        assert not reports[f"01_{name}.ipynb"]["cell_errors"], name
    oom = _score(reports["01_out_of_memory_in_check.ipynb"], "01.naive_attention")
    assert oom["status"] in ("out of memory", "crashed"), oom
    looped = reports["01_infinite_loop_in_cell.ipynb"]["cell_errors"]
    assert any("timed out" in e for e in looped), looped


def test_the_grader_refuses_a_flood_without_stalling(graded):
    flood = _score(graded["reports"][file_of("simulator_flood")], "10.wait_placement")
    assert flood["status"] == "failed", flood
    assert "timed out" not in flood["message"], flood


def test_only_the_first_check_counts_and_tells_nothing(graded):
    first_wrong = _score(graded["reports"][file_of("oracle_wrong_then_right")],
                         "01.memory_formula")
    assert first_wrong["status"] == "failed" and first_wrong["score"] == 0


def test_patching_the_course_is_named(graded):
    for name in ("watch_patched_to_nothing", "harness_patched_to_lie"):
        got = _score(graded["reports"][file_of(name)], "01.naive_attention")
        assert got["status"] == "forbidden" and "replaced the course" in got["message"], got


def test_forbidden_routes_name_what_was_found(graded):
    reports = graded["reports"]
    msg = _score(reports["01_aliased_sdpa_ops.ipynb"], "01.naive_attention")["message"]
    assert "forbids" in msg and "scaled_dot_product" in msg
    msg = _score(reports["01_course_reference.ipynb"], "01.naive_attention")["message"]
    assert "course_utils.reference.attention" in msg


@needs_landlock
def test_no_file_outside_the_scratch_folder_changed(graded):
    for path, content in graded["before"].items():
        assert path.read_bytes() == content, f"{path.name} was changed by a notebook"
    for path, content in graded["package_before"].items():
        assert path.read_bytes() == content, f"{path} was changed by a notebook"


def test_no_process_outlives_the_run(graded):
    assert not graded["orphan"].exists(), "a process started by a notebook outlived grading"
    leftovers = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if ORPHAN_MARK.encode() in cmdline:
            leftovers.append(entry)
    assert not leftovers, f"processes still running: {leftovers}"


def test_outputs_replace_planted_files(graded):
    csv_path = graded["out"] / "grades.csv"
    assert csv_path.is_file() and "01.memory_formula" in csv_path.read_text()


def test_the_run_survives_a_4_gib_container(graded):
    """The whole run (grader and workers) ran in a 4 GiB memory cgroup and finished with every
    report written: the OOM killer, when a notebook reached it, took a worker, never the grader
    (workers volunteer for it). Skipped where this machine lets no test make a cgroup."""
    memory = graded["memory"]
    if not memory["confined"]:
        pytest.skip("no memory cgroup could be made here (needs root and cgroup v1 or v2)")
    print(f"peak {memory['peak'] / 2**30:.2f} GiB of {CONTAINER_BYTES / 2**30:g}, "
          f"OOM kills {memory['oom_kills']}")
    assert len(graded["reports"]) == len(ATTACKS) + len(BROKEN_FILES) + 2  # 2 honest, twice
    assert memory["peak"] is None or memory["peak"] <= CONTAINER_BYTES


def test_the_attack_suite_is_big_enough():
    assert len(ATTACKS) + len(BROKEN_FILES) >= 30
