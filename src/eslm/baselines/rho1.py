"""Rho-1 (Lin et al., 2024): score each token by its excess loss against a frozen reference model.

    excess_j = loss_current(x_j) - loss_reference(x_j)          (signed; high = learnable, not yet learnt)

The token selector (``eslm.selection.selectors``) keeps the top k% by this score (paper: 90%) and the step
averages the CE over the kept tokens. This module holds the reference model and the score.

The reference is a frozen GPT: eval mode (no dropout), every parameter ``requires_grad=False``, always run
under ``torch.no_grad``. ``ReferenceModel`` is deliberately not an ``nn.Module``: it can never become a
submodule of the trained model, so it is never wrapped in DDP, never in the optimizer, never in the trained
model's ``state_dict``. A resumed run reloads it from its path (``.source``).

Vocabularies. An imported OpenAI GPT-2 has V = 50257, our models V = 50304 (padded to a multiple of 64).
Targets are real token ids < 50257 in both, so the two per-token losses refer to the same event. Each model
normalises over its own vocabulary: the student's 47 padding logits are never targets and only enter its
softmax denominator (training drives their probability to ~0), so the losses are comparable.
"""

from __future__ import annotations

import torch

from eslm.objectives.cross_entropy import token_stats


def _default_impl() -> str:
    """'fused' when eslm.ops.fused_head is importable, else the naive oracle."""
    try:
        import eslm.ops.fused_head  # noqa: F401
    except ImportError:
        return "naive"
    return "fused"


def excess_loss(current: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Signed excess loss current - reference, (B, T) fp32 (any matching shape); both are per-token CE in nats."""
    if current.shape != reference.shape:
        raise ValueError(f"excess_loss: shapes differ, current {tuple(current.shape)} vs reference "
                         f"{tuple(reference.shape)}")
    return current.float() - reference.float()


class ReferenceModel:
    """A frozen GPT used for scoring only (Rho-1's reference; also usable as a KD teacher).

    model: an ``eslm.model.gpt.GPT``; it is put in eval mode and its parameters frozen in place.
    impl / chunk_size: how per-token losses are computed (``eslm.objectives.cross_entropy.token_stats``).
    """

    def __init__(self, model, *, source: str = "", meta: dict | None = None, impl: str | None = None,
                 chunk_size: int = 1024):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.source, self.meta = source, dict(meta or {})
        self.impl, self.chunk_size = impl or _default_impl(), chunk_size

    @classmethod
    def from_path(cls, path: str, device: torch.device | str = "cpu", **kw) -> "ReferenceModel":
        """Load a run dir, an eslm checkpoint .pt or a local HF GPT-2 dir (via ``eslm.model.loading``)."""
        from eslm.model.loading import load_model

        model, meta = load_model(path, device)
        return cls(model, source=str(path), meta=meta, **kw)

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def head_weight(self) -> torch.Tensor:
        """(V, C) frozen head weight (e.g. the teacher side of ``kd_per_token``)."""
        return self.model.head_weight

    def to(self, device) -> "ReferenceModel":
        self.model.to(device)
        return self

    @torch.no_grad()
    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T) int64 -> final hidden states (B, T, C), no gradient."""
        return self.model(x)

    @torch.no_grad()
    def token_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y (B, T) int64 -> per-token CE -log p_ref(y | x) (B, T) fp32 nats, no gradient, not reduced."""
        h = self.model(x)
        B, T, C = h.shape
        stats = token_stats(h.reshape(B * T, C), self.model.head_weight, y.reshape(-1), need_entropy=False,
                            impl=self.impl, chunk_size=self.chunk_size)
        return stats.loss.view(B, T)

    @property
    def forward_flops_per_token(self) -> float:
        """Forward FLOPs per token at the model's block_size (``forward_flops_per_token_at``)."""
        return self.forward_flops_per_token_at(self.model.config.block_size)

    def forward_flops_per_token_at(self, seq_len: int) -> float:
        """Forward FLOPs per token: one third of the PaLM training estimate 6N + 12 L H Q T,

            2 N + 4 L H Q T = 2 N + 4 n_layer n_embd T       (H Q = n_embd, T = seq_len)

        with N = ``num_params(non_embedding=True)`` (nanoGPT's count: the position embedding left out, the
        tied token embedding / head counted once, i.e. the head matmul's 2 V C is in 2 N).
        """
        cfg = self.model.config
        return 2.0 * self.model.num_params(non_embedding=True) + 4.0 * cfg.n_layer * cfg.n_embd * seq_len
