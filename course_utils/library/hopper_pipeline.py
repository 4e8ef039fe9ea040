"""A model of one Hopper consumer warpgroup: its operations on the asynchronous tensor core.

Chapter 14's consumer loop is a sequence of operations, each a tuple:

==========================  ====================================================================
``("wait_k", j, parity)``   wait on the full mbarrier of K(j)'s buffer (``j % stages``) for the
                            phase of this parity (``try_wait.parity``)
``("wait_v", j, parity)``   the same for V(j)
``("fence",)``              ``wgmma.fence``: registers the threads wrote are now visible to the
                            wgmma issued after it
``("issue_s", j)``          issue S(j) = Q K(j)^T (reads K(j)'s buffer, writes the S registers)
``("issue_pv", j)``         issue O += P V(j) (reads the P registers and V(j)'s buffer, reads and
                            writes the O registers)
``("commit",)``             ``wgmma.commit_group``: the wgmma issued since the last commit form a
                            group
``("wait_group", n)``       ``wgmma.wait_group n``: every group but the ``n`` most recent is done
``("release_k", j)``        arrive on the empty mbarrier of K(j)'s buffer: the producer may
                            overwrite it (``("release_v", j)`` for V(j))
``("softmax", j)``          the online softmax of S(j), in place in the S registers: new row
                            maxima m, the factor alpha for the old O and l, the row sums
``("rescale", j)``          O *= alpha(j) and l = l * alpha(j) + rowsum(j)
``("pack_p", j)``           P (bf16 pairs, the A operand of P V) from the S registers
==========================  ====================================================================

Q's rows have landed before the first operation; after the last one the epilogue reads O, m and l.

:func:`run_consumer` runs such a list against a producer that fills a ring of ``stages`` buffers
(K and V, each with a full and an empty barrier modelled as chapter 14's ``_Mbarrier``), racing
ahead as far as the barriers let it (``producer="eager"``) or only when the consumer waits for it
(``"lazy"``). The tensor core is adversarial: a committed group completes at any moment before the
``wait_group`` that retires it (``order="late"``: at that wait; ``order=seed``: at random legal
moments), and its operands are read, its results written, when it completes. So any thread access
to a register an unretired wgmma reads or writes, and any release of a buffer an unretired wgmma
reads, is a hazard in *some* legal order: the model reports it, with the operation's index, the
tile, the buffer or barrier. It also requires ``wgmma.fence`` between the threads' writes of S, P
or O and a wgmma that uses them, and it carries real numbers (Q, K, V as given; P rounded to
bf16), so the result can be compared with float64 attention.

:func:`emit_cuda` turns an accepted list into the statements of chapter 14's kernel (its lambdas
``softmax``, ``rescale``, ``pack``, ``mma_s``, ``mma_pv``), for the GPU build of the exercise.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

__all__ = ["OPS", "PipelineError", "Run", "emit_cuda", "parse_ops", "run_consumer"]

# name -> the number of integer arguments it takes
OPS = {"wait_k": 2, "wait_v": 2, "fence": 0, "issue_s": 1, "issue_pv": 1, "commit": 0,
       "wait_group": 1, "release_k": 1, "release_v": 1, "softmax": 1, "rescale": 1, "pack_p": 1}
MAX_WAIT_GROUP = 7
T_MMA, T_SOFTMAX = 1.0, 1.0  # the timeline's costs: a product, a softmax (d = 128, lecture 14)


class PipelineError(Exception):
    """What went wrong, where: ``kind`` names the class of mistake (for the grader's hint),
    ``index`` the operation (or None for the end of the list)."""

    def __init__(self, kind: str, index, message: str):
        where = f"operation {index}" if index is not None else "after the last operation"
        super().__init__(f"{where}: {message}")
        self.kind, self.index = kind, index


def _bf16(x):
    """Round float32 values to bf16 (round to nearest even), kept as float32."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32)


def parse_ops(ops, n_tiles: int, limit: int) -> list[tuple]:
    """Check the shape of a candidate's list and return it as plain tuples of (str, int, ...).

    Reads at most ``limit`` items; only exact lists/tuples, ``str`` names and ``int`` arguments
    are accepted (no subclasses: nothing of the candidate's code runs here)."""
    if type(ops) not in (list, tuple):
        raise PipelineError("shape", None,
                            f"expected a list of operations, got a {type(ops).__name__}")
    if len(ops) > limit:
        raise PipelineError("shape", None, f"{len(ops)} operations for {n_tiles} tiles: more than "
                            f"the {limit} a loop of this size could need")
    out = []
    for i, op in enumerate(ops):
        if type(op) not in (tuple, list) or not op or type(op[0]) is not str:
            raise PipelineError("shape", i, "each operation is a tuple whose first item names it, "
                                f"such as (\"commit\",); got a {type(op).__name__}")
        name = op[0]
        if name not in OPS:
            raise PipelineError("shape", i,
                                f"unknown operation {name[:40]!r}; known: {', '.join(OPS)}")
        if len(op) != 1 + OPS[name]:
            raise PipelineError("shape", i, f"{name!r} takes {OPS[name]} integer argument(s), got "
                                f"{len(op) - 1}")
        args = []
        for a in op[1:]:
            if type(a) is not int and not (isinstance(a, np.integer)
                                           and type(a).__module__ == "numpy"):
                raise PipelineError("shape", i,
                                    f"{name!r}: arguments are ints, got a {type(a).__name__}")
            args.append(int(a))
        if name in ("wait_k", "wait_v") and args[1] not in (0, 1):
            raise PipelineError("parity", i, f"{name}: a parity is 0 or 1, got {args[1]}")
        if name == "wait_group" and not 0 <= args[0] <= MAX_WAIT_GROUP:
            raise PipelineError("wait", i, f"wait_group takes 0..{MAX_WAIT_GROUP}, got {args[0]}")
        if name not in ("wait_group",) and OPS[name] and not 0 <= args[0] < n_tiles:
            raise PipelineError("shape", i,
                                f"{name}: tile {args[0]} is not one of 0..{n_tiles - 1}")
        out.append((name, *args))
    return out


class _Mbarrier:
    """``count`` arrivals complete a phase; ``passes(p)`` is try_wait.parity(p) (a fresh barrier
    counts its phase -1, of parity 1, as complete)."""

    def __init__(self, count=1):
        self.count, self.pending, self.completed = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.completed, self.pending = self.completed + 1, self.count

    def passes(self, parity):
        return parity != self.completed % 2


@dataclass
class _Mma:
    kind: str  # "S" or "PV"
    tile: int
    issued_at: int
    buffer: int
    start: float = 0.0  # on the timeline: when the tensor core runs it
    end: float = 0.0

    @property
    def label(self):
        return f"S({self.tile}) = Q K({self.tile})^T" if self.kind == "S" else \
            f"O += P V({self.tile})"

    def reads(self):
        return {"S": set(), "PV": {"P", "O"}}[self.kind]

    def writes(self):
        return {"S": {"S"}, "PV": {"O"}}[self.kind]


@dataclass
class Run:
    """What a run computed and measured: O (rows x d, normalised), LSE (natural log); on the
    timeline (a product takes one unit on the tensor core, in issue order; a softmax one unit of
    the threads; a wait lasts until its products end), for each softmax whether a product ran
    under it, and the share of the time the tensor core was busy."""

    O: np.ndarray
    LSE: np.ndarray
    overlapped: list = field(default_factory=list)  # (op index, tile, a product under it: bool)
    tensor_busy: float = 0.0


def run_consumer(ops, *, Q, K, V, block_n, stages, scale, causal=False, q0=0, producer="eager",
                 order="late") -> Run:
    """Run the parsed list ``ops`` on Q (rows x d), K and V (keys x d, float32): see the module
    docstring. ``q0`` is the first row's index (causal: key c is masked for row r when c > r,
    top-left aligned as in the lecture's kernels, not FlashAttention-2/3's bottom-right); keys past
    ``len(K)`` are masked. Raises :class:`PipelineError`."""
    rows, n_keys = Q.shape[0], K.shape[0]
    n = -(-(min(n_keys, q0 + rows) if causal else n_keys) // block_n)
    rng = random.Random(order) if order != "late" else None

    # ---- the producer: K(t) then V(t) into buffer t % stages, when the empty barrier allows
    full = {"K": [_Mbarrier() for _ in range(stages)], "V": [_Mbarrier() for _ in range(stages)]}
    empty = {"K": [_Mbarrier() for _ in range(stages)], "V": [_Mbarrier() for _ in range(stages)]}
    held = {"K": [None] * stages, "V": [None] * stages}  # tile a buffer holds
    data = {"K": [None] * stages, "V": [None] * stages}
    loads = [(m, t) for t in range(n) for m in ("K", "V")]
    next_load = [0]

    def tile_data(m, t):
        x = (K if m == "K" else V)[t * block_n:(t + 1) * block_n]
        out = np.zeros((block_n, K.shape[1]), np.float32)  # TMA fills zeros past the end
        out[:len(x)] = x
        return out

    def produce_one():
        if next_load[0] >= len(loads):
            return False
        m, t = loads[next_load[0]]
        b = t % stages
        if not empty[m][b].passes(((t // stages) & 1) ^ 1):
            return False
        held[m][b], data[m][b] = t, tile_data(m, t)
        full[m][b].arrive()  # the bytes landed: at once
        next_load[0] += 1
        return True

    def produce_all():
        while produce_one():
            pass

    # ---- the consumer's registers and the tensor core
    d = Q.shape[1]
    regs = {"S": np.zeros((rows, block_n), np.float32), "O": np.zeros((rows, d), np.float32),
            "P": np.zeros((rows, block_n), np.float32)}
    holds = {"S": "nothing", "P": "nothing"}  # what the S and P registers hold, in words
    m_row = np.full(rows, -np.inf, np.float32)
    l_row = np.zeros(rows, np.float32)
    alpha = rowsum = None
    alpha_tile, alpha_applied = None, True
    dirty = {"S", "O", "P"}  # written by the threads since the last wgmma.fence (O: zeroed)
    open_batch: list[_Mma] = []  # issued, not committed
    groups: list[dict] = []  # committed, not retired (oldest first): {"mmas": [...], "done": bool}
    waited = {"K": set(), "V": set()}  # tiles whose full barrier this consumer passed
    released = {"K": set(), "V": set()}
    issued = {"S": set(), "PV": set()}
    softmaxed, rescaled, packed = set(), set(), set()
    overlapped = []
    clock, tensor_free, tensor_time = 0.0, 0.0, 0.0  # the timeline (see Run)
    last_wait = [None]  # the index of the latest wait_group

    def complete(group):
        if group["done"]:
            return
        group["done"] = True
        for mma in group["mmas"]:
            if mma.kind == "S":
                regs["S"] = (Q @ data["K"][mma.buffer].T).astype(np.float32)
                holds["S"] = f"S({mma.tile})"
            else:
                regs["O"] = (regs["O"] + regs["P"] @ data["V"][mma.buffer]).astype(np.float32)

    def in_flight():
        return [mma for g in groups for mma in g["mmas"]] + open_batch

    def why_in_flight(mma):
        if any(mma is x for x in open_batch):
            return "it was issued but never committed, so no wait_group waits for it"
        if last_wait[0] is not None and last_wait[0] > mma.issued_at:
            return f"the wait_group at operation {last_wait[0]} leaves it in flight"
        return "no wgmma.wait_group retired it yet"

    def maybe_complete_some():
        if rng is None:
            return
        for g in list(groups):
            if not g["done"] and rng.random() < 0.4:
                complete(g)

    def hazard(i, op_words, reg, access):
        for mma in in_flight():
            if reg in (mma.writes() if access == "read" else mma.writes() | mma.reads()):
                still = "writes" if reg in mma.writes() else "reads"
                why = why_in_flight(mma)
                raise PipelineError(
                    "wait" if "never" in why else "landed" if access == "read" else "overwrite",
                    i, f"{op_words} {access}s the {reg} registers while {mma.label} (issued at "
                    f"operation {mma.issued_at}) may still be in flight and {still} them: {why}")

    def tile_mask(j):
        c = j * block_n + np.arange(block_n)
        r = q0 + np.arange(rows)
        mask = c[None, :] >= n_keys
        if causal:
            mask = mask | (c[None, :] > r[:, None])
        return mask

    if producer == "eager":
        produce_all()
    for i, op in enumerate(ops):
        name, args = op[0], op[1:]
        maybe_complete_some()
        if name in ("wait_k", "wait_v"):
            m, (j, parity) = name[-1].upper(), args
            b = j % stages
            while not full[m][b].passes(parity):
                if not produce_one():
                    raise PipelineError(
                        "parity", i, f"wait_{m.lower()}({j}) waits for parity {parity} on the full "
                        f"barrier of {m} buffer {b}, which has completed {full[m][b].completed} "
                        "phase(s) and will complete no other: deadlock")
            if held[m][b] != j:
                what = "nothing yet" if held[m][b] is None else f"{m}({held[m][b]})"
                raise PipelineError(
                    "parity", i, f"wait_{m.lower()}({j}) passed on parity {parity} of {m} buffer "
                    f"{b}'s full barrier ({full[m][b].completed} phase(s) completed), but the "
                    f"buffer holds {what}: the wait passed on a phase that is not {m}({j})'s")
            waited[m].add(j)
        elif name in ("release_k", "release_v"):
            m, j = name[-1].upper(), args[0]
            b = j % stages
            if j not in waited[m] or j in released[m]:
                why = "twice" if j in released[m] else "before waiting for it"
                raise PipelineError("release", i, f"release_{m.lower()}({j}) releases {m} buffer "
                                    f"{b} {why}: each tile's buffer is released once, after its "
                                    "use")
            for mma in in_flight():
                if (mma.kind == "S") == (m == "K") and mma.tile == j:
                    why = why_in_flight(mma)
                    raise PipelineError(
                        "landed" if "leaves it" in why else "wait" if "never" in why else "release",
                        i, f"release_{m.lower()}({j}) frees {m} buffer {b} while {mma.label} "
                        f"(issued at operation {mma.issued_at}) may still read it: {why}; the "
                        "producer can overwrite the buffer under the product")
            if j not in issued["S" if m == "K" else "PV"]:
                raise PipelineError("release", i, f"release_{m.lower()}({j}) frees {m}({j}) before "
                                    "any product read it")
            released[m].add(j)
            empty[m][b].arrive()
            if producer == "eager":
                produce_all()
        elif name == "fence":
            dirty.clear()
        elif name in ("issue_s", "issue_pv"):
            kind, j = ("S", "K") if name == "issue_s" else ("PV", "V"), args[0]
            kind, m = kind
            b = j % stages
            if j not in waited[m] or held[m][b] != j or j in released[m]:
                raise PipelineError(
                    "parity" if j not in waited[m] else "release", i,
                    f"{name}({j}) reads {m} buffer {b}, but " + (
                        f"no wait_{m.lower()}({j}) passed before it" if j not in waited[m]
                        else f"{m}({j}) was released already"))
            if j in issued[kind]:
                raise PipelineError("shape", i, f"{name}({j}) issued twice")
            used = {"S": {"S"}, "PV": {"P", "O"}}[kind]
            if used & dirty:
                regs_words = " and ".join(sorted(used & dirty))
                raise PipelineError(
                    "fence", i, f"{name}({j}) uses the {regs_words} registers, which the threads "
                    "wrote after the last wgmma.fence (or before the first wgmma): no fence "
                    "between them")
            if kind == "PV":
                if j not in packed or holds["P"] != f"P({j})":
                    raise PipelineError("order", i, f"issue_pv({j}) multiplies the P registers, "
                                        f"which hold {holds['P']}, not P({j})")
                if j not in rescaled:
                    raise PipelineError(
                        "rescale", i, f"issue_pv({j}) adds P({j}) V({j}) to an O that was not "
                        f"rescaled by softmax({j})'s alpha: no rescale({j}) before it")
                if max(rescaled) != j:
                    raise PipelineError(
                        "order", i, f"issue_pv({j}) adds P({j}) V({j}) to an O already rescaled "
                        f"by softmax({max(rescaled)})'s alpha: P({j}) V({j}) belongs before it")
            issued[kind].add(j)
            mma = _Mma(kind, j, i, b, max(clock, tensor_free), max(clock, tensor_free) + T_MMA)
            tensor_free, tensor_time = mma.end, tensor_time + T_MMA
            open_batch.append(mma)
        elif name == "commit":
            groups.append({"mmas": open_batch, "done": False})
            open_batch = []
        elif name == "wait_group":
            keep = args[0]
            retire = groups[:max(0, len(groups) - keep)]
            for g in retire:
                complete(g)
                clock = max([clock] + [mma.end for mma in g["mmas"]])
            groups = groups[len(retire):]
            last_wait[0] = i
        elif name == "softmax":
            j = args[0]
            if j in softmaxed:
                raise PipelineError("order", i, f"softmax({j}) runs twice")
            hazard(i, f"softmax({j})", "S", "read")
            if holds["S"] != f"S({j})":
                raise PipelineError("order", i, f"softmax({j}) runs on the S registers, which hold "
                                    f"{holds['S']}, not S({j})")
            if not alpha_applied:
                raise PipelineError("rescale", i, f"softmax({j}) computes a new alpha while "
                                    f"softmax({alpha_tile})'s was never applied: no "
                                    f"rescale({alpha_tile})")
            s = np.where(tile_mask(j), -np.inf, regs["S"]).astype(np.float32)
            mx = np.maximum(m_row, s.max(axis=1))
            base = np.where(np.isneginf(mx), 0, mx * scale).astype(np.float32)
            alpha = np.exp(np.where(np.isneginf(m_row), -np.inf, m_row * scale) - base)
            regs["S"] = np.exp(s * scale - base[:, None]).astype(np.float32)
            rowsum = regs["S"].sum(axis=1)
            m_row = mx
            holds["S"] = f"P({j}) in float"
            dirty.add("S")
            softmaxed.add(j)
            alpha_tile, alpha_applied = j, False
            under = any(mma.start < clock + T_SOFTMAX and mma.end > clock for mma in in_flight())
            overlapped.append((i, j, under))
            clock += T_SOFTMAX
        elif name == "rescale":
            j = args[0]
            if alpha_tile != j or alpha_applied:
                raise PipelineError("order", i, f"rescale({j}) with no fresh alpha of softmax({j}) "
                                    "to apply" + (" (applied twice)" if alpha_tile == j else ""))
            hazard(i, f"rescale({j})", "O", "write")
            regs["O"] = (regs["O"] * alpha[:, None]).astype(np.float32)
            l_row = (l_row * alpha + rowsum).astype(np.float32)
            alpha_applied = True
            rescaled.add(j)
            dirty.add("O")
        elif name == "pack_p":
            j = args[0]
            hazard(i, f"pack_p({j})", "S", "read")
            hazard(i, f"pack_p({j})", "P", "write")
            if holds["S"] != f"P({j}) in float":
                raise PipelineError("order", i, f"pack_p({j}) packs the S registers, which hold "
                                    f"{holds['S']}, not softmax({j})'s P")
            regs["P"] = _bf16(regs["S"])
            holds["P"] = f"P({j})"
            packed.add(j)
            dirty.add("P")
    # ---- the end: everything issued, retired and released; the epilogue reads O, m, l
    if open_batch:
        raise PipelineError("wait", None, f"{open_batch[0].label} was issued but never committed, "
                            "so no wgmma.wait_group waits for it")
    if groups:
        last = groups[-1]["mmas"]
        raise PipelineError("wait", None, f"{last[0].label if last else 'a group'} is "
                            "not retired by a wait_group when the epilogue reads O: end with "
                            "wait_group(0)")
    for kind, what in (("S", "issue_s"), ("PV", "issue_pv")):
        missing = sorted(set(range(n)) - issued[kind])
        if missing:
            raise PipelineError("shape", None, f"{what}({missing[0]}) never happens: every one of "
                                f"the {n} tiles needs its S and its P V")
    for m in ("K", "V"):
        missing = sorted(set(range(n)) - released[m])
        if missing:
            raise PipelineError("release", None, f"{m}({missing[0]})'s buffer "
                                f"({missing[0] % stages}) is never released: the producer would "
                                "wait on its empty barrier forever")
    if not alpha_applied:
        raise PipelineError("rescale", None, f"softmax({alpha_tile})'s alpha is never applied: no "
                            f"rescale({alpha_tile})")
    with np.errstate(divide="ignore", invalid="ignore"):
        O = np.where(l_row[:, None] > 0, regs["O"] / l_row[:, None], 0)
        lse = np.where(l_row > 0, m_row * scale + np.log(l_row), -np.inf)
    busy = tensor_time / max(clock, tensor_free, 1e-9)
    return Run(O.astype(np.float64), lse.astype(np.float64), overlapped, busy)


# --------------------------------------------------------------------------- the GPU build


def emit_cuda(ops, n_tiles: int, stages: int) -> str:
    """The statements of chapter 14's consumer loop for a list that :func:`run_consumer` accepted:
    one C++ statement a line, calling the kernel's lambdas (``softmax(j)``, ``rescale()``,
    ``pack()``, ``mma_s(j)``, ``mma_pv(j)``, ``stage(j)``). After each ``wgmma.wait_group`` the
    registers of the groups it retires get a compiler fence (``fence_regs``), as in the kernel."""
    lines, groups, batch = [], [], []
    for op in ops:
        name, args = op[0], op[1:]
        if name in ("wait_k", "wait_v"):
            lines.append(f"mbar_wait(&sm.{name[-1]}_full[stage({args[0]})], {args[1]});")
        elif name in ("release_k", "release_v"):
            lines.append(f"mbar_arrive(&sm.{name[-1]}_empty[stage({args[0]})]);")
        elif name == "fence":
            lines.append("wgmma_fence();")
        elif name == "issue_s":
            lines.append(f"mma_s({args[0]});")
            batch.append("S")
        elif name == "issue_pv":
            lines.append(f"mma_pv({args[0]});")
            batch.append("PV")
        elif name == "commit":
            lines.append("wgmma_commit();")
            groups.append(batch)
            batch = []
        elif name == "wait_group":
            lines.append(f"wgmma_wait<{args[0]}>();")
            retire = groups[:max(0, len(groups) - args[0])]
            groups = groups[len(retire):]
            kinds = {k for g in retire for k in g}
            if "S" in kinds:
                lines.append("fence_regs(s_acc);")
            if "PV" in kinds:
                lines.append("fence_regs(o); fence_regs(p);")
        elif name == "softmax":
            lines.append(f"softmax({args[0]});")
        elif name == "rescale":
            lines.append("rescale();")
        elif name == "pack_p":
            lines.append("pack();")
    return "\n".join(lines)


def float64_attention(Q, K, V, scale, causal=False, q0=0):
    """O and LSE (natural log) in float64, by the plain formula."""
    q, k, v = (np.asarray(x, np.float64) for x in (Q, K, V))
    s = q @ k.T * scale
    if causal:
        r = q0 + np.arange(len(q))
        s = np.where(np.arange(len(k))[None, :] > r[:, None], -np.inf, s)
    mx = s.max(axis=1, keepdims=True)
    e = np.exp(s - mx)
    return e @ v / e.sum(axis=1, keepdims=True), (mx[:, 0] + np.log(e.sum(axis=1)))


def tiles_of(n_keys: int, block_n: int, rows: int, causal: bool, q0: int) -> int:
    """How many key tiles a consumer's rows need (causal: up to its last row)."""
    return math.ceil((min(n_keys, q0 + rows) if causal else n_keys) / block_n)
