"""A tiny GPT to train with the course's attention or with SDPA: chapter 12.

Everything is generated here, nothing is downloaded. The data is a character stream of sums,
``"37+58=95;4+61=65;..."``, drawn from a seeded generator: the digits of the operands are
random, but the punctuation, the lengths and the digits of each sum follow from what came before,
so a model that learns the structure gets well below the unigram entropy of the characters.

The model, nanoGPT's layout: token and position embeddings, ``n_layer`` blocks of
pre-LayerNorm causal self-attention and MLP (4x, GELU), a final LayerNorm, and a head tied to the
token embedding. Only the attention call changes with ``attention``:

* ``"sdpa"``:   ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``
* ``"course"``: ``ops.flash_attention(q, k, v, causal=True)`` (chapter 09's kernels on a GPU)

``train(attention, seed=...)`` builds the model with ``torch.manual_seed(seed)`` and draws the
batches from a generator seeded with ``seed``: the same seed gives the same initial weights and
the same batches for both attentions, so their loss curves differ only by rounding.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops
from .runtime import half_dtype

VOCAB = "0123456789+=;"  # the characters of the sums
ATTENTIONS = ("sdpa", "course")

__all__ = ["ATTENTIONS", "GPT", "VOCAB", "chance_loss", "decode", "encode", "learning_rate",
           "make_sums", "train", "unigram_entropy"]


# =============================================================================================
# Data
# =============================================================================================


def make_sums(n_chars, seed=0, max_operand=99):
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
    p = torch.bincount(data, minlength=len(VOCAB)).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def _batch(data, batch, block, gen, device):
    """``batch`` random windows: inputs x and targets y = x shifted by one, ``(batch, block)``."""
    starts = torch.randint(0, len(data) - block - 1, (batch,), generator=gen)
    x = torch.stack([data[s:s + block] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + 1 + block] for s in starts.tolist()])
    return x.to(device), y.to(device)


# =============================================================================================
# Model
# =============================================================================================


class SelfAttention(nn.Module):
    """Causal multi-head self-attention; ``attention`` picks who computes softmax(QK^T)V."""

    def __init__(self, n_embd, n_head, attention):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not a multiple of n_head={n_head}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r}: choose one of {ATTENTIONS}")
        self.n_head, self.attention = n_head, attention
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, N, C = x.shape
        d = C // self.n_head
        # (B, N, 3, H, d) -> three (B, H, N, d) views (not contiguous: the op copies them)
        q, k, v = self.qkv(x).view(B, N, 3, self.n_head, d).permute(2, 0, 3, 1, 4)
        if self.attention == "sdpa":
            O = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            O = ops.flash_attention(q, k, v, causal=True)
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
# Training
# =============================================================================================


def train(attention, *, seed=0, steps=200, batch=16, block=64, n_layer=2, n_head=4, n_embd=64,
          device="cpu", compile=False, lr=3e-3, warmup=5, data_chars=200_000, log=None,
          cpu_threads=1, lr_warmup=0, cosine=False):
    """Train a fresh GPT on the sums; returns a dict.

    Keys: ``losses`` (training loss of every step, from the same batches for any attention),
    ``tokens_per_s`` (after ``warmup`` steps, so compiling and tuning are not counted),
    ``first_step_s`` (the first step alone: compile time if ``compile``), ``unigram``
    (the unigram entropy, nats), ``final`` (mean loss of the last 10 steps), and the settings.
    On CUDA the model runs under 16-bit autocast (the course's kernels take 16-bit inputs):
    bfloat16, or float16 with a gradient scaler on a GPU without bf16 tensor cores (a T4;
    ``course_utils.half_dtype()`` decides, and the result's ``amp_dtype`` says which).
    ``log``: a function called as ``log(step, loss)`` every 50 steps. ``cpu_threads``: torch's
    intra-op threads during a CPU run (restored after; None leaves them alone). The tiny model's
    matrices are too small to split: more threads only add synchronisation, and on a busy
    machine (2 cores shared) a 2-thread run was measured 5-10x slower than a 1-thread one.
    ``lr_warmup``: steps over which the learning rate rises linearly from lr / lr_warmup to lr.
    ``cosine``: then it falls along a half cosine to lr / 10 at the last step (else it stays at
    lr). A decayed learning rate ends a run in a minimum instead of bouncing around one, so the
    final losses of two runs can be compared.
    """
    device = torch.device(device)
    threads_before = torch.get_num_threads()
    if device.type == "cpu" and cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    try:
        return _train(attention, seed, steps, batch, block, n_layer, n_head, n_embd, device,
                      compile, lr, warmup, data_chars, log, lr_warmup, cosine)
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


def _train(attention, seed, steps, batch, block, n_layer, n_head, n_embd, device, compile, lr,
           warmup, data_chars, log, lr_warmup, cosine):
    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r}: choose one of {ATTENTIONS}")
    if steps <= warmup:
        raise ValueError(f"steps={steps} must be more than warmup={warmup} to time anything")
    data = encode(make_sums(data_chars, seed=1234))  # one fixed data set for every run
    torch.manual_seed(seed)  # the same initial weights for both attentions
    model = GPT(n_layer, n_head, n_embd, block, attention).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)  # the same batches for both attentions
    amp_dtype = half_dtype() if device.type == "cuda" else None  # says so once when float16
    # float16's 5 exponent bits lose small gradients: scale the loss up, and the gradients back
    # down before the step (skipping a step whose gradients overflowed). bf16 needs none of it.
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    step_fn = _step_function(model, device, amp_dtype)
    if compile:
        step_fn = torch.compile(step_fn, fullgraph=True, dynamic=False)

    losses, t0, first_step_s = [], None, None
    for step in range(steps):
        if step == warmup:
            _sync(device)
            t0 = time.perf_counter()
        x, y = _batch(data, batch, block, gen, device)
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
        if log is not None and step % 50 == 0:
            log(step, losses[-1])
    _sync(device)
    elapsed = time.perf_counter() - t0
    return {"attention": attention, "losses": losses,
            "tokens_per_s": (steps - warmup) * batch * block / elapsed,
            "first_step_s": first_step_s, "final": sum(losses[-10:]) / len(losses[-10:]),
            "unigram": unigram_entropy(data), "seed": seed, "steps": steps, "batch": batch,
            "block": block, "n_layer": n_layer, "n_head": n_head, "n_embd": n_embd,
            "device": str(device), "compile": compile, "lr": lr, "lr_warmup": lr_warmup,
            "cosine": cosine,
            "amp_dtype": str(amp_dtype).removeprefix("torch.") if amp_dtype else None,
            "params": sum(p.numel() for p in model.parameters())}


def _step_function(model, device, amp_dtype):
    def loss_of(x, y):
        with torch.autocast(device.type, dtype=amp_dtype or torch.bfloat16,
                            enabled=amp_dtype is not None):
            logits = model(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))

    return loss_of


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def chance_loss():
    """ln(len(VOCAB)): the loss of a uniform guess, where training starts."""
    return math.log(len(VOCAB))
