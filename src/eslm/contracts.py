"""The plug-in points of the shared training step (docs/architecture.md): what a row selector, a token selector,
an objective and a controller must do, and the extra work each declares (``ExtraWork``), which ``eslm.flops``
prices. The step calls exactly these hooks (no ``hasattr`` probing); a component overrides its no-op base."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:  # annotations only
    from eslm.data.batch import Batch
    from eslm.model.gpt import ModelConfig
    from eslm.ops.token_stats import HeadWork, TokenStats
    from eslm.selection.stats import SelectionStats


@dataclass
class Selection:
    """The kept tokens of one micro-batch.

    index:     (K,) int64 flat indices into the (B*T,) token axis, or None for "all tokens"
    num_kept:  K (Python int)
    num_tokens: N = B*T (Python int)
    stats:     what the selection did (``eslm.selection.stats.SelectionStats``), or None when nothing was
               scored (all tokens kept)
    """

    index: torch.Tensor | None
    num_kept: int
    num_tokens: int
    stats: SelectionStats | None = None


class StepThreshold(NamedTuple):
    """A token selector's threshold for the whole optimizer step (selection scope "step")."""

    value: torch.Tensor  # 0-dim: keep every token whose ranked score is >= value
    kept: int  # how many tokens of the step, on all ranks, are at or above it (global normalisation)


FORWARD, BACKWARD = "forward", "backward"  # Pass.direction
PAPER, EXECUTED = "paper", "executed"  # the FLOPs conventions that may count a pass (eslm.flops)


@dataclass(frozen=True)
class Pass:
    """One pass over ``tokens`` tokens of one micro-batch on one rank.

    model:      None for the trained model, else the ``ModelConfig`` of a frozen model (a Rho-1 reference, a KD
                teacher), which runs forward only, at ``seq_len`` tokens per sequence (its attention span)
    direction:  FORWARD or BACKWARD
    counted_by: the conventions that count it: both for work the method needs (a teacher's forward), EXECUTED
                alone for work only this implementation runs (the selection scope "step"'s scoring forward: the
                paper counts one forward per training token)
    """

    tokens: int
    model: ModelConfig | None = None
    seq_len: int = 0
    direction: str = FORWARD
    counted_by: tuple[str, ...] = (PAPER, EXECUTED)

    def __post_init__(self):
        if self.tokens < 0:
            raise ValueError(f"a pass runs a non-negative number of tokens, found {self.tokens}")
        if self.direction not in (FORWARD, BACKWARD) or not self.counted_by or \
                not set(self.counted_by) <= {PAPER, EXECUTED}:
            raise ValueError(f"expected a direction in ({FORWARD}, {BACKWARD}) and conventions among ({PAPER}, "
                             f"{EXECUTED}); found {self.direction!r}, {self.counted_by!r}")
        if self.model is not None and (self.direction != FORWARD or self.seq_len <= 0):
            raise ValueError("a frozen model's pass is a forward with its seq_len > 0; found "
                             f"{self.direction!r} at seq_len {self.seq_len}")


class PricedWork(Protocol):
    """Work a component prices by its own formula, from the trained model's per-token FLOPs (an
    ``eslm.flops.FlopsModel``), beside the algorithm it prices (GREATS' gradient scoring:
    ``eslm.baselines.greats.GradientScoring``); both conventions count it. ``passes`` names the passes that its
    price includes (not priced again: what a count of the passes a method runs is checked against)."""

    def flops(self, fm) -> float: ...

    def passes(self) -> tuple[Pass, ...]: ...


@dataclass(frozen=True)
class ExtraWork:
    """The work one component (or the step) adds to one micro-batch on one rank beyond the trained model's forward
    and backward of its tokens: the ``passes`` it runs, and work it prices itself (``priced``: GREATS' gradient
    scoring, counted by both conventions)."""

    passes: tuple[Pass, ...] = ()
    priced: tuple[PricedWork, ...] = ()


NO_EXTRA_WORK = ExtraWork()


