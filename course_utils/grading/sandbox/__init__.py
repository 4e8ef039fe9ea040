"""Grading at arm's length: each notebook runs in a sandboxed worker; the grader keeps the answers.

``python -m course_utils grade`` runs every notebook in its own worker process and runs the
checks in the grading process. The two talk over a pair of pipes::

    grading process                              worker (the student's notebook)
    ---------------                              --------------------------------
                                   <- "cell 3"   runs cell 3
                      <- "check 07.x, here is a candidate"   grader.check("07.x", fn)
    case.run(RemoteCandidate)
      draws inputs, computes expected            (never sees them)
      -> "call fn(Q, K, V)"                       runs fn under watch.forbid
                  <- outputs + the args' memory   (poisoned buffers it wrote into come back)
      compares, hints, scores
    -> "verdict"                                  prints it, goes on with the next cell

What this protects, and how:

- **The score** is computed here from data the worker sends back (tensors, arrays, numbers):
  the expected values, the comparisons and the points never enter the worker, so patching the
  checks, reading the checker's stack, lying tensor subclasses or a forged results file change
  nothing. Messages are decoded by a strict codec (no pickle): only plain data crosses, and a
  view that repeats memory (a zero or overlapping stride) or leaves it is refused before
  anything is built from it.
- **No oracle**: the first check of an exercise is the graded one, and the worker is told
  only that it was handed in; the cases, hints and score go to the report, never back.
- **Time and memory**: every cell and every exercise has a time limit (the exercise's covers
  the grader's own checks too; messages from the worker never extend a deadline), the worker's
  processes together a memory limit, its scratch folder a disk limit; past them the whole
  process tree is killed, that exercise (or cell) scores 0 with the reason, and the notebook
  is re-run from the top in a fresh worker with the exercises already graded skipped, so one
  endless loop costs one exercise, not the notebook. Workers ask the kernel's OOM killer to
  choose them first, so a container's memory limit never takes the grader.
- **Every start from clean files**: each start (and each restart) gets a new scratch folder,
  the only place it may write, and a new read-only copy of what it may import from
  ``course_utils`` (:mod:`course_utils.grading.worker_package`: no ``specs``, no function that
  answers an exercise). The interpreter runs isolated (``-I``: no user site, ``PYTHONPATH`` or
  ``sitecustomize`` of the worker's making) and locks itself in before it imports anything a
  worker could have written. It starts warm: forked, with torch already imported, by a zygote
  that never holds a notebook's code (:mod:`.zygote`; ``COURSE_ZYGOTE=0`` starts each worker
  from nothing). The course's own code in the worker is saved before the first cell; a request
  finds it replaced and refuses the exercise.
- **Other notebooks and the instructor's files**: on Linux with Landlock (kernel 5.13+) the
  worker can write only its scratch folder (and the null, random and GPU devices), cannot read
  the course's tree, the notebooks' folders or ``/dev/shm``, cannot open TCP connections (ABI
  4+) or signal the grader (ABI 6+); a seccomp filter (:mod:`course_utils.grading.seccomp`) denies
  every other socket. **The grader then checks the lock from outside** before any cell runs: the
  worker tries to read protected files (the grader compares what came back with the files),
  to write outside its folder (the grader looks for the files) and to send datagrams to the
  grader's own sockets (the grader listens). A lock that did not hold stops that notebook;
  ``isolation`` in the report says what was verified. The grader reads every notebook before
  running any, keeps results in memory, writes ``grades.json`` and ``.csv`` atomically at the
  end, and is a child subreaper: processes a notebook starts are killed when its worker ends.

Limits: without Landlock (older kernels, some containers) a notebook can still read and write
the user's files, though never the grades of the others in the same run, and the report says
"NOT isolated". The forbidden-operation watch runs inside the worker: code that tampers with
the interpreter during the call itself (``gc`` on a running helper's objects, ``ctypes``) is
not caught by it, only by the checks of what its code produces (docs/instructors.md: limits).

The package's rooms: this module holds the two ends of a worker, the worker's own loop
(:func:`worker_main`: lock in, snapshot the course's code, run the cells, serve the grader's
requests) and the grader's handle on it (:func:`start_worker`, :class:`Worker`,
:class:`RemoteCandidate`), which use everything below them:

- :mod:`.codec`: the messages (plain data, framing, exceptions), shared with the ranks;
- :mod:`.process`: process trees, memory and disk limits, rlimits;
- :mod:`.isolation`: the package copy, the scratch folders, Landlock and the probe.

Every public name of those modules (and the private ones that ``ranks`` and the tests use) is
importable from here, as before the split. The two ends stay in this module: the worker's
state (``_WORKER``, its channel; ``_PRISTINE``) is read here by :func:`in_worker` and
:func:`hand_over` (and by ``sandbox._WORKER`` in the attack tests), the worker starts with
``from course_utils.grading.sandbox import worker_main``, and each end uses all three rooms.
"""


