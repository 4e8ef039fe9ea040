"""A tiny GPT to train with the course's attention or with SDPA: chapter 12.

Everything is generated here, nothing is downloaded. The data is a character stream of sums,
``"37+58=95;4+61=65;..."``: the operands a and b are drawn uniformly from 0..99, and everything
else (the punctuation, the lengths, the digits of each sum) follows from them. So the data has an
**exact entropy floor**: the only randomness per sum is the choice of (a, b), ``2 ln 100`` nats,
spread over its characters; :func:`entropy_floor` computes the floor per character for the
training windows exactly (:func:`entropy_rate` is its limit for an endless window). A model that
generalises approaches the floor from above; a model that goes below it has memorised a fixed
text (it cannot, here: see below).

**Fresh data, a held-out validation set.** :func:`sum_batch` draws every training batch anew
from a generator seeded with the run's seed: no window is ever seen twice (there is no epoch).
Each row starts right after a ``;`` (the input's first character is ``;``), so the targets are
the first ``block`` characters of a fresh stream of sums, which is what the floor is computed
for. The validation set is :data:`VAL_BATCHES` batches drawn once from a separate generator
(seed :data:`VAL_SEED`, a stream disjoint from the training seeds'), the same for every run and
every evaluation: two models' validation losses then differ by the models only, not by the
batches. What is held out is the *windows*, not the operand pairs: there are only 10^4 pairs and
training sees all of them, so the question is the loss on the distribution, whose floor is
known exactly. (Holding out pairs would change the validation distribution, and its floor.)

**The model**, nanoGPT's layout: token and position embeddings, ``n_layer`` blocks of
pre-LayerNorm causal self-attention and MLP (4x, GELU), a final LayerNorm, and a head tied to the
token embedding. Only the attention call changes with ``attention``:

* ``"sdpa"``:   ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``
* ``"course"``: ``ops.flash_attention(q, k, v, causal=True)`` (chapter 09's kernels on a GPU)
* any function ``f(q, k, v) -> O`` on ``(B, H, N, d)`` tensors (tests inject bugs this way).

``train(attention, seed=...)`` builds the model with ``torch.manual_seed(seed)`` and draws the
batches from a generator seeded with ``seed``: the same seed gives the same initial weights and
the same batches for both attentions. Every ``compare_every`` steps it runs
:func:`compare_attentions`: the model's current weights and batch through **both** attentions at
the training precision and through a float64 copy, and reports the max relative error of the
logits and of every parameter gradient for each: a bug in one attention shows as a number next
to the other's, not as a loss curve. :func:`profile_training` measures where a training step's
time goes (host, device, idle) with ``torch.profiler``.
"""

from __future__ import annotations

import copy
import math
import time
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..runtime import half_dtype
from . import ops

VOCAB = "0123456789+=;"  # the characters of the sums: a digit's id is its value
PLUS, EQUALS, SEMI = VOCAB.index("+"), VOCAB.index("="), VOCAB.index(";")
ATTENTIONS = ("sdpa", "course")
MAX_OPERAND = 99  # a and b uniform in 0..MAX_OPERAND
VAL_SEED = 2**31 - 1  # the validation stream's seed; training streams use the run's seed
VAL_BATCHES = 4  # validation batches (of the training batch size), drawn once
MODES = ("eager", "default", "reduce-overhead")  # profile_training: how the step is compiled

__all__ = ["ATTENTIONS", "GPT", "MAX_OPERAND", "MODES", "VAL_BATCHES", "VAL_SEED", "VOCAB",
           "chance_loss", "compare_attentions", "decode", "encode", "entropy_floor",
           "entropy_rate", "learning_rate", "make_sums", "profile_steps", "profile_training",
           "sum_batch", "train", "TrainingStep", "unigram_entropy", "validation_set"]


# =============================================================================================
# Data
# =============================================================================================


def make_sums(n_chars, seed=0, max_operand=MAX_OPERAND):
    """A deterministic string of at least ``n_chars`` characters: ``"a+b=c;"`` repeated."""
    gen = torch.Generator().manual_seed(seed)
    parts, total = [], 0
    while total < n_chars:
        a, b = torch.randint(0, max_operand + 1, (2,), generator=gen).tolist()
        sample = f"{a}+{b}={a + b};"
        parts.append(sample)
        total += len(sample)
    return "".join(parts)


