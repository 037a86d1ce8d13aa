"""Distillation objectives as plug-ins of the shared step: KD on the kept tokens, and SALT's KD -> CE switch.

The loss maths is ``eslm.objectives.distill.kd_per_token``; the teacher is a frozen model
(``eslm.baselines.rho1.ReferenceModel``) with the student's tokenizer and vocabulary.
"""

from __future__ import annotations

import torch

from eslm.objectives.base import CrossEntropy, Objective
from eslm.objectives.distill import kd_per_token


class Distill(Objective):
    """lambda * KL(teacher_rho || student_rho) + (1 - lambda) * CE on the kept tokens (all tokens: Dense-KD).
    Selection scores (ESLM-KD) come from the student's own scoring pass (``Objective.score``)."""

    def __init__(self, teacher, *, lam: float, rho: float, seq_len: int, chunk_size: int = 1024,
                 impl: str = "fused"):
        super().__init__(impl, chunk_size)
        self.teacher, self.lam, self.rho, self.seq_len = teacher, lam, rho, seq_len

    def per_token(self, hidden, weight, batch, index, stats, step) -> torch.Tensor:
        t_hidden = self.teacher.hidden(batch.x).flatten(0, 1)
        targets = batch.y.reshape(-1)
        if index is not None:
            hidden, t_hidden, targets = hidden[index], t_hidden[index], targets[index]
        return kd_per_token(hidden, weight, t_hidden, self.teacher.head_weight, targets, lam=self.lam,
                            rho=self.rho, chunk_size=self.chunk_size)

    def extra_flops(self, tokens_seen: int) -> tuple[float, float]:
        f = self.teacher.forward_flops_per_token_at(self.seq_len) * tokens_seen
        return f, f


class Salt:
    """SALT: dense KD for the first ``kd_steps`` optimizer steps, then plain cross-entropy."""

    def __init__(self, kd: Distill, ce: CrossEntropy, kd_steps: int):
        self.kd, self.ce, self.kd_steps = kd, ce, kd_steps
        self.step = 0

    def _active(self):
        return self.kd if self.step < self.kd_steps else self.ce

    def score(self, hidden, weight, targets, **kw):
        return self._active().score(hidden, weight, targets, **kw)

    def loss_sum(self, hidden, weight, batch, index, stats, step):
        return self._active().loss_sum(hidden, weight, batch, index, stats, step)

    def head_work(self, n, k, *, scored):
        return self._active().head_work(n, k, scored=scored)

    def on_step_end(self, step: int) -> None:
        self.step = step  # optimizer steps done

    def extra_flops(self, tokens_seen: int) -> tuple[float, float]:
        return self._active().extra_flops(tokens_seen)

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