from __future__ import annotations

import os
import select
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ... import paths
from ..types import Candidate, Result
from . import zygote
from .codec import (  # noqa: F401 (re-exported: the codec's names, as before the split)
    _BUILTIN_ERRORS,
    _TORCH_DTYPES,
    MAX_DIMS,
    MAX_HEADER,
    MAX_ITEMS,
    TOO_MANY,
    ProtocolError,
    Unsendable,
    _check_layout,
    _Decoder,
    _Encoder,
    _np,
    _raised,
    _Reader,
    _rebuild_exception,
    _torch,
    _write_all,
    send,
)
from .isolation import (  # noqa: F401 (re-exported)
    _DEVICES,
    _UNREADABLE_DEVICES,
    PACKAGE,
    _first_file,
    _import_path,
    _Listeners,
    _probe,
    _probe_spec,
    _read_allow_list,
    _start_cuda_driver,
    _writable_devices,
    copy_package,
    landlock_abi,
    landlock_restrict,
    remove_tree,
    scratch_root,
    verify_isolation,
)
from .process import (  # noqa: F401 (re-exported)
    SCRATCH_ENTRIES,
    Limits,
    _apply_rlimits,
    _exit_reason,
    _proc_children,
    _rss_bytes,
    _tree_usage,
    _volunteer_for_oom_killer,
    descendants,
    kill_tree,
    set_subreaper,
)

_WORKER = None  # the worker's channel to the grader, inside a worker


def in_worker() -> bool:
    """True inside a sandboxed grading worker."""
    return _WORKER is not None


