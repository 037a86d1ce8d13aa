"""GPT-2 in the nanoGPT style.

Parameter names follow nanoGPT (``transformer.wte``, ``transformer.h.0.attn.c_attn`` ...), which map 1:1
onto transformers' ``GPT2LMHeadModel`` (see ``eslm.model.hf``).

The forward returns the final hidden states (after ``ln_f``), shape (B, T, n_embd). It never computes a
loss: every loss is computed from (hidden, head weight, targets) in ``eslm.objectives`` / ``eslm.ops``,
which is what lets the selective loss skip work for dropped tokens. ``logits()`` gives full logits on request.

``forward(idx, cache=KVCache(...))`` is the incremental path for generation (``eslm.eval.generate``): each layer's
keys and values are appended to the cache and ``idx`` holds only the new tokens. Without a cache the forward
runs exactly the training code (the cache branch is separate), so training numerics do not depend on it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from eslm.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64
    block_size: int = 1024  # context length
    bias: bool = False  # True only for imported OpenAI/HF GPT-2 checkpoints
    dropout: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


# Presets. The three GPT-2 sizes follow the paper's architecture table; `tiny` is for tests,
# `small` for the CPU demo (the default `eslm train`).
PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=64),
    "small": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    # small's body with a byte vocabulary (data.tokenizer=byte: 257 ids, padded to 320): a context of 288 bytes holds
    # about as much stdlib text as small's 128 GPT-2 tokens (2.28 bytes per token over the corpus); docs/study.md
    "small-byte": dict(n_layer=4, n_head=4, n_embd=128, block_size=288),
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-350m": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
    "gpt2-774m": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),
}


def pad_vocab(n: int, multiple: int = 64) -> int:
    """The model's vocabulary for a tokenizer of n ids: n rounded up to a multiple of 64 (GPT-2: 50304)."""
    return ((n + multiple - 1) // multiple) * multiple


def preset(name: str, **overrides) -> ModelConfig:
    """The ModelConfig of a named preset, with field overrides (e.g. vocab_size)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; expected one of {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})


class KVCache:
    """Keys and values of the tokens processed so far, per layer: (B, n_head, T_cached, head_dim) each."""

    def __init__(self, n_layer: int):
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer

    @property
    def length(self) -> int:
        """Tokens cached (the position of the next token)."""
        first = self.k[0]
        return 0 if first is None else first.shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.k[layer], self.v[layer]
        if old_k is not None and old_v is not None:
            k, v = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is None:
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:  # new token i (absolute position P + i) sees the P cached tokens and new tokens 0..i
            cached = cache.k[layer]
            P = 0 if cached is None else cached.shape[2]
            k, v = cache.append(layer, k, v)
            mask = torch.ones(T, P + T, dtype=torch.bool, device=x.device).tril(diagonal=P)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 uses the tanh approximation of GELU ("gelu_new" in transformers).
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + (self.attn(self.ln_1(x)) if cache is None else self.attn(self.ln_1(x), cache, layer))
        return x + self.mlp(self.ln_2(x))


class Trunk(nn.ModuleDict):
    """The trunk under ``transformer.*`` with nanoGPT's names; a ``ModuleDict`` whose entries are declared for a
    type checker (the modules, their order and the parameter names are the ModuleDict's)."""

    wte: nn.Embedding
    wpe: nn.Embedding
    drop: nn.Dropout
    h: nn.ModuleList
    ln_f: nn.LayerNorm


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.transformer = Trunk(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM-head weight (V, C), tied to the token embedding."""
        return self.lm_head.weight

    def num_params(self) -> int:
        """Parameter count without the position embedding, as nanoGPT counts (the token embedding is tied to the
        head and so is counted once)."""
        return sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """idx (B, T) int64 token ids -> final hidden states (B, T, n_embd) after ln_f.

        With ``cache``: idx holds the tokens after the cached ones (positions cache.length ...), whose keys and
        values are appended to the cache; the total may not exceed block_size."""
        B, T = idx.shape
        start = 0 if cache is None else cache.length
        if start + T > self.config.block_size:
            raise ValueError(f"sequence length {start + T} exceeds the model's block_size {self.config.block_size}")
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for i, block in enumerate(self.transformer.h):
            x = block(x) if cache is None else block(x, cache, i)
        return self.transformer.ln_f(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits (..., V) from hidden states; use only where the whole vocabulary is needed."""
        return self.lm_head(hidden)