def encode(text):
    """Characters -> int64 token ids (positions in VOCAB)."""
    index = {c: i for i, c in enumerate(VOCAB)}
    bad = sorted(set(text) - set(index))
    if bad:
        raise ValueError(f"characters {bad} are not in the vocabulary {VOCAB!r}")
    return torch.tensor([index[c] for c in text], dtype=torch.long)


def decode(ids):
    """Token ids -> characters."""
    return "".join(VOCAB[int(i)] for i in ids)


def unigram_entropy(data):
    """Entropy (nats per character) of the character frequencies: the loss of a model that
    predicts every character from its frequency alone, ignoring the context."""
    p = torch.bincount(data.flatten(), minlength=len(VOCAB)).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def _digits(x, width):
    """Decimal digits of the int64 tensor ``x`` (values < 10**width), left-aligned: tokens
    ``(*x.shape, width)`` and a mask of the real ones (no leading zeros; 0 is one digit)."""
    n = torch.ones_like(x)
    for p in range(1, width):
        n += (x >= 10**p).long()
    j = torch.arange(width)
    power = (n[..., None] - 1 - j).clamp(min=0)
    return (x[..., None] // 10**power) % 10, j < n[..., None]


def sum_batch(batch, block, gen, max_operand=MAX_OPERAND):
    """A fresh batch: inputs x and targets y, int64 ``(batch, block)``, on the CPU.

    Row r is a fresh stream of sums drawn from ``gen``: y[r] its first ``block`` characters,
    x[r] = ``";"`` followed by y[r][:-1] (each row starts right after a sum ends, as
    :func:`entropy_floor` assumes). Vectorised: the sums' characters are built as digit tensors
    and compacted, with no Python loop over the samples.
    """
    if block < 1 or batch < 0:
        raise ValueError(f"batch={batch}, block={block}: need batch >= 0 and block >= 1")
    w_ab, w_c = len(str(max_operand)), len(str(2 * max_operand))
    per_row = block // 6 + 2  # "0+0=0;" is the shortest sum: 6 characters
    ab = torch.randint(0, max_operand + 1, (batch, per_row, 2), generator=gen)
    a, b = ab[..., 0], ab[..., 1]
    (da, ma), (db, mb), (dc, mc) = _digits(a, w_ab), _digits(b, w_ab), _digits(a + b, w_c)

    def const(token):
        return torch.full((batch, per_row, 1), token), torch.ones(batch, per_row, 1, dtype=bool)

    pieces = [(da, ma), const(PLUS), (db, mb), const(EQUALS), (dc, mc), const(SEMI)]
    tokens = torch.cat([t for t, _ in pieces], -1).view(batch, -1)
    real = torch.cat([m for _, m in pieces], -1).view(batch, -1)
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)  # real characters first
    y = tokens.gather(1, order)[:, :block].contiguous()
    x = torch.cat([torch.full((batch, 1), SEMI), y[:, :-1]], 1)
    return x, y


def validation_set(batch, block, n_batches=VAL_BATCHES, max_operand=MAX_OPERAND):
    """The held-out batches: ``n_batches`` pairs (x, y) from the stream seeded ``VAL_SEED``."""
    gen = torch.Generator().manual_seed(VAL_SEED)
    return [sum_batch(batch, block, gen, max_operand) for _ in range(n_batches)]


def _sum_lengths_and_prefix_entropy(max_operand):
    """P(a sum has L characters) and H(first n characters of one sum), n = 0..longest."""
    strings = [f"{a}+{b}={a + b};" for a in range(max_operand + 1)
               for b in range(max_operand + 1)]
    p = 1.0 / len(strings)  # every (a, b) equally likely, and distinct pairs give distinct strings
    lengths = Counter(len(s) for s in strings)
    longest = max(lengths)
    prefix_h = [0.0]
    for n in range(1, longest + 1):
        counts = Counter(s[:n] for s in strings)  # a shorter sum is its own whole prefix
        prefix_h.append(-sum(c * p * math.log(c * p) for c in counts.values()))
    return {L: c * p for L, c in lengths.items()}, prefix_h