class WorkerLost(BaseException):  # noqa: N818 (not an Exception: no case may catch it)
    """The worker died, hung or used too much memory during a request."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


# ============================================================================= the worker side


class _Channel:
    def __init__(self, fd_in, fd_out):
        self.reader = _Reader(fd_in, 1 << 40)
        self.fd_out = fd_out
        self.skip_ids: set[str] = set()

    def send(self, header, buffers=()):
        send(self.fd_out, header, buffers)

    def recv(self):
        return self.reader.recv()


def _describe_candidate(obj, depth=0):
    if isinstance(obj, (tuple, list)) and depth < 2:
        items = [_describe_candidate(x, depth + 1) for x in obj]
        return {"seq": type(obj).__name__, "items": items}
    return {"object": type(obj).__name__}


def _at(obj, path):
    for i in path:
        obj = obj[i]
    return obj


class _Pristine:
    """The course's own code in the worker as it was before the notebook's first cell.

    Taken after the harness modules are imported and before any cell runs: every
    function, class and module that a ``course_utils`` module holds at module level, and each
    function's code. Before each request of the grader the worker checks that nothing was
    replaced, and it calls the watch and the harness helpers it saved here, never what the
    notebook's namespace now says: a notebook that swaps ``watch.forbid`` for a no-op, or
    ``harness.ch07.largest_tensor`` for one that reports a small tensor, gets the exercise
    refused as forbidden instead. (Code that tampers during the call itself, e.g. by reaching
    a running helper's objects through ``gc``, is beyond what one process can watch: see the
    limits in docs/instructors.md.)
    """

    def __init__(self):
        import importlib
        import pkgutil
        import types

        harness = importlib.import_module("course_utils.grading.harness")
        # Every chapter's helpers, not only this chapter's: a case may call another chapter's
        # (chapter 11's paged prefill runs chapter 09's Triton check). About 0.5 s more.
        for info in pkgutil.iter_modules(harness.__path__):
            importlib.import_module(f"course_utils.grading.harness.{info.name}")
        kinds = (types.FunctionType, type, types.ModuleType, types.BuiltinFunctionType)
        self.entries = {}
        for name, module in list(sys.modules.items()):
            if name != "course_utils" and not name.startswith("course_utils."):
                continue
            if module is None:
                continue
            saved = {k: v for k, v in vars(module).items() if isinstance(v, kinds)}
            codes = {k: v.__code__ for k, v in saved.items()
                     if isinstance(v, types.FunctionType)}  # fmt: skip
            self.entries[name] = (module, saved, codes)
        from ..watch import forbid

        self.forbid = forbid

    def changed(self) -> list[str]:
        """``module.name`` of every saved entry the notebook replaced or whose code it swapped."""
        found = []
        for name, (module, saved, codes) in self.entries.items():
            now = vars(module)
            for key, value in saved.items():
                if now.get(key) is not value or (key in codes and value.__code__ is not codes[key]):
                    found.append(f"{name}.{key}")
        return found

    def resolve(self, target: str):
        """The saved student-side helper ``"course_utils.grading.harness...:function"``."""
        module, _, name = str(target).partition(":")
        entry = self.entries.get(module)
        if not module.startswith("course_utils.grading.harness") or entry is None or \
                name not in entry[1]:
            raise ProtocolError(f"no student-side helper {str(target)[:80]!r}")
        return entry[1][name]


_PRISTINE: _Pristine | None = None


def _serve(channel: _Channel, candidate) -> dict:
    """Answer the grader's requests about ``candidate`` until it sends the verdict."""
    from ..watch import ForbiddenCall

    pristine = _PRISTINE
    while True:
        header, buffers = channel.recv()
        op = header.get("op")
        if op == "verdict":
            return header
        try:
            dec = _Decoder(header["regions"], buffers)
            args = dec.dec(header.get("args", {"t": "tuple", "v": []}))
            kwargs = dec.dec(header.get("kwargs", {"t": "dict", "k": [], "v": []}))
            obj = _at(candidate, header.get("path", []))
            changed = pristine.changed()
            if changed:
                raise ForbiddenCall(
                    f"the notebook replaced the course's own code ({', '.join(changed[:4])}): "
                    "the checks cannot trust what they measure, so this exercise is refused. "
                    "Leave course_utils as it is.")
            with pristine.forbid(header.get("forbidden", ()),
                                 torch_only=header.get("torch_only", False)):
                if op == "call":
                    out = obj(*args, **kwargs)
                elif op == "launch":
                    config = dec.dec(header["config"])
                    out = obj[config](*args)
                elif op == "invoke":
                    out = pristine.resolve(header["target"])(obj, *args, **kwargs)
                else:
                    raise ProtocolError(f"unknown request {op!r}")
            from ...runtime import synchronize

            synchronize()
            known = [(("region", i), v, {"kind": "torch", "device": str(v.device),
                                          "nbytes": v.numel()})
                     for i, v in enumerate(dec.views)]  # fmt: skip
            enc = _Encoder(known)
            for i, v in enumerate(dec.views):  # map the args' storages to their regions
                enc.keys[("torch", v.untyped_storage().data_ptr(), v.numel(), str(v.device))] = i
            try:
                value = enc.enc(out)
            except TypeError as exc:  # what was returned cannot cross: not the code's crash
                raise Unsendable(str(exc)) from None
            reply, out_buffers = enc.message({"ok": value})
            back = [v.detach().cpu().numpy() for v in dec.views]
            channel.send(dict(reply, nback=len(back)), [*back, *out_buffers])
        except Exception as exc:  # the student's code raised: send what and where
            channel.send(_raised(exc))


