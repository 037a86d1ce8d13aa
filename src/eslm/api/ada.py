"""Ada-ESLM for any training loop: the trainer's controller (``eslm.selection.ada``: the update rule) behind a
small public class.

    ada = AdaAlpha(alpha=0.2, interval=100)
    for step, batch in enumerate(loader, 1):
        loss, stats = selective_loss(targets, logits=logits, alpha=ada.alpha)
        ada.observe(stats)                 # every micro-batch: its CVaR (a tensor, no host sync)
        ...; optimizer.step()
        ada.step()                         # after every optimizer step: alpha moves every ``interval`` steps

Under torch.compile pass ``alpha=ada.alpha_tensor``; see docs/dropin.md, "torch.compile and autocast".
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from eslm.errors import ConfigError
from eslm.selection import risk
from eslm.selection.ada import AdaController, AdaSection
from eslm.selection.stats import SelectionStats


class AdaAlpha:
    """The confidence level alpha, steered by the CVaR of the kept tokens (Ada-ESLM). Read ``alpha`` before
    each call, ``observe`` each call's stats, ``step`` after each optimizer step."""

    def __init__(self, alpha: float = 0.1, *, gamma: float = 0.5, interval: int = 1000, eps: float = 1e-8,
                 alpha_min: float = 0.0, alpha_max: float = 0.9):
        problems = AdaSection(gamma=gamma, interval=interval, eps=eps, alpha_min=alpha_min,
                              alpha_max=alpha_max).problems()
        alpha = risk.check_alpha(alpha)
        if not problems and not alpha_min <= alpha <= alpha_max:
            problems.append(f"alpha: expected a value in [alpha_min, alpha_max] = [{alpha_min}, {alpha_max}], "
                            f"got {alpha}")
        if problems:
            raise ConfigError("AdaAlpha: " + "; ".join(problems))
        self._holder = SimpleNamespace(alpha=alpha)  # what the controller steers
        self._controller = AdaController(self._holder, gamma=gamma, interval=interval, eps=eps,
                                         alpha_min=alpha_min, alpha_max=alpha_max)
        self.steps = 0
        self._tensor = torch.tensor(alpha, dtype=torch.float64)
        # the observed CVaRs' sum and count since the last update, on the CVaRs' device: observing inside a
        # torch.compile'd forward is then an in-place add (no Python state changes, so no recompile); handed to
        # the controller once per interval (one host sync, as before)
        self._acc = torch.zeros(2)

    @property
    def alpha(self) -> float:
        """The alpha in force (a Python float: pass it to ``selective_loss(alpha=...)``)."""
        return self._holder.alpha

    @property
    def alpha_tensor(self) -> torch.Tensor:
        """The alpha in force as a 0-dim float64 CPU tensor, updated in place by ``step``: pass it as
        ``selective_loss(alpha=...)`` inside a torch.compile'd function, where it is a graph input (one graph
        for every alpha; a Python float is a constant in the first graph and a recompile for the second).
        ``patch_causal_lm`` and ``patch_model`` pass it themselves while compiling."""
        return self._tensor

    @property
    def alpha_min(self) -> float:
        """The smallest alpha Ada may set: pass it as ``selective_loss(alpha_min=...)`` under torch.compile, so
        the static number of rows whose CE is computed is num_kept(N, alpha_min) (see ``selective_loss``)."""
        return self._controller.alpha_min

    @property
    def last_delta(self) -> float:
        """D of the last update (0 before the first)."""
        return self._controller.last_delta

    def to(self, device: torch.device | str) -> AdaAlpha:
        """Keep the observed CVaRs' sum on ``device`` (the CVaRs' device; ``patch_model`` and ``patch_causal_lm``
        set it to the head's), so the first observe inside a compiled forward does not move it."""
        self._acc = self._acc.to(device)
        return self

    def observe(self, stats: SelectionStats) -> None:
        """One call's ``SelectionStats`` (its ``cvar``, the mean score of the kept tokens)."""
        cvar = stats.cvar.detach().float().reshape(())
        if self._acc.device != cvar.device:
            self._acc = self._acc.to(cvar.device)
        self._acc.add_(torch.stack([cvar, torch.ones_like(cvar)]))

    def _flush(self) -> None:
        count = int(self._acc[1])
        if count:
            self._controller.add(self._acc[0].clone(), count)
            self._acc.zero_()

    def step(self) -> None:
        """After each optimizer step (one host sync every ``interval`` steps, none otherwise)."""
        self.steps += 1
        if self.steps % self._controller.interval == 0:
            self._flush()
        self._controller.on_step_end(self.steps)
        self._tensor.fill_(self._holder.alpha)

    def state_dict(self) -> dict:
        self._flush()
        return {"steps": self.steps, **self._controller.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.steps = int(sd["steps"])
        self._controller.load_state_dict(sd)
        self._tensor.fill_(self._holder.alpha)


class AlphaHandle:
    """The alpha of a patched forward's loss (``patch_model``'s and ``patch_causal_lm``'s handles): Ada's when
    ``ada`` is set, else the fixed ``_alpha``."""

    def __init__(self, alpha: float, ada: AdaAlpha | None, device: torch.device):
        self.ada, self._alpha = ada, alpha if ada is None else ada.alpha
        if ada is not None and device.type != "meta":
            ada.to(device)  # the head's device

    @property
    def alpha(self) -> float:
        return self.ada.alpha if self.ada is not None else self._alpha

    def loss_alpha(self) -> float | torch.Tensor:
        """The alpha passed to the loss: under torch.compile Ada's as its 0-dim tensor (a graph input, so a new
        value needs no recompile), else the Python float."""
        if self.ada is not None and torch.compiler.is_compiling():
            return self.ada.alpha_tensor
        return self.alpha