def entropy_floor(block, max_operand=MAX_OPERAND):
    """The lowest expected loss (nats per character) any model can reach on :func:`sum_batch`'s
    targets: the entropy of the first ``block`` characters of a stream of sums, per character.

    Exact, by the chain rule over the first sum: ``F(n) = H(first n characters of sum 1) +
    sum_L P(L) F(n - L)`` over the lengths L < n of sum 1 (after a whole sum the rest is a fresh
    stream; a sum's string and its (a, b) determine each other). A model that predicts the
    operands' digits no better than chance and everything else perfectly reaches it.
    """
    if block < 1:
        raise ValueError(f"block={block}: need at least one character")
    p_len, prefix_h = _sum_lengths_and_prefix_entropy(max_operand)
    whole = prefix_h[-1]  # 2 ln(max_operand + 1)
    F_ = [0.0] * (block + 1)
    for n in range(1, block + 1):
        F_[n] = prefix_h[n] if n < len(prefix_h) else whole
        F_[n] += sum(p * F_[n - L] for L, p in p_len.items() if L < n)
    return F_[block] / block


def entropy_rate(max_operand=MAX_OPERAND):
    """The floor for an endless window: ``2 ln(max_operand + 1)`` nats over the mean length of
    a sum, in nats per character."""
    p_len, prefix_h = _sum_lengths_and_prefix_entropy(max_operand)
    return prefix_h[-1] / sum(L * p for L, p in p_len.items())


# =============================================================================================
# Model
# =============================================================================================


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _course(q, k, v):
    return ops.flash_attention(q, k, v, causal=True)


_FUNCTIONS = {"sdpa": _sdpa, "course": _course}


def _attention_function(attention):
    if callable(attention):
        return attention
    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r}: choose one of {ATTENTIONS} or pass a "
                         "function f(q, k, v) -> O")
    return _FUNCTIONS[attention]


def _attention_name(attention):
    return attention if isinstance(attention, str) else getattr(attention, "__name__", "custom")


class SelfAttention(nn.Module):
    """Causal multi-head self-attention; ``attention`` picks who computes softmax(QK^T)V."""

    def __init__(self, n_embd, n_head, attention):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not a multiple of n_head={n_head}")
        self.n_head, self.attention = n_head, attention
        self.attend = _attention_function(attention)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, N, C = x.shape
        d = C // self.n_head
        # (B, N, 3, H, d) -> three (B, H, N, d) views (not contiguous: the op reads the strides)
        q, k, v = self.qkv(x).view(B, N, 3, self.n_head, d).permute(2, 0, 3, 1, 4)
        O = self.attend(q, k, v)  # "sdpa": SDPA, is_causal; "course": ops.flash_attention
        return self.proj(O.transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, attention):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = SelfAttention(n_embd, n_head, attention)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))  # pre-LayerNorm: the residual stream is never normalised
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids ``(B, N)`` -> logits ``(B, N, len(VOCAB))``; N <= block."""

    def __init__(self, n_layer=2, n_head=4, n_embd=64, block=64, attention="sdpa"):
        super().__init__()
        self.block = block
        self.tok = nn.Embedding(len(VOCAB), n_embd)
        self.pos = nn.Embedding(block, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, attention) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, len(VOCAB), bias=False)
        self.head.weight = self.tok.weight  # tied: the same vectors read and write tokens
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def set_attention(self, attention):
        """Swap the attention of every block (a name of ATTENTIONS or a function)."""
        fn = _attention_function(attention)
        for blk in self.blocks:
            blk.attn.attention, blk.attn.attend = attention, fn
        return self

    def forward(self, idx):
        N = idx.shape[1]
        if N > self.block:
            raise ValueError(f"sequence of {N} tokens: the model was built for at most "
                             f"{self.block}")
        x = self.tok(idx) + self.pos(torch.arange(N, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


# =============================================================================================
# The direct comparison: both attentions against a float64 run of the same model
# =============================================================================================


def _loss_of(model, x, y, amp_dtype):
    with torch.autocast(x.device.type, dtype=amp_dtype or torch.bfloat16,
                        enabled=amp_dtype is not None):
        logits = model(x)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1)), logits


def _forward_backward(model, x, y, amp_dtype):
    loss, logits = _loss_of(model, x, y, amp_dtype)
    names, params = zip(*model.named_parameters(), strict=True)
    grads = torch.autograd.grad(loss, params)
    return loss.detach(), logits.detach(), dict(zip(names, grads, strict=True))


def _relative(t, ref):
    """max |t - ref| / max |ref|: an error relative to the tensor's scale (0/0 -> 0)."""
    err = float((t.double() - ref).abs().max()) if t.numel() else 0.0
    top = float(ref.abs().max()) if ref.numel() else 0.0
    return err / top if top > 0 else err