def hand_over(exercise_id: str, candidate):
    """``grader.check`` inside a worker: the grader runs the cases and sends the verdict."""

    channel = _WORKER
    if exercise_id in channel.skip_ids:
        print(f"{exercise_id}: graded in an earlier run of this notebook")
        return Result(exercise_id, "", 0, 0.0, 0, 0, "graded earlier", "", True)
    channel.send({"check": exercise_id, "shape": _describe_candidate(candidate)})
    verdict = _serve(channel, candidate)
    print(str(verdict.get("text", ""))[:500])
    # The score stays with the grader: the notebook learns that it handed in, nothing more.
    return Result(exercise_id, "", 0, 0.0, 0, 0, "handed in", "", True)


def _run_cells(channel: _Channel, cells: list[str], skip_cells: set[int]) -> None:
    try:
        from IPython.core.interactiveshell import InteractiveShell

        shell = InteractiveShell.instance()
    except Exception:  # IPython missing: plain exec in one namespace
        shell = None
    namespace = {"__name__": "__main__"}
    for index, source in enumerate(cells):
        if index in skip_cells:
            continue
        channel.send({"cell": index})
        error = None
        if shell is not None:
            result = shell.run_cell(source, store_history=True, silent=False)
            exc = result.error_before_exec or result.error_in_exec
            if exc is not None:
                error = f"{type(exc).__name__}: {exc}"
        else:
            try:
                exec(compile(source, f"<cell {index}>", "exec"), namespace)
            except BaseException as exc:  # noqa: BLE001 (a cell's error is reported, not fatal)
                error = f"{type(exc).__name__}: {exc}"
        if error:
            channel.send({"cell_error": index, "error": error[:2000]})
        sys.stdout.flush()
    channel.send({"done": True})


class _NoSpecs:
    """An import hook: ``course_utils.grading.specs`` (the grader's side) does not exist in a
    worker."""

    def find_spec(self, name, path=None, target=None):
        if name == "course_utils.grading.specs" or name.startswith("course_utils.grading.specs."):
            raise ImportError(
                f"{name} is the grader's side and is not available while a notebook is graded: "
                "import constants from course_utils.grading.harness instead"
            )
        return None


def worker_main(fd_in: int, fd_out: int) -> None:
    """Entry point of a worker: read the job, lock itself in, prove it, run the notebook's cells.

    Runs from the fresh read-only package copy the grader made for this start, in an
    interpreter started with ``-I`` (no user site, no ``PYTHONPATH``, no current folder on the
    path): until the lock below, only code the grader wrote has run, and nothing has been
    imported from a folder any worker could write. The probe then tries what a locked worker
    must not be able to do; the grader checks the outcome from outside before it says "go".
    """
    global _WORKER
    channel = _Channel(fd_in, fd_out)
    job, _ = channel.recv()
    # The grader's own import path (what the instructor set up: PYTHONPATH, user site), never a
    # folder a worker can write; nothing is imported from it before the lock below.
    sys.path[1:1] = [p for p in job.get("sys_path", []) if isinstance(p, str)]
    _apply_rlimits(job.get("limits", {}))
    _volunteer_for_oom_killer()
    locked = {}
    if job.get("landlock"):
        try:
            locked["landlock"] = landlock_restrict(**job["landlock"])
        except Exception as exc:  # an odd kernel or /proc: say so; the probe tells the rest
            locked["landlock"] = f"unavailable ({type(exc).__name__}: {exc})"
    if job.get("start_cuda"):
        _start_cuda_driver()
    if job.get("seccomp"):
        try:
            from ..seccomp import deny_sockets

            locked["seccomp"] = deny_sockets()
        except Exception as exc:
            locked["seccomp"] = f"unavailable ({type(exc).__name__}: {exc})"
    if job.get("probe"):
        locked["probe"] = _probe(job["probe"])
    channel.send({"locked": locked})
    go, _ = channel.recv()
    if go.get("op") != "go":
        os._exit(4)
    sys.meta_path.insert(0, _NoSpecs())
    channel.skip_ids = set(job.get("skip_ids", ()))
    _WORKER = channel
    global _PRISTINE
    try:
        from ...runtime import setup

        setup(verbose=False)  # what the notebook's first cell does; the harness needs the mode
        _PRISTINE = _Pristine()
    except Exception as exc:
        channel.send({"fatal": f"the worker could not load the course's helpers: "
                               f"{type(exc).__name__}: {exc}"})
        os._exit(3)
    here = paths.PACKAGE  # the course_utils this worker imported
    if str(here.parent) != job["package"]:
        channel.send({"fatal": f"course_utils was imported from {here}, not the worker's copy"})
        os._exit(3)
    _run_cells(channel, job["cells"], set(job.get("skip_cells", ())))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ============================================================================= the grader side


