"""The learning-rate schedule under a FLOPs budget: each run's warmup and cosine end at its own step count
(``train.lr_schedule: budget``), or at the configured steps for every method (``steps``, the paper's schedule)."""

from __future__ import annotations

import pytest
import torch

from conftest import read_metrics, tiny_overrides
from eslm import metrics as M
from eslm.config import build_config, method_context, training_flops_model
from eslm.methods import build_method
from eslm.study.grid import _with_budget
from eslm.train.optim import lr_at, plan_schedule
from eslm.train.trainer import Trainer, train

MIN_LR = 3e-4


def budget_cfg(data, out, method, name, **extra):
    """A run of a study with budget {steps_of: clm}: 8 dense steps' paper-FLOPs, max_steps raised to bind."""
    cfg = build_config(overrides=tiny_overrides(data, out, **{
        "method.name": method, "method.alpha": 0.2, "run.name": name, "train.max_steps": 8,
        "train.warmup_steps": 2, "train.min_lr": MIN_LR, "eval.interval": 0, "checkpoint.interval": 0, **extra}))
    return _with_budget(cfg, {"steps_of": "clm", "counter": "flops_paper"})


def lrs(run_dir) -> list[float]:
    return [r[M.LR] for r in read_metrics(run_dir, "train")]


def test_plan_stretches_by_the_paper_flops_ratio(tiny_data, tmp_path):
    # ESLM keeps K = N - floor(0.2 N) of N tokens: a paper-FLOPs step costs (N + 2K) / 3N of a dense one
    cfg = budget_cfg(tiny_data, tmp_path, "eslm-entropy", "e")
    method = build_method(method_context(cfg, device=torch.device("cpu"), n_domains=2))
    n = 4 * 32
    k = n - int(0.2 * n)
    s = plan_schedule(cfg, method, training_flops_model(cfg))
    assert s.ratio == pytest.approx(3 * n / (n + 2 * k), rel=1e-12)
    assert (s.warmup_steps, s.decay_steps) == (3, 10)  # ceil(2 x 1.1531), ceil(8 x 1.1531)
    clm = budget_cfg(tiny_data, tmp_path, "clm", "c")
    c = plan_schedule(clm, build_method(method_context(clm, device=torch.device("cpu"), n_domains=2)),
                      training_flops_model(clm))
    assert (c.warmup_steps, c.decay_steps, c.ratio) == (2, 8, 1.0)
    # the paper's schedule (steps), and no FLOPs budget: the configured steps whatever the method
    for other in (budget_cfg(tiny_data, tmp_path, "eslm-entropy", "e", **{"train.lr_schedule": "steps"}),
                  build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{"method.name": "eslm-entropy",
                                                                                  "train.max_steps": 8}))):
        s = plan_schedule(other, build_method(method_context(other, device=torch.device("cpu"), n_domains=2)),
                          training_flops_model(other))
        assert (s.warmup_steps, s.decay_steps, s.ratio) == (2, 8, 1.0)


@pytest.mark.parametrize("method", ["clm", "eslm-entropy", "random"])
def test_each_run_decays_to_its_own_last_step(method, tiny_data, tmp_path):
    cfg = budget_cfg(tiny_data, tmp_path, method, method)
    res = train(cfg)
    assert res.stopped_by == "max_flops"
    lr = lrs(res.run_dir)
    assert len(lr) == Trainer(cfg).schedule.decay_steps == (8 if method == "clm" else 10)
    # the cosine reaches min_lr only after the run's last step: the last step is still above it, and the
    # learning rate falls at every step after the warmup
    assert lr[-1] > MIN_LR and all(a > b for a, b in zip(lr[3:], lr[4:]))
    assert lr[-1] == pytest.approx(lr_at(len(lr) - 1, lr=3e-3, min_lr=MIN_LR, warmup_steps=3 if method != "clm"
                                         else 2, decay_steps=len(lr)))


def test_the_old_rule_runs_the_extra_steps_at_min_lr(tiny_data, tmp_path):
    res = train(budget_cfg(tiny_data, tmp_path, "eslm-entropy", "old", **{"train.lr_schedule": "steps"}))
    lr = lrs(res.run_dir)
    assert len(lr) == 10 and lr[8:] == [MIN_LR, MIN_LR]


def test_ada_plans_from_its_starting_alpha_also_when_resumed(tiny_data, tmp_path):
    # Ada's alpha moves at step 4 (interval 2); a run stopped at step 5 and resumed keeps the schedule planned
    # from the starting alpha, so its learning rates are those of the uninterrupted run
    fast = {"method.ada.gamma": 100.0}  # a large gain: alpha moves by several kept tokens at step 4
    whole = train(budget_cfg(tiny_data, tmp_path / "a", "ada-eslm-entropy", "ada", **fast))
    eslm = Trainer(budget_cfg(tiny_data, tmp_path / "b", "eslm-entropy", "e")).schedule
    cut = budget_cfg(tiny_data, tmp_path / "c", "ada-eslm-entropy", "ada", **fast)
    train(build_config(overrides=["train.max_steps=5"], base=cut))
    resumed = build_config(overrides=["run.resume=true"], base=cut)
    first = Trainer(resumed)
    res = first.train()
    moved = torch.load(res.run_dir / "checkpoints" / "step_0000005.pt", weights_only=False)["method"]["tokens"]
    assert abs(moved["alpha"] - 0.2) > 0.02, moved  # the controller did move alpha before the cut
    assert first.schedule == eslm  # after the resume too
    assert lrs(res.run_dir) == lrs(whole.run_dir)
