"""A frozen GPT for scoring only: Rho-1's reference model and the KD teacher (``eslm.baselines.rho1``,
``eslm.objectives.kd_objective``). Eval mode, every parameter ``requires_grad=False``, always run under
``torch.no_grad``; deliberately not an ``nn.Module``, so it can never become a submodule of the trained model (never
wrapped in DDP, never in the optimizer or the trained model's ``state_dict``); a resumed run loads it again from
its config key.
"""

from __future__ import annotations

import torch

from eslm.model import loading
from eslm.ops.head_backend import backend
from eslm.ops.token_stats import HeadOptions


class ReferenceModel:
    """``model`` (a GPT) frozen in place; ``impl`` / ``chunk_size``: the head backend of its ``token_stats``."""

    def __init__(self, model, *, impl: str = "auto", chunk_size: int = 1024):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.impl, self.chunk_size = impl, chunk_size

    @classmethod
    def from_path(cls, path: str, device: torch.device | str = "cpu", **kw) -> ReferenceModel:
        """Load a run dir, an eslm checkpoint .pt or a local HF GPT-2 dir (via ``eslm.model.loading``)."""
        return cls(loading.load_model(path, device)[0], **kw)

    @property
    def config(self):
        return self.model.config

    @property
    def head_weight(self) -> torch.Tensor:
        """(V, C) frozen head weight (e.g. the teacher side of ``kd_per_token``)."""
        return self.model.head_weight

    @torch.no_grad()
    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T) int64 -> final hidden states (B, T, C), no gradient."""
        return self.model(x)

    @torch.no_grad()
    def token_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y (B, T) int64 -> per-token CE -log p_ref(y | x) (B, T) fp32 nats, no gradient, not reduced."""
        h = self.model(x)
        B, T, C = h.shape
        stats = backend(self.impl, h.device.type, HeadOptions(self.chunk_size)).token_stats(
            h.reshape(B * T, C), self.model.head_weight, y.reshape(-1), need_entropy=False)
        return stats.loss.view(B, T)