@dataclass
class Worker:
    """A running worker: its process, the two pipe ends the grader holds, and its folders."""

    proc: object
    fd_to: int
    fd_from: int
    limits: Limits
    keep: frozenset = field(default_factory=frozenset)
    reader: _Reader | None = None
    deadline: float = 0.0
    isolation: str = ""  # what was verified from outside after the start
    verified: bool = False
    lock_requested: bool = False  # Landlock was asked for: a lock that did not hold stops it
    scratch: Path | None = None  # the only folder it may write
    package: Path | None = None  # its read-only copy of course_utils (the folder above it)

    def wait_ready(self, fd):
        """Block until ``fd`` is readable; WorkerLost past the deadline or a resource limit."""
        last_poll = 0.0
        while True:
            now = time.monotonic()
            if now > self.deadline:
                raise WorkerLost("timed out", "ran longer than its time limit")
            ready, _, _ = select.select([fd], [], [], min(0.1, max(self.deadline - now, 0.001)))
            if ready:
                return
            if now - last_poll > 0.25:
                last_poll = now
                self.check_resources()

    def check_resources(self):
        """WorkerLost if the worker died, or its memory or files passed their limits."""
        if self.proc.poll() is not None:
            raise WorkerLost("crashed", f"the notebook's process exited "
                                        f"({_exit_reason(self.proc.returncode)})")
        pids = [self.proc.pid, *descendants(self.proc.pid)]
        rss = _rss_bytes(pids)
        limit = self.limits.memory_mb
        if rss > limit << 20:
            raise WorkerLost("out of memory", f"used {rss >> 20} MiB of memory, more "
                                              f"than the limit of {limit} MiB")
        if self.scratch is not None:
            used, entries = _tree_usage(str(self.scratch), SCRATCH_ENTRIES)
            if used > self.limits.scratch_mb << 20:
                raise WorkerLost("out of disk", f"wrote {used >> 20} MiB of files, more than "
                                                f"the limit of {self.limits.scratch_mb} MiB")
            if entries > SCRATCH_ENTRIES:
                raise WorkerLost("out of disk", f"made more than {SCRATCH_ENTRIES} files")

    def recv(self):
        try:
            return self.reader.recv(self.wait_ready)
        except EOFError:
            self.proc.wait(timeout=5) if self.proc.poll() is None else None
            raise WorkerLost("crashed", "the notebook's process ended "
                                        f"({_exit_reason(self.proc.poll())})") from None
        except ProtocolError as exc:
            raise WorkerLost("error", f"the notebook sent a malformed message ({exc})") from None

    def send(self, header, buffers=()):
        try:
            send(self.fd_to, header, buffers)
        except (BrokenPipeError, OSError):
            raise WorkerLost("crashed", "the notebook's process stopped listening") from None

    def stop(self):
        """Kill the worker and all it started, then delete its folders: none is used again."""
        kill_tree(self.proc.pid, frozenset(self.keep or ()) | zygote.pids())
        for fd in (self.fd_to, self.fd_from):
            try:
                os.close(fd)
            except OSError:
                pass
        for folder in (self.scratch, self.package):
            if folder is not None:
                remove_tree(folder)


