"""Branching: a run that continues another run's checkpoint (``train.branch_from``) with its own method, as every
arm of a branched study continues its seed's trunk (docs/study.md, "Branched studies")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eslm import metrics as M
from eslm.errors import ConfigError
from eslm.model.loading import CHECKPOINT_FILE
from eslm.train import checkpoint as ckpt

# what a branch must share with the run it continues: the same data and model, the same optimizer and the
# same schedule up to the branch point (the method, budget, run name and evaluation may differ)
SHARED_KEYS = ("data", "model", "run.seed", "train.micro_batch_size_seqs", "train.grad_accum_steps", "train.lr",
               "train.min_lr", "train.warmup_steps", "train.weight_decay", "train.beta1", "train.beta2",
               "train.grad_clip", "train.normalize", "train.dtype")
TOTAL_KEYS = (M.FLOPS_PAPER, M.FLOPS_EXECUTED, M.FLOPS_DENSE)


@dataclass(frozen=True)
class BranchPoint:
    """The checkpoint a branched run continues: its path, step and totals at that step."""

    path: Path
    step: int
    totals: dict  # FLOPs per counter, tokens_seen, elapsed_s, cpu_s at the branch point

    def summary(self) -> dict:
        return {"from": str(self.path), M.STEP: self.step, **self.totals}


def _get(d: dict, key: str):
    for part in key.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def read_branch_point(cfg, tokens_per_step: int) -> BranchPoint:
    """The checkpoint ``cfg.train.branch_from`` names, checked: an intact eslm checkpoint of a run that shares
    ``SHARED_KEYS`` with ``cfg``, at a step past the warmup. One-line errors."""
    path = Path(cfg.train.branch_from)
    where = f"train.branch_from {str(path)!r}"
    if not path.is_file() or CHECKPOINT_FILE.match(path.name) is None:
        raise ConfigError(f"{where}: expected the checkpoint file (checkpoints/step_NNNNNNN.pt) of the run this one "
                          "continues, found no such file; train that run first (a branched study trains its trunks "
                          "before its arms)")
    state = ckpt.load_checkpoint(path, map_location="cpu", mmap=True)
    theirs, ours = state.get("config") or {}, cfg.to_dict()
    differ = [k for k in SHARED_KEYS if _get(theirs, k) != _get(ours, k)]
    if differ:
        raise ConfigError(f"{where}: that run differs from this one in {', '.join(differ)}; a branch continues "
                          "the same data, model, seed and optimizer: make them equal or start without branch_from")
    step = int(state["step"])
    if step < cfg.train.warmup_steps:
        raise ConfigError(f"{where}: step {step} is inside the warmup ({cfg.train.warmup_steps} steps); branch at "
                          "or after the end of the warmup")
    totals = {k: float(state[k]) for k in TOTAL_KEYS if k in state}
    totals[M.TOKENS_SEEN] = step * tokens_per_step
    totals[M.ELAPSED_S], totals[M.CPU_S] = float(state[M.ELAPSED_S]), float(state[M.CPU_S])
    return BranchPoint(path, step, totals)
