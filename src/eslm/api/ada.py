"""Ada-ESLM for any training loop: the trainer's controller (``eslm.selection.ada``) behind a small public class.

    ada = AdaAlpha(alpha=0.2, interval=100)
    for step, batch in enumerate(loader, 1):
        loss, stats = selective_loss(targets, logits=logits, alpha=ada.alpha)
        ada.observe(stats)                 # every micro-batch: its CVaR (a tensor, no host sync)
        ...; optimizer.step()
        ada.step()                         # after every optimizer step: alpha moves every ``interval`` steps

Every ``interval`` optimizer steps, with CVaR_k the mean of the observed CVaRs since the last update,

    D = (CVaR_k - CVaR_{k-1}) / (|CVaR_{k-1}| + eps),   alpha <- clamp(alpha * exp(-gamma D), alpha_min, alpha_max)

and no update happens until two intervals have been measured (see ``eslm.selection.ada`` for why).
``state_dict`` / ``load_state_dict`` carry alpha, the history and the step count, so a resumed run continues
bit for bit; the state is plain Python numbers (``torch.save`` or JSON both work).
"""

from __future__ import annotations

from types import SimpleNamespace

from eslm.errors import ConfigError
from eslm.selection import risk
from eslm.selection.ada import AdaController, AdaSection
from eslm.selection.stats import SelectionStats


class _Observed:
    """What the controller reads of a selection (its ``stats``); a plain class, so torch.compile traces it."""

    def __init__(self, stats: SelectionStats | None) -> None:
        self.stats = stats


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

    @property
    def alpha(self) -> float:
        """The alpha in force (a Python float: pass it to ``selective_loss(alpha=...)``)."""
        return self._holder.alpha

    @property
    def alpha_min(self) -> float:
        """The smallest alpha Ada may set: pass it as ``selective_loss(alpha_min=...)`` under torch.compile, so
        the static number of rows whose CE is computed is num_kept(N, alpha_min) (see ``selective_loss``)."""
        return self._controller.alpha_min

    @property
    def last_delta(self) -> float:
        """D of the last update (0 before the first)."""
        return self._controller.last_delta

    def observe(self, stats: SelectionStats | None) -> None:
        """One call's ``SelectionStats`` (its ``cvar``, the mean score of the kept tokens)."""
        self._controller.observe(_Observed(stats))

    def step(self) -> None:
        """After each optimizer step (one host sync every ``interval`` steps, none otherwise)."""
        self.steps += 1
        self._controller.on_step_end(self.steps)

    def state_dict(self) -> dict:
        return {"steps": self.steps, **self._controller.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.steps = int(sd["steps"])
        self._controller.load_state_dict(sd)