# What a worker would import at every start: its zygote imports them once (a warm start).
# torch._dynamo too: many torch functions import it on their first call (about 2 s of CPU in
# every worker of chapters 01 and 12 until it was preloaded; it imports triton itself).
WORKER_PRELOAD = ("torch", "numpy", "IPython.core.interactiveshell", "triton", "torch._dynamo")

_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from course_utils.grading.sandbox import worker_main; "
         "worker_main(int(sys.argv[2]), int(sys.argv[3]))")  # fmt: skip


def start_worker(run_root: Path, job: dict, limits: Limits, keep, protected) -> Worker:
    """Start a worker in fresh folders under ``run_root``, lock it in and verify the lock.

    Every start (the first and each restart) gets a new scratch folder, the only place it may
    write, and a new read-only copy of ``course_utils`` made here: a worker never imports
    anything a worker could have written. The interpreter runs isolated (``-I``: no user site,
    no ``PYTHONPATH``, no ``sitecustomize`` from the scratch folder; ``-B``: no bytecode
    written). ``protected`` lists paths it may not read. The isolation is then checked from
    outside (:func:`verify_isolation`) before any of the notebook's cells runs.
    """
    import subprocess

    run_root = Path(run_root)
    base = Path(tempfile.mkdtemp(prefix="worker-", dir=run_root))
    scratch, package = base / "scratch", base / "package"
    scratch.mkdir()
    package.mkdir()
    copy_package(package)
    os.chmod(package, 0o555)
    for sub in ("home", "tmp", "cache"):
        (scratch / sub).mkdir()
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    base_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("COURSE_CHECKS_RAISE", "COURSE_GRADING", "PYTEST_", "PYTHON"))}
    env = dict(base_env)
    env.update(HOME=str(scratch / "home"), TMPDIR=str(scratch / "tmp"),
               XDG_CACHE_HOME=str(scratch / "cache"), MPLCONFIGDIR=str(scratch / "cache"),
               TRITON_CACHE_DIR=str(scratch / "cache" / "triton"),
               TRITON_HOME=str(scratch / "cache"), NUMBA_CACHE_DIR=str(scratch / "cache"),
               TORCH_EXTENSIONS_DIR=str(scratch / "cache" / "torch_extensions"),
               MPLBACKEND="Agg")  # fmt: skip
    from ... import runtime

    env["COURSE_DEVICE"] = "gpu" if runtime.on_gpu() else "cpu"
    log = open(scratch / "worker.log", "ab")  # noqa: SIM115 (handed to the process)
    try:
        # Forked by the zygote with torch imported (a warm start), else started from nothing.
        proc = zygote.spawn(
            "worker", lambda: zygote.Zygote(WORKER_PRELOAD, _import_path(run_root), base_env),
            "course_utils.grading.sandbox:worker_main", (to_r, from_w, log.fileno()), scratch,
            env, package=package) or subprocess.Popen(
            [sys.executable, "-I", "-B", "-u", "-c", _BOOT, str(package), str(to_r), str(from_w)],
            pass_fds=(to_r, from_w), cwd=scratch, env=env, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    finally:
        log.close()
        os.close(to_r)
        os.close(from_w)
    worker = Worker(proc, to_w, from_r, limits, keep, scratch=scratch, package=package)
    worker.reader = _Reader(from_r, limits.message_mb << 20)
    job = dict(job, scratch=str(scratch), package=str(package), sys_path=_import_path(run_root),
               limits={"file_bytes": limits.file_mb << 20})  # fmt: skip
    abi = landlock_abi() if protected is not None else 0
    if abi >= 1:
        writable = [str(scratch), *_writable_devices()]
        unreadable = [*protected, str(run_root), *_UNREADABLE_DEVICES]
        job["landlock"] = {"read_protected": unreadable, "writable": writable,
                           "read_extra": [str(scratch), str(package), sys.prefix,
                                          sys.base_prefix]}  # fmt: skip
        job["seccomp"] = True
        job["start_cuda"] = env["COURSE_DEVICE"] == "gpu"
    with _Listeners(run_root) as listeners:
        probe = _probe_spec(run_root, base, package, protected or [], listeners)
        job["probe"] = probe
        worker.deadline = time.monotonic() + 120
        try:
            worker.send(job)
            header, _ = worker.recv()
            locked = header.get("locked")
            if not isinstance(locked, dict):
                raise WorkerLost("error", "the worker did not report its lock")
            worker.lock_requested = abi >= 1
            worker.verified, worker.isolation = verify_isolation(locked, probe, listeners,
                                                                 requested=abi >= 1)
        except BaseException:
            worker.stop()
            raise
    return worker


class RemoteCandidate(Candidate):
    """A candidate object living in the worker, reached by its path in the handed-over value."""

    def __init__(self, worker: Worker, path: tuple, exercise):
        self.worker, self.path, self.exercise = worker, list(path), exercise

    def _request(self, op: str, args=(), kwargs=None, **extra):
        enc = _Encoder()
        header = {"op": op, "path": self.path, "forbidden": list(self.exercise.forbidden),
                  "torch_only": self.exercise.torch_only,
                  "args": enc.enc(tuple(args)), "kwargs": enc.enc(dict(kwargs or {}))}
        for k, v in extra.items():
            header[k] = enc.enc(v) if k == "config" else v
        header, buffers = enc.message(header)
        self.worker.send(header, buffers)
        reply, data = self.worker.recv()
        if "raised" in reply:
            raise _rebuild_exception(reply["raised"])
        if "ok" not in reply:
            raise WorkerLost("error", "the notebook answered out of turn")
        return self._decode_reply(enc, reply, data)

    def _decode_reply(self, enc: _Encoder, reply, data):
        nback = reply.get("nback")
        if nback != len(enc.regions) or len(data) < nback:
            raise ProtocolError("the notebook sent back the wrong number of argument buffers")
        torch = _torch()
        np = _np()
        for owner, desc, raw in zip(enc.owners, enc.regions, data[:nback], strict=True):
            if len(raw) != desc["nbytes"]:
                raise ProtocolError("an argument's memory came back with another size")
            host = np.frombuffer(raw, dtype=np.uint8)
            if isinstance(owner, torch.Tensor):
                owner.copy_(torch.from_numpy(host.copy()).to(owner.device))
            else:
                owner[...] = host
        known = [o if isinstance(o, torch.Tensor) else torch.from_numpy(o) for o in enc.owners]
        regions = reply.get("regions", [])
        if not isinstance(regions, list):
            raise ProtocolError("malformed regions")
        decoder = _Decoder(regions, data[nback:], known=known, strict=True)
        return decoder.dec(reply["ok"])

    def __call__(self, *args, **kwargs):
        return self._request("call", args, kwargs)

    def __getitem__(self, config):
        return lambda *args: self._request("launch", args, config=config)

    def invoke(self, target, *args, **kwargs):
        return self._request("invoke", args, kwargs, target=target)


def remote_candidate(worker: Worker, shape, exercise, path=()):
    """The grader-side stand-in for what the notebook handed over (tuples stay tuples)."""
    if isinstance(shape, dict) and "seq" in shape and isinstance(shape.get("items"), list):
        items = [remote_candidate(worker, s, exercise, (*path, i))
                 for i, s in enumerate(shape["items"][:64])]  # fmt: skip
        return tuple(items) if shape["seq"] == "tuple" else items
    return RemoteCandidate(worker, path, exercise)
