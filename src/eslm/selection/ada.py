"""Ada-ESLM: a CVaR-driven controller for the confidence level alpha.

Every ``interval`` optimizer steps (the paper's T_eval = 1000):

    D = (CVaR_k - CVaR_{k-1}) / (|CVaR_{k-1}| + eps)
    alpha_{k+1} = clamp(alpha_k * exp(-gamma * D), alpha_min, alpha_max)

Its departures from the paper's algorithm box (no update before two measurements, the clamp, CVaR_k as the mean
of the interval's micro-batch CVaRs) and why: docs/paper.md's table of departures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from eslm.contracts import Selection
from eslm.settings import Section, setting


@dataclass(frozen=True)
class AdaSection(Section):
    """``method.ada.*``: the Ada-ESLM controller's settings."""

    key, help = "ada", "Ada-ESLM controller"

    gamma: float = setting(0.5, "adaptation rate of alpha_{k+1} = alpha_k exp(-gamma D)")
    interval: int = setting(1000, "T_eval: optimizer steps between alpha updates (the paper: 1000)")
    eps: float = setting(1e-8, "epsilon in D = (CVaR_k - CVaR_{k-1}) / (|CVaR_{k-1}| + eps)")
    alpha_min: float = setting(0.0, "lower clamp for alpha")
    alpha_max: float = setting(0.9, "upper clamp for alpha")

    def problems(self) -> list[str]:
        out = []
        if self.gamma < 0:
            out.append(f"gamma: expected >= 0, got {self.gamma!r}")
        if self.interval <= 0:
            out.append(f"interval: expected a positive number, got {self.interval!r}")
        if not (0.0 <= self.alpha_min <= self.alpha_max < 1.0):
            out.append(f"alpha_min, alpha_max: expected 0 <= alpha_min <= alpha_max < 1, got {self.alpha_min}, "
                       f"{self.alpha_max}")
        return out


class Steered(Protocol):
    """What the controller steers: the alpha in force (a token selector's, ``eslm.api.AdaAlpha``'s holder)."""

    alpha: float


class AdaController:
    """An ``eslm.contracts.Controller``: observes each selection's CVaR, steers ``selector.alpha``."""

    def __init__(self, selector: Steered, *, gamma: float, interval: int, eps: float, alpha_min: float,
                 alpha_max: float) -> None:
        self.selector = selector  # owns the alpha in force
        self.gamma, self.interval, self.eps = gamma, interval, eps
        self.alpha_min, self.alpha_max = alpha_min, alpha_max
        self.prev_cvar: float | None = None
        # a Python number until the interval's first CVaR arrives, then a tensor on that CVaR's device: a CPU
        # tensor moved to CUDA would be a host sync in every step that starts an interval
        self._sum: torch.Tensor | float = 0.0
        self._count = 0
        self.last_delta: float = 0.0

    def observe(self, selection: Selection) -> None:
        """Accumulate one micro-batch's CVaR (a tensor: no host sync here)."""
        if selection.stats is not None:
            self.add(selection.stats.cvar.detach().float(), 1)

    def add(self, total: torch.Tensor, count: int) -> None:
        """Accumulate ``count`` CVaRs summing to ``total`` (eslm.api's AdaAlpha sums them on the device)."""
        self._sum = total + self._sum
        self._count += count

    def on_step_end(self, step: int) -> None:
        """After optimizer step ``step`` (1-based): update alpha every ``interval`` steps."""
        if step % self.interval != 0 or self._count == 0:
            return
        current = float(self._sum) / self._count  # one sync per interval
        self._sum, self._count = 0.0, 0
        if self.prev_cvar is not None:
            delta = (current - self.prev_cvar) / (abs(self.prev_cvar) + self.eps)
            alpha = self.selector.alpha * math.exp(-self.gamma * delta)
            self.selector.alpha = min(max(alpha, self.alpha_min), self.alpha_max)
            self.last_delta = delta
        self.prev_cvar = current

    def state_dict(self) -> dict:
        return {"prev_cvar": self.prev_cvar, "sum": float(self._sum), "count": self._count,
                "last_delta": self.last_delta, "alpha": self.selector.alpha}

    def load_state_dict(self, sd: dict) -> None:
        self.prev_cvar = sd["prev_cvar"]
        self._sum, self._count = float(sd["sum"]), int(sd["count"])
        self.last_delta = float(sd["last_delta"])
        self.selector.alpha = float(sd["alpha"])