def compare_attentions(model, x, y, attentions=ATTENTIONS, amp_dtype=None):
    """The same weights and batch through each attention and through a float64 copy.

    ``model``: a :class:`GPT` (its own attention does not matter; it is not modified); x, y a
    batch. The reference is a float64 copy of the model with SDPA in float64. Each attention
    (names of ATTENTIONS, or ``{name: function}``) runs on a copy at the training precision
    (``amp_dtype``: the autocast dtype, None for the model's own dtype). Returns ``{name:
    {"logits", "loss", "grad", "worst"}}``: max relative error (:func:`_relative`) of the
    logits, of the loss, the largest over every parameter gradient, and that parameter's name.
    A correct attention reads about the precision's rounding; a bug reads far more.
    """
    if not isinstance(attentions, dict):
        attentions = {_attention_name(a): a for a in attentions}
    ref = copy.deepcopy(model).double().set_attention("sdpa")
    loss64, logits64, grads64 = _forward_backward(ref, x, y, None)
    del ref
    out = {}
    for name, attention in attentions.items():
        m = copy.deepcopy(model).set_attention(attention)
        loss, logits, grads = _forward_backward(m, x, y, amp_dtype)
        errors = {p: _relative(g, grads64[p]) for p, g in grads.items()}
        worst = max(errors, key=errors.get)
        out[name] = {"logits": _relative(logits, logits64), "loss": _relative(loss, loss64),
                     "grad": errors[worst], "worst": worst}
    return out


# =============================================================================================
# Training
# =============================================================================================


def train(attention, *, seed=0, steps=200, batch=16, block=64, n_layer=2, n_head=4, n_embd=64,
          device="cpu", compile=False, lr=3e-3, warmup=5, log=None, cpu_threads=1, lr_warmup=0,
          cosine=False, eval_every=None, compare_every=None, compare_rows=8,
          max_operand=MAX_OPERAND):
    """Train a fresh GPT on fresh sums; returns a dict.

    Keys: ``losses`` (training loss of every step, each on a batch never seen before, the same
    batches for any attention), ``val`` (``[step, loss]`` on the held-out validation set every
    ``eval_every`` steps and after the last), ``floor`` (:func:`entropy_floor` at ``block``: the
    lowest loss any model can reach), ``compare`` (every ``compare_every`` steps, and at the
    end: ``{"step", name: {...}}`` from :func:`compare_attentions` on the current weights and
    the first ``compare_rows`` rows of the step's batch, for SDPA and the course's op),
    On a GPU each entry also holds ``"float32"``: the same comparison without autocast (the
    course's kernels in IEEE float32), which resolves bugs far below bf16's rounding.
    ``tokens_per_s`` (after ``warmup`` steps, so compiling and tuning are not counted, and
    without the time of validation and comparisons), ``first_step_s`` (the first step alone:
    compile time if ``compile``), ``unigram`` (the unigram entropy of the validation set),
    ``final`` (mean training loss of the last 10 steps), ``final_val`` (the last validation
    loss), and the settings. ``eval_every`` / ``compare_every``: default a quarter of the run;
    0 turns them off (the last step is still evaluated).

    ``attention``: "sdpa", "course", or a function ``f(q, k, v) -> O`` (then named by its
    ``__name__``). On CUDA the model runs under 16-bit autocast (the course's kernels take
    16-bit inputs): bfloat16, or float16 with a gradient scaler on a GPU without bf16 tensor
    cores (a T4; ``course_utils.half_dtype()`` decides, and ``amp_dtype`` says which).
    ``log``: a function called as ``log(step, loss)`` every 50 steps. ``cpu_threads``: torch's
    intra-op threads during a CPU run (restored after; None leaves them alone): the tiny
    model's matrices are too small to split, and on a busy machine a 2-thread run was measured
    5-10x slower than a 1-thread one. ``lr_warmup``: steps over which the learning rate rises
    linearly to lr; ``cosine``: then it falls along a half cosine to lr / 10 at the last step.
    """
    _attention_function(attention)  # a clear error for an unknown name, before any work
    device = torch.device(device)
    threads_before = torch.get_num_threads()
    if device.type == "cpu" and cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    try:
        return _train(attention, seed, steps, batch, block, n_layer, n_head, n_embd, device,
                      compile, lr, warmup, log, lr_warmup, cosine, eval_every, compare_every,
                      compare_rows, max_operand)
    finally:
        torch.set_num_threads(threads_before)


