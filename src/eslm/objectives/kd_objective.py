"""Distillation objectives as plug-ins of the shared step: KD on the kept tokens, and SALT's KD -> CE switch.

The loss maths is ``eslm.objectives.distill.kd_per_token``; the teacher is a frozen model
(``eslm.objectives.frozen.ReferenceModel``, shared with Rho-1's reference) with the student's tokenizer and vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eslm.contracts import ExtraWork, Pass
from eslm.objectives.base import BaseObjective, CrossEntropy
from eslm.objectives.distill import kd_per_token
from eslm.settings import Section, setting


@dataclass(frozen=True)
class KDSection(Section):
    """``method.kd.*``: the distillation settings of dense-kd, eslm-kd-* and salt (``lambda`` is a Python keyword:
    the attribute is ``lambda_``)."""

    key, help = "kd", "distillation (dense-kd, eslm-kd-*, salt)"

    teacher: str = setting("", "KD teacher: run dir or checkpoint with the same tokenizer")
    lambda_: float = setting(0.5, "KD weight lambda in lambda*KL + (1-lambda)*CE", key="lambda")
    temperature: float = setting(1.0, "KD temperature rho")

    def problems(self) -> list[str]:
        out = []
        if not (0.0 <= self.lambda_ <= 1.0):
            out.append(f"lambda: expected a value in [0, 1], got {self.lambda_}")
        if self.temperature <= 0:
            out.append(f"temperature: expected > 0, got {self.temperature}")
        return out


@dataclass(frozen=True)
class SaltSection(Section):
    """``method.salt.*``: SALT's switch (the KD settings are ``KDSection``'s)."""

    key, help = "salt", "SALT"

    kd_steps: int = setting(12000, "SALT: optimizer steps of dense KD before plain CE")

    def problems(self) -> list[str]:
        return [f"kd_steps: expected >= 0, got {self.kd_steps!r}"] if self.kd_steps < 0 else []


class Distill(BaseObjective):
    """lambda * KL(teacher_rho || student_rho) + (1 - lambda) * CE on the kept tokens (all tokens: Dense-KD).
    Selection scores (ESLM-KD) come from the student's own scoring pass (``Objective.score``)."""

    def __init__(self, teacher, *, lam: float, rho: float, seq_len: int, chunk_size: int = 1024,
                 impl: str = "auto"):
        super().__init__(impl, chunk_size)
        self.teacher, self.lam, self.rho, self.seq_len = teacher, lam, rho, seq_len

    def per_token(self, hidden, weight, batch, index, stats) -> torch.Tensor:
        t_hidden = self.teacher.hidden(batch.x).flatten(0, 1)
        targets = batch.y.reshape(-1)
        if index is not None:
            hidden, t_hidden, targets = hidden[index], t_hidden[index], targets[index]
        return kd_per_token(hidden, weight, t_hidden, self.teacher.head_weight, targets, lam=self.lam,
                            rho=self.rho, chunk_size=self.chunk_size)

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        """The teacher's forward over every token of the micro-batch."""
        return ExtraWork(passes=(Pass(tokens_seen, self.teacher.config, self.seq_len),))


class Salt(BaseObjective):
    """SALT: dense KD for the first ``kd_steps`` optimizer steps, then plain cross-entropy. Every hook goes to
    the objective in force (``active``)."""

    def __init__(self, kd: Distill, ce: CrossEntropy, kd_steps: int):
        super().__init__(ce.impl, ce.chunk_size)
        self.kd, self.ce, self.kd_steps = kd, ce, kd_steps
        self.step = 0

    @property
    def active(self) -> BaseObjective:
        return self.kd if self.step < self.kd_steps else self.ce

    def score(self, hidden, weight, targets, **kw):
        return self.active.score(hidden, weight, targets, **kw)

    def loss_sum(self, hidden, weight, batch, index, stats):
        return self.active.loss_sum(hidden, weight, batch, index, stats)

    def head_work(self, n, k, *, scored):
        return self.active.head_work(n, k, scored=scored)

    def on_step_end(self, step: int) -> None:
        self.step = step  # optimizer steps done

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        return self.active.extra_work(tokens_seen)

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
