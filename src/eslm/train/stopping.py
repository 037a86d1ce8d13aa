"""When a run stops: ``train.max_steps``, the FLOPs budget ``train.max_flops``, SIGTERM (preemption), or a
non-finite update (``TrainingDiverged``, before the optimizer step is taken)."""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from eslm.errors import ESLMError
from eslm.model.loading import step_of
from eslm.train import checkpoint as ckpt


class TrainingDiverged(ESLMError):
    """A non-finite loss or gradient: the run stops before the optimizer step."""


class Budget:
    """The step limit and the FLOPs budget (counted by ``flops.budget_counter``), and how far a run is."""

    def __init__(self, max_steps: int, max_flops: float, counter: str):
        self.max_steps, self.max_flops, self.counter = max_steps, max_flops, counter

    def flops_reached(self, totals: dict) -> bool:
        return self.max_flops > 0 and totals[self.counter] >= self.max_flops

    def progress(self, step: int, totals: dict) -> tuple[float, str]:
        """(fraction of the run done, the step total to show). Under a FLOPs budget that will bind before
        max_steps, progress is measured against the budget and the total is the projected step count
        (``~N``); otherwise against max_steps."""
        by_steps = step / self.max_steps
        if self.max_flops > 0:
            by_flops = totals[self.counter] / self.max_flops
            if by_flops > by_steps:
                projected = math.ceil(step / by_flops) if by_flops > 0 else self.max_steps
                return min(by_flops, 1.0), f"~{min(projected, self.max_steps)} ({100 * by_flops:.0f}% of the FLOPs budget)"
        return by_steps, str(self.max_steps)


class Preemption:
    """SIGTERM asks for a checkpoint after the current step. Used as a context manager around the loop: the
    handler is installed (main thread only) and the previous one restored however the loop ends."""

    def __init__(self, dist, device: torch.device, log):
        self.dist, self.device, self.log = dist, device, log
        self.requested = False
        self._old: Callable[[int, FrameType | None], Any] | int | None = None

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)

    def _on_sigterm(self, signum, frame) -> None:
        self.requested = True
        self.log("SIGTERM: saving a checkpoint after this step and exiting")

    def any_rank(self) -> bool:
        """All ranks stop after the same step if any of them got SIGTERM (the checkpoint that follows is a
        collective under FSDP, and DDP's next all-reduce would wait on a rank that left)."""
        if not self.dist.enabled:
            return self.requested
        import torch.distributed as dist

        flag = torch.tensor([float(self.requested)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.requested = bool(flag.item())
        return self.requested


def check_update(loss: float, grad_norm: float, step: int, run_dir: Path) -> None:
    """Raises TrainingDiverged when the step's loss or gradient norm is not finite."""
    if not math.isfinite(loss) or not math.isfinite(grad_norm):
        raise TrainingDiverged(f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at step {step}; the "
                               "optimizer step was not taken. " + last_good_hint(run_dir))


def last_good_hint(run_dir: Path) -> str:
    """Where to go back to after a divergence: the newest checkpoint that matches its checksum and is finite."""
    path, skipped = ckpt.newest_good_checkpoint(run_dir)
    kept = ckpt.kept_steps(run_dir / "checkpoints")
    damaged = f" ({'; '.join(skipped)})" if skipped else ""
    if path is None:
        return (f"There is no {'intact ' if skipped else ''}checkpoint of this run{damaged}; start again with a "
                "lower train.lr or check the data.")
    latest = ckpt.latest_checkpoint(run_dir)
    how = ("resume with --resume (add run.allow_change=train.lr train.lr=LOWER to lower the learning rate) or from an "
           "earlier step with --resume-from STEP" if path == latest else
           f"resume from it with --resume-from {step_of(path)}")
    return (f"The last good checkpoint is {path}{damaged} (kept steps: {', '.join(map(str, kept))}); {how}, "
            "or check the data")