def learning_rate(step, steps, lr, lr_warmup=0, cosine=False):
    """The learning rate of ``step`` (0-based) of ``steps``: see :func:`train`."""
    if step < lr_warmup:
        return lr * (step + 1) / lr_warmup
    if not cosine:
        return lr
    done = (step - lr_warmup) / max(1, steps - 1 - lr_warmup)  # 0 -> 1 over the rest of the run
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(done, 1.0))))


def _every(n, steps):
    return max(1, steps // 4) if n is None else int(n)


def _due(step, every, steps):
    return step == steps - 1 or (every > 0 and step % every == 0 and step > 0)


@torch.no_grad()
def _validation_loss(model, val, device, amp_dtype):
    total = 0.0
    for x, y in val:
        loss, _ = _loss_of(model, x.to(device), y.to(device), amp_dtype)
        total += float(loss)
    return total / len(val)


def _train(attention, seed, steps, batch, block, n_layer, n_head, n_embd, device, compile, lr,
           warmup, log, lr_warmup, cosine, eval_every, compare_every, compare_rows,
           max_operand):
    if steps <= warmup:
        raise ValueError(f"steps={steps} must be more than warmup={warmup} to time anything")
    eval_every, compare_every = _every(eval_every, steps), _every(compare_every, steps)
    # both attentions, unless the head dim is one the course's kernels do not take
    compared = ATTENTIONS if n_embd // n_head in ops.SUPPORTED_D else ("sdpa",)
    val = validation_set(batch, block, max_operand=max_operand)
    torch.manual_seed(seed)  # the same initial weights for both attentions
    model = GPT(n_layer, n_head, n_embd, block, attention).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)  # the same fresh batches for both attentions
    amp_dtype = half_dtype() if device.type == "cuda" else None  # says so once when float16
    # float16's 5 exponent bits lose small gradients: scale the loss up, and the gradients back
    # down before the step (skipping a step whose gradients overflowed). bf16 needs none of it.
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)

    def step_fn(x, y):
        return _loss_of(model, x, y, amp_dtype)[0]

    if compile:
        step_fn = torch.compile(step_fn, fullgraph=True, dynamic=False)

    losses, val_losses, compares = [], [], []
    t0, first_step_s, aside = None, None, 0.0  # aside: validation and comparison time
    for step in range(steps):
        if step == warmup:
            _sync(device)
            t0, aside = time.perf_counter(), 0.0
        x, y = sum_batch(batch, block, gen, max_operand)
        x, y = x.to(device), y.to(device)
        if _due(step, compare_every, steps):
            t_aside = time.perf_counter()
            xs, ys = x[:compare_rows], y[:compare_rows]
            entry = {"step": step, **compare_attentions(model, xs, ys, compared, amp_dtype)}
            if amp_dtype is not None:  # and in float32: 16-bit rounding hides small bugs
                entry["float32"] = compare_attentions(model, xs, ys, compared, None)
            compares.append(entry)
            _sync(device)
            aside += time.perf_counter() - t_aside
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, lr, lr_warmup, cosine)
        t_step = time.perf_counter()
        loss = step_fn(x, y)
        scaler.scale(loss).backward()  # as loss.backward() when the scaler is off
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # float() waits for the GPU: every step is timed whole
        if step == 0:
            first_step_s = time.perf_counter() - t_step
        if _due(step, eval_every, steps):
            t_aside = time.perf_counter()
            val_losses.append([step, _validation_loss(model, val, device, amp_dtype)])
            aside += time.perf_counter() - t_aside
        if log is not None and step % 50 == 0:
            log(step, losses[-1])
    _sync(device)
    elapsed = time.perf_counter() - t0 - aside
    return {"attention": _attention_name(attention), "losses": losses, "val": val_losses,
            "compare": compares, "floor": entropy_floor(block, max_operand),
            "rate": entropy_rate(max_operand),
            "tokens_per_s": (steps - warmup) * batch * block / elapsed,
            "first_step_s": first_step_s, "final": sum(losses[-10:]) / len(losses[-10:]),
            "final_val": val_losses[-1][1],
            "unigram": unigram_entropy(torch.cat([y for _, y in val])), "seed": seed,
            "steps": steps, "batch": batch, "block": block, "n_layer": n_layer,
            "n_head": n_head, "n_embd": n_embd, "device": str(device), "compile": compile,
            "lr": lr, "lr_warmup": lr_warmup, "cosine": cosine, "eval_every": eval_every,
            "compare_every": compare_every, "compare_rows": compare_rows,
            "val_batches": len(val), "val_seed": VAL_SEED, "max_operand": max_operand,
            "amp_dtype": str(amp_dtype).removeprefix("torch.") if amp_dtype else None,
            "params": sum(p.numel() for p in model.parameters())}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def chance_loss():
    """ln(len(VOCAB)): the loss of a uniform guess, where training starts."""
    return math.log(len(VOCAB))


