"""Rho-1 (Lin et al., 2024): score each token by its excess loss against a frozen reference model.

    excess_j = loss_current(x_j) - loss_reference(x_j)          (signed; high = learnable, not yet learnt)

``Rho1Selector`` (a ``VaRSelector``) keeps the top 1-alpha of the tokens by this score (paper: 90%); the reference
is a frozen ``eslm.objectives.frozen.ReferenceModel`` (re-exported here, shared with the KD teacher).

Vocabularies. An imported OpenAI GPT-2 has V = 50257, our models V = 50304 (padded to a multiple of 64).
Targets are real token ids < 50257 in both, so the two per-token losses refer to the same event. Each model
normalises over its own vocabulary: the student's 47 padding logits are never targets and only enter its
softmax denominator (training drives their probability to ~0), so the losses are comparable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eslm.contracts import EXECUTED, ExtraWork, Pass
from eslm.objectives.frozen import ReferenceModel
from eslm.selection.selectors import VaRSelector
from eslm.settings import Section, setting

__all__ = ["ReferenceModel", "Rho1Section", "Rho1Selector", "excess_loss"]


@dataclass(frozen=True)
class Rho1Section(Section):
    """``method.rho1.*``: Rho-1's settings."""

    key, help = "rho1", "Rho-1"

    reference: str = setting("", "Rho-1 reference model: run dir, checkpoint or local HF GPT-2 dir")


def excess_loss(current: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Signed excess loss current - reference, (B, T) fp32 (any matching shape); both are per-token CE in nats."""
    if current.shape != reference.shape:
        raise ValueError(f"excess_loss: shapes differ, current {tuple(current.shape)} vs reference "
                         f"{tuple(reference.shape)}")
    return current.float() - reference.float()


class Rho1Selector(VaRSelector):
    """Rho-1: keep the top 1-alpha tokens by excess loss = current loss - frozen reference loss (signed)."""

    def __init__(self, reference: ReferenceModel, alpha: float, seq_len: int, standardize: str = "none",
                 n_domains: int = 1, scope: str = "micro"):
        super().__init__("excess_loss", alpha, standardize, n_domains, scope, needs=("loss",))
        self.reference, self.seq_len = reference, seq_len

    def scores(self, stats, batch) -> torch.Tensor:
        """(B, T) fp32 excess loss; runs the reference forward (no grad, eval mode, never in DDP)."""
        return excess_loss(stats.loss.view(batch.x.shape), self.reference.token_loss(batch.x, batch.y))

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        """The reference's forward over every token of the micro-batch each time ``scores`` runs: once, and in the
        scope "step" once more in the step's scoring forward (``eslm.train.step``), over the same tokens (the
        executed count alone includes that one)."""
        ref = Pass(tokens_seen, self.reference.config, self.seq_len)
        again = (Pass(tokens_seen, self.reference.config, self.seq_len, counted_by=(EXECUTED,)),) \
            if self.scope == "step" else ()
        return ExtraWork(passes=(ref, *again))
