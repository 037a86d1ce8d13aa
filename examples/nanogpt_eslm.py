"""ESLM in a nanoGPT-style training loop: three lines change, and the logits are never built.

    python examples/nanogpt_eslm.py --iters 50 --alpha 0.2 [--ada]

The model below has nanoGPT's shape (token + position embeddings, pre-norm blocks, a final LayerNorm, an LM
head tied to the token embedding) and its ``forward(idx, targets) -> (logits, loss)``; ``hidden(idx)`` stops
before the head. The loop is nanoGPT's (a micro-batch of (B, T) windows from one token array, gradient
accumulation, clipping, AdamW), with the loss replaced:

    k_step = sum(kept_tokens(Y, alpha=alpha) for _, Y in micro)                     # before the forwards
    loss, stats = selective_loss(Y, hidden=model.hidden(X), lm_weight=model.lm_head.weight,
                                 alpha=alpha, num_items_in_batch=k_step)

Normalisation: nanoGPT divides each micro-batch's mean by the accumulation steps. Its windows have no padding,
so every micro-batch keeps the same K and that division is already the exact kept-token mean; num_items_in_batch
keeps it exact when targets carry ignored positions (-100) too. With DDP, all-reduce k_step over the ranks and
multiply the loss by the world size (DDP averages gradients).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from eslm.api import AdaAlpha, kept_tokens, selective_loss


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int = 64, block_size: int = 32, n_layer: int = 2, n_head: int = 2,
                 n_embd: int = 32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT

    def hidden(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)

    def forward(self, idx, targets=None):
        logits = self.lm_head(self.hidden(idx))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                                            ignore_index=-100)
        return logits, loss


def toy_tokens(n: int = 4096, vocab_size: int = 64, seed: int = 0) -> torch.Tensor:
    """x_{t+1} = (5 x_t + 3) mod V with 15% random tokens: a learnable stream with hard tokens in it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, dtype=torch.long)
    x[0] = 1
    noise = torch.rand(n, generator=g) < 0.15
    rand = torch.randint(0, vocab_size, (n,), generator=g)
    for t in range(1, n):
        x[t] = rand[t] if noise[t] else (5 * x[t - 1] + 3) % vocab_size
    return x


def get_batch(data: torch.Tensor, batch_size: int, block_size: int, g: torch.Generator):
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=g)
    X = torch.stack([data[i:i + block_size] for i in ix])
    Y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return X, Y


def step(model, micro, *, alpha: float, score: str = "entropy"):
    """One optimizer step's forwards and backwards (no optimizer): returns the step's kept-mean loss and the
    last micro-batch's SelectionStats."""
    k_step = sum(kept_tokens(Y, alpha=alpha) for _, Y in micro)
    total, stats = 0.0, None
    for X, Y in micro:
        loss, stats = selective_loss(Y, hidden=model.hidden(X), lm_weight=model.lm_head.weight, score=score,
                                     alpha=alpha, num_items_in_batch=k_step)
        loss.backward()
        total += float(loss.detach())
    return total, stats


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--alpha", type=float, default=0.2)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--ada", action="store_true")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    model, data, g = GPT(), toy_tokens(), torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ada = AdaAlpha(alpha=a.alpha, interval=10) if a.ada else None
    losses = []
    for it in range(a.iters):
        alpha = ada.alpha if ada is not None else a.alpha
        micro = [get_batch(data, 8, 32, g) for _ in range(a.grad_accum)]
        loss, stats = step(model, micro, alpha=alpha)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ada is not None:
            ada.observe(stats)
            ada.step()
        losses.append(loss)
        if it % 10 == 0 or it == a.iters - 1:
            print(f"iter {it}: loss {loss:.3f}, kept {float(stats.kept_frac):.2f}, alpha {alpha:.3f}")
    with torch.no_grad():
        X, Y = get_batch(data, 32, 32, g)
        print(f"plain CE on a fresh batch: {float(model(X, Y)[1]):.3f} (uniform: {math.log(64):.3f})")
    return losses


if __name__ == "__main__":
    main()