# =============================================================================================
# Where a training step's time goes: torch.profiler
# =============================================================================================

_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
             "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")
_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _union_us(intervals):
    """Total length of the union of ``(start, end)`` intervals (microseconds)."""
    total, end_so_far = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > end_so_far:
            total += end - max(start, end_so_far)
            end_so_far = end
    return total


def _split(events, steps, wall_ms):
    """Per step: device busy time (the union of GPU kernels, copies and sets), host time in
    PyTorch ops (the union of CPU op intervals, without waits), time in launch calls."""
    from torch.autograd import DeviceType

    device, host, launch, kernels, launches, graphs = [], [], 0.0, 0, 0, 0
    for e in events:
        if getattr(e, "is_user_annotation", False) or e.name.startswith("ProfilerStep"):
            continue
        span = (e.time_range.start, e.time_range.end)
        if e.device_type == DeviceType.CUDA:
            device.append(span)
            kernels += 1
        elif e.device_type == DeviceType.CPU and e.name not in _WAITS:
            host.append(span)
            if e.name in _LAUNCHES:
                launch += span[1] - span[0]
                launches += 1
                graphs += e.name == "cudaGraphLaunch"
    device_ms = _union_us(device) / 1e3 / steps if device else None
    return {"wall_ms": wall_ms, "host_ops_ms": _union_us(host) / 1e3 / steps,
            "launch_ms": launch / 1e3 / steps, "launches": launches / steps,
            "graph_launches": graphs / steps, "device_ms": device_ms,
            "device_events": kernels / steps,
            "idle_ms": None if device_ms is None else max(0.0, wall_ms - device_ms)}


