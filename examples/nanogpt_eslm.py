"""ESLM in a nanoGPT-style training loop: three lines change, and the logits are never built.

    python examples/nanogpt_eslm.py --iters 50 --alpha 0.2 [--ada] [--compile]
    torchrun --nproc_per_node 2 examples/nanogpt_eslm.py --iters 50      # DDP (gloo on CPU)

The model below has nanoGPT's shape (token + position embeddings, pre-norm blocks, a final LayerNorm, an LM
head tied to the token embedding) and its ``forward(idx, targets) -> (logits, loss)``. The loop is nanoGPT's
(a micro-batch of (B, T) windows from one token array, gradient accumulation, clipping, AdamW, DDP under
torchrun, torch.compile), with the loss replaced:

    handle = patch_model(model, head=model.lm_head, alpha=alpha)                    # before DDP / compile
    k_step = sum(kept_tokens(Y, alpha=handle.alpha) for _, Y in micro)              # before the forwards
    loss, stats = model(X, eslm_targets=Y, eslm_num_items=k_step)                   # model: DDP / compiled

``patch_model`` captures the head's input inside the model's own forward, so DDP's gradient all-reduce and
torch.compile see the whole computation. Do not call a method that stops before the head instead
(``model.module.hidden(X)`` under DDP skips the all-reduce; ``torch.compile(model).hidden(X)`` runs eagerly).

Normalisation: nanoGPT divides each micro-batch's mean by the accumulation steps. Its windows have no padding,
so every micro-batch keeps the same K and that division is already the exact kept-token mean; eslm_num_items
keeps it exact when targets carry ignored positions (-100) too. Under DDP k_step is all-reduced over the ranks
and the loss multiplied by the world size (DDP averages gradients): the update is that of the mean CE over the
kept tokens of every rank.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from eslm.api import AdaAlpha, kept_tokens, patch_model


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

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
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


def step(model, handle, micro):
    """One optimizer step's forwards and backwards (no optimizer) through ``model`` (the patched model, or its
    DDP / compiled wrapper): returns the step's kept-mean loss and the last micro-batch's SelectionStats."""
    k_step = sum(kept_tokens(Y, alpha=handle.alpha) for _, Y in micro)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        dist.all_reduce(k_step)  # the kept tokens of every rank's micro-batches
    total, stats = 0.0, None
    for X, Y in micro:
        loss, stats = model(X, eslm_targets=Y, eslm_num_items=k_step)
        (loss * world).backward()  # DDP averages the gradients over the ranks
        total += float(loss.detach())
    return total, stats


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--alpha", type=float, default=0.2)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--ada", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (after patching)")
    a = p.parse_args(argv)
    ddp = "RANK" in __import__("os").environ  # launched by torchrun
    if ddp:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    raw, data = GPT(), toy_tokens()
    g = torch.Generator().manual_seed(1 + (dist.get_rank() if ddp else 0))  # each rank its own windows
    ada = AdaAlpha(alpha=a.alpha, interval=10) if a.ada else None
    handle = patch_model(raw, head=raw.lm_head, alpha=a.alpha, ada=ada)   # the unwrapped model, first
    model = torch.nn.parallel.DistributedDataParallel(raw) if ddp else raw
    if a.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW(raw.parameters(), lr=3e-3)
    losses = []
    for it in range(a.iters):
        alpha = handle.alpha
        micro = [get_batch(data, 8, 32, g) for _ in range(a.grad_accum)]
        loss, stats = step(model, handle, micro)   # Ada observes each micro-batch inside the forward
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ada is not None:
            ada.step()
        losses.append(loss)
        if (it % 10 == 0 or it == a.iters - 1) and (not ddp or dist.get_rank() == 0):
            print(f"iter {it}: loss {loss:.3f}, kept {float(stats.kept_frac):.2f}, alpha {alpha:.3f}")
    with torch.no_grad():
        X, Y = get_batch(data, 32, 32, g)
        print(f"plain CE on a fresh batch: {float(raw(X, Y)[1]):.3f} (uniform: {math.log(64):.3f})")
    if ddp:
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
