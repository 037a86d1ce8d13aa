"""AdamW as in nanoGPT / the paper, and the warmup + cosine learning-rate schedule (per run under a FLOPs budget,
``plan_schedule``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eslm import metrics as M
from eslm.flops import micro_batch_flops
from eslm.train.step import step_work


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    device_type: str) -> torch.optim.AdamW:
    """AdamW with weight decay on tensors with 2+ dimensions only (matmul weights, embeddings); biases and
    LayerNorm weights are not decayed. Tied parameters are counted once (named_parameters dedupes)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **({"fused": True} if device_type == "cuda" else {}))


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` can skip itself on the device: torch's fused AdamW reads a ``found_inf``
    flag tensor in its kernel (it is how torch's GradScaler skips a step without a host sync), and leaves
    weights, moments and step count as they were when the flag is 1. Not with DTensor parameters (FSDP2),
    whose flag would have to be a DTensor too."""
    return bool(optimizer.defaults.get("fused")) and getattr(optimizer, "_step_supports_amp_scaling", False) and \
        not any(hasattr(p, "to_local") for g in optimizer.param_groups for p in g["params"])


def step_if_finite(optimizer: torch.optim.Optimizer, readout: torch.Tensor) -> list[float]:
    """The optimizer step unless ``readout[0]`` (the loss) or ``readout[1]`` (the gradient norm) is a NaN or
    inf; returns ``readout`` read to the host, the training step's one host sync.

    Where the optimizer ``skips_on_device`` (the fused AdamW built for CUDA), the decision is the device's: the
    flag is formed there and passed to the kernel, and the read comes after the update is queued, so the GPU
    never waits for the host between backward and update. Otherwise (the CPU's default AdamW, whose own step
    reads its step count on the host anyway) the values are read first and the step is taken on the host's
    word. A finite step runs the very same update either way (a flag of 0 skips nothing: same bits)."""
    if not skips_on_device(optimizer):
        values = readout.tolist()
        if math.isfinite(values[0]) and math.isfinite(values[1]):
            optimizer.step()
        return values
    found_inf = (~torch.isfinite(readout[:2]).all()).float()
    optimizer.found_inf, optimizer.grad_scale = found_inf, None  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]
    return readout.tolist()


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup over ``warmup_steps``, then cosine
    decay to ``min_lr`` at ``decay_steps``, then ``min_lr``. The paper sets decay_steps (200k / 600k) far past
    where it stops training, so its runs end early on the cosine."""
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if step >= decay_steps:
        return min_lr
    ratio = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


@dataclass(frozen=True)
class Schedule:
    """The learning-rate schedule of one run: ``warmup_steps`` and ``decay_steps`` for ``lr_at``, and ``ratio``,
    the factor applied to the configured ones (1.0 when ``train.lr_schedule`` is ``steps`` or there is no FLOPs
    budget)."""

    warmup_steps: int
    decay_steps: int
    ratio: float = 1.0
    branch_step: int = 0  # a branched run (eslm.train.branch): from this step the cosine continues to end_step
    end_step: int = 0

    def lr(self, step: int, *, lr: float, min_lr: float) -> float:
        b, end = self.branch_step, self.end_step
        if not b or step < b or end == self.decay_steps:  # up to the branch point: the trunk's schedule
            return lr_at(step, lr=lr, min_lr=min_lr, warmup_steps=self.warmup_steps, decay_steps=self.decay_steps)
        at_branch = (b - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        ratio = at_branch + (1.0 - at_branch) * (step - b) / max(1, end - b)
        if ratio >= 1.0:
            return min_lr
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def planned_micro_batch_flops(cfg, method, fm) -> float:
    """FLOPs of one micro-batch of ``method`` (as built, before its first step) on ``flops.budget_counter``: it
    keeps ``tokens.num_kept`` of ``rows.num_rows`` rows and counts the work every component declares before its
    first step (``plan_schedule``; ``eslm study --dry-run`` plans each run's steps with it)."""
    n = method.rows.num_rows(cfg.train.micro_batch_size_seqs) * cfg.data.seq_len
    planned = micro_batch_flops(fm, method, tokens_seen=n, tokens_kept=method.tokens.num_kept(n),
                                step_work=step_work(method, n))
    return {M.FLOPS_PAPER: planned.paper, M.FLOPS_EXECUTED: planned.executed,
            M.FLOPS_DENSE: planned.dense}[cfg.flops.budget_counter]


def budget_steps(cfg, spent: float, start_step: int = 0, start_flops: float = 0.0) -> int:
    """The step at which a run of ``cfg`` whose micro-batches each count ``spent`` FLOPs
    (``planned_micro_batch_flops``) reaches its budget ``train.max_flops`` (``eslm.train.stopping``), from
    ``start_step`` with ``start_flops`` counted (a branched run: its trunk's). Not capped by ``train.max_steps``."""
    t = cfg.train
    micro_batches = t.grad_accum_steps if cfg.flops.count_per == "global" else 1  # as equal_flops_budget
    return start_step + max(1, math.ceil((t.max_flops - start_flops) / (spent * micro_batches) - 1e-9))


def plan_schedule(cfg, method, fm, branch=None) -> Schedule:
    """The schedule of a run of ``cfg`` training ``method`` (as built, before any step or resume: Ada-ESLM at its
    starting alpha) on a model priced by ``fm`` (docs/study.md, "The learning-rate schedule under the budget"); a
    ``branch`` keeps the trunk's schedule up to its branch point. GREATS declares its scoring only after a
    selection: its plan counts the update pass alone and its schedule ends early."""
    t = cfg.train
    warmup, decay = t.warmup_steps, t.lr_decay_steps or t.max_steps
    if t.lr_schedule != "budget" or t.max_flops <= 0:
        return Schedule(warmup, decay, **({"branch_step": branch.step, "end_step": decay} if branch else {}))
    spent = planned_micro_batch_flops(cfg, method, fm)
    ratio = fm.train_per_token * t.micro_batch_size_seqs * cfg.data.seq_len / spent
    if branch is not None:  # the trunk's schedule to the branch point, then the cosine to this run's own end
        end = budget_steps(cfg, spent, branch.step, branch.totals.get(cfg.flops.budget_counter, 0.0))
        return Schedule(warmup, decay, ratio, branch_step=branch.step, end_step=end)
    # the smallest whole step counts covering the stretched lengths; 1e-9 keeps a ratio of 1.0 exact
    return Schedule(math.ceil(warmup * ratio - 1e-9), math.ceil(decay * ratio - 1e-9), ratio)