class TrainingStep:
    """One training step of a fresh GPT (forward + loss, backward, AdamW) on one fixed batch,
    compiled as ``mode`` says: "eager", "default" (``torch.compile(fullgraph=True)``) or
    "reduce-overhead" (``torch.compile(mode="reduce-overhead")``: CUDA graphs on a GPU; on the
    CPU the same as default). Call it to run a step; :meth:`time` and :meth:`profile` measure.
    """

    def __init__(self, attention="course", mode="eager", *, batch=16, block=64, n_layer=2,
                 n_head=4, n_embd=64, device="cpu", seed=0, lr=1e-3):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: choose one of {MODES}")
        self.device, self.mode = torch.device(device), mode
        self.attention = _attention_name(attention)
        self.settings = dict(batch=batch, block=block, n_layer=n_layer, n_head=n_head,
                             n_embd=n_embd)
        torch.manual_seed(seed)
        self.model = GPT(n_layer, n_head, n_embd, block, attention).to(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        amp_dtype = half_dtype() if self.device.type == "cuda" else None
        if amp_dtype == torch.float16:
            raise RuntimeError("TrainingStep uses bf16 autocast (no gradient scaler): a GPU "
                               "with bfloat16 (sm_80 or newer)")

        def loss_fn(x, y):
            return _loss_of(self.model, x, y, amp_dtype)[0]

        self.graphs = self.device.type == "cuda" and mode == "reduce-overhead"
        if mode != "eager":
            loss_fn = torch.compile(loss_fn, fullgraph=True, dynamic=False,
                                    mode="reduce-overhead" if self.graphs else None)
        self.loss_fn = loss_fn
        gen = torch.Generator().manual_seed(seed)
        self.x, self.y = (t.to(self.device) for t in sum_batch(batch, block, gen))

    def __call__(self):
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration: replay, not record
        loss = self.loss_fn(self.x, self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def time(self, steps):
        """``(issue_ms, step_ms)`` per step over ``steps`` steps, unprofiled: the host's time to
        issue them (before the final synchronize) and the wall time (after it)."""
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self()
        issued = time.perf_counter() - t0
        _sync(self.device)
        return issued * 1e3 / steps, (time.perf_counter() - t0) * 1e3 / steps

    def profile(self, steps):
        """The split of :func:`profile_training` from ``steps`` profiled steps."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        _sync(self.device)
        with torch.profiler.profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = self()
            _sync(self.device)
            wall = time.perf_counter() - t0
        out = _split(prof.events(), steps, wall * 1e3 / steps)
        out["profiled_step_ms"] = out.pop("wall_ms")
        out["loss"] = float(loss.detach())
        return out


def profile_training(attention="course", *, mode="eager", steps=5, warm=3, rounds=1, **kwargs):
    """Where one training step's time goes, measured: a dict of milliseconds per step.

    A :class:`TrainingStep` (``kwargs``: its settings) runs ``warm`` steps (compiling, CUDA-
    graph recording), then ``rounds`` x ``steps`` unprofiled steps, then ``steps`` under
    ``torch.profiler`` (CPU activities, and CUDA on a GPU). Keys:

    * ``step_ms``: wall time per step (median over rounds; ``step_ms_rounds`` all of them),
      ``issue_ms``: the host's time to issue a step (before the final synchronize). ``issue_ms``
      close to ``step_ms``: the GPU waited for the host (host-bound).
    * ``device_ms``: the union of the GPU's kernels, copies and sets per step (when it was
      busy); ``idle_ms = step_ms - device_ms`` (when it waited); None on the CPU.
    * ``host_ops_ms``: the union of the CPU's PyTorch op intervals (dispatcher, the ops' host
      code and the launches inside them; the rest of the host's time is Python), profiled and so
      inflated by the profiler's own cost; ``launch_ms``, ``launches``: CUDA launch calls;
      ``graph_launches``: CUDA graph replays; ``device_events``: GPU activities per step.
    """
    return profile_steps({mode: TrainingStep(attention, mode, **kwargs)}, steps=steps,
                         warm=warm, rounds=rounds)[mode]


def profile_steps(runs, *, steps=5, warm=3, rounds=5):
    """:func:`profile_training` for several :class:`TrainingStep` s (``{name: step}``), timed in
    interleaved rounds (A B C, A B C, ...: a drift touches every one alike); ``{name: dict}``."""
    import statistics

    for run in runs.values():
        for _ in range(warm):
            run()
    timed = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            timed[name].append(run.time(steps))
    out = {}
    for name, run in runs.items():
        split = run.profile(steps)
        issue, wall = zip(*timed[name], strict=True)
        split.update(step_ms=statistics.median(wall), step_ms_rounds=list(wall),
                     issue_ms=statistics.median(issue), mode=run.mode,
                     attention=run.attention, device=str(run.device), steps=steps,
                     rounds=rounds, **run.settings)
        if split["device_ms"] is not None:
            split["idle_ms"] = max(0.0, split["step_ms"] - split["device_ms"])
        out[name] = split
    return out