class Stateful(Protocol):
    """What every component has: the state a checkpoint keeps (a resumed run continues it bit for bit). The same
    shape as torch's ``torch.distributed.checkpoint.stateful.Stateful`` (every component is one: tested), declared
    here because importing torch's loads all of torch.distributed.checkpoint at every start."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


@runtime_checkable
class RowSelector(Stateful, Protocol):
    """Which sequences of a micro-batch train (default ``AllRows``: every row; GREATS: a greedy subset)."""

    syncs_host: bool  # select reads the device on the host (GREATS' greedy loop), so the step waits there; False:
    # it queues work only (tests/test_gpu.py runs every registered method's step and checks this both ways)

    def select(self, model, batch: Batch, step: int, lr: float) -> tuple[Batch, dict]:
        """(the rows that train, info for the logs). ``step`` is 1-based, ``lr`` the step's learning rate."""

    def candidate_rows(self, batch_rows: int) -> int:
        """Rows scored per loader micro-batch of ``batch_rows`` rows (counted as tokens seen). The trainer's
        loader always yields ``batch_rows`` rows; a selector that wants a larger pool (GREATS' ``pool`` mode)
        draws the extra candidates itself, from a loader it owns and checkpoints in its ``state_dict``, so the
        step and the trainer stay method-agnostic and resume stays exact."""

    def num_rows(self, batch_rows: int) -> int:
        """Rows that train per loader micro-batch (known before the forward, for global normalisation); at most
        ``candidate_rows(batch_rows)``."""

    def candidate_batches(self, accum_steps: int) -> int:
        """Loader micro-batches the trainer reads per optimizer step that trains ``accum_steps`` of them (default
        ``accum_steps``; instance-level selection reads more and ``select_step`` keeps ``accum_steps``' worth)."""

    def select_step(self, model, batches: list[Batch], world_size: int = 1) -> list[Batch]:
        """The micro-batches that train, from the step's ``candidate_batches`` micro-batches on this rank, before
        any of them runs (default: them all, unchanged). ``model`` is the unwrapped trained model; under DDP a
        selector may exchange with the other ranks (``world_size``), which run the same call."""

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        """Work of the last micro-batch's selection beyond the trained model's pass over the kept rows."""


@runtime_checkable
class TokenSelector(Stateful, Protocol):
    """Which tokens of a micro-batch count in the loss (default: all; ESLM: the top 1-alpha by risk). The selector
    owns its rule: the step hands it the scoring pass's statistics and never reads its settings beyond these."""

    score: str | None  # the name of the per-token score it ranks by (None: it ranks none): "loss", "excess_loss", ...
    needs: tuple[str, ...]  # the statistics of the scoring pass its hooks read ("loss", "entropy", "lse": the fields
    # of ``TokenStats``); the step has the objective fill exactly these, and runs no scoring pass when it is empty
    alpha: float  # fraction of tokens dropped, validated once at construction (a controller may change it)
    scope: str  # "micro": a top K per micro-batch | "step": one threshold per optimizer step (an extra forward)

    def num_kept(self, n_tokens: int) -> int:
        """K for a micro-batch of n_tokens (known before the forward pass, for global normalisation)."""

    def rank(self, stats: TokenStats | None, batch: Batch) -> torch.Tensor | None:
        """The scores (B, T) fp32 the selection ranks, from the scoring pass's statistics (None: ranks nothing)."""

    def step_threshold(self, ranked: list[torch.Tensor], world_size: int = 1) -> StepThreshold | None:
        """Scope "step": one threshold over ``rank`` of every micro-batch of the step, on all ranks."""

    def select(self, stats: TokenStats | None, batch: Batch,
               threshold: torch.Tensor | None = None) -> Selection:
        """The kept tokens; ``threshold`` (scope "step", ``step_threshold``) replaces the micro-batch's top K."""

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        """Work of selecting one micro-batch beyond the objective's scoring pass (a reference forward, the scope
        "step"'s extra scoring forward)."""


@runtime_checkable
class Objective(Stateful, Protocol):
    """The per-token loss: a scoring pass over all N tokens and the summed loss of the kept ones."""

    def score(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, need_scores: bool,
              need_entropy: bool, num_kept: int, for_loss: bool = True) -> TokenStats | None:
        """Detached fp32 per-token statistics of all N tokens (hidden (N, C) detached), or None when nothing
        is needed. ``num_kept``: K, the rows the following ``loss_sum`` will keep (a count known before the
        forward), so the head backend can prepare the cheapest way; ``for_loss`` False: only the scores are
        wanted (the step scope's pre-pass), nothing for a later ``loss_sum``."""

    def loss_sum(self, hidden: torch.Tensor, weight: torch.Tensor, batch: Batch, index: torch.Tensor | None,
                 stats: TokenStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the kept tokens' losses, 0-dim with gradient; their per-token losses (K,) detached)."""

    def head_work(self, n: int, k: int, *, scored: bool) -> HeadWork:
        """What the head ran for n tokens with k kept (``eslm.ops.token_stats.HeadWork``: rows of head matmuls
        forward, backward and again), as the head backend declares it."""

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        """Work beyond the trained model per micro-batch (e.g. a teacher forward)."""

    def on_step_end(self, step: int) -> None:
        """After optimizer step ``step`` (1-based) (SALT's switch from KD to CE)."""


@runtime_checkable
class Controller(Stateful, Protocol):
    """Adapts a component during training (Ada-ESLM's alpha) from what the selections show."""

    def observe(self, selection: Selection) -> None:
        """One micro-batch's selection (tensors: no host sync here)."""

    def on_step_end(self, step: int) -> None:
        """After optimizer step ``step`` (1-based)."""
