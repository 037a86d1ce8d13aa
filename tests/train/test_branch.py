"""Branched runs (``train.branch_from``, eslm.train.branch): a run that continues another run's checkpoint
takes its weights, optimizer state and data position, not its method state, and continues its schedule."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_overrides
from eslm.config import build_config, equal_flops_budget
from eslm.errors import ConfigError
from eslm.train.optim import Schedule, lr_at
from eslm.train.trainer import Trainer, train

DENSE_STEPS, BRANCH = 8, 4


def _cfg(tiny_data, tmp_path, **extra):
    over = {"run.seed": 5, "train.lr_decay_steps": DENSE_STEPS, "checkpoint.interval": 0, **extra}
    return build_config(overrides=tiny_overrides(tiny_data, tmp_path, **over))


def _budget(tiny_data, tmp_path) -> dict:
    """An equal-FLOPs run's keys: the dense FLOPs of DENSE_STEPS steps, the schedule stretched to each run."""
    flops, cap = equal_flops_budget(_cfg(tiny_data, tmp_path, **{"train.max_steps": DENSE_STEPS}))
    return {"train.max_flops": flops, "train.max_steps": cap, "train.lr_schedule": "budget"}


@pytest.fixture
def trunk(tiny_data, tmp_path):
    """A CLM trunk trained to step BRANCH on the dense run's schedule: its checkpoint there."""
    train(_cfg(tiny_data, tmp_path, **{"run.name": "trunk", "method.name": "clm", "train.max_steps": BRANCH,
                                       "train.lr_schedule": "steps"}))
    return tmp_path / "trunk" / "checkpoints" / f"step_{BRANCH:07d}.pt"


def _records(run_dir, after: int) -> list:
    keys = ("kind", "step", "train_loss", "grad_norm", "lr", "val_loss", "tokens_seen", "flops_paper")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [tuple(r.get(k) for k in keys) for r in lines if r["step"] > after]


def test_arms_start_from_the_trunks_weights_optimizer_state_and_data_position(tiny_data, tmp_path, trunk):
    state = torch.load(trunk, map_location="cpu", weights_only=False)
    for method, extra in (("clm", {}), ("random", {"method.alpha": 0.3}), ("eslm-loss", {})):
        tr = Trainer(_cfg(tiny_data, tmp_path, **{"run.name": method, "method.name": method,
                                                  "train.branch_from": str(trunk), **extra}))
        fresh_method = tr.method.state_dict()
        tr._maybe_branch()
        assert tr.step == BRANCH, method
        model = tr.raw_model.state_dict()
        assert all(torch.equal(model[k], state["model"][k]) for k in state["model"]), method
        opt, theirs = tr.optimizer.state_dict(), state["optimizer"]
        assert opt["param_groups"] == theirs["param_groups"], method
        assert opt["state"].keys() == theirs["state"].keys() and all(
            torch.equal(v, theirs["state"][i][k]) for i, st in opt["state"].items() for k, v in st.items()), method
        assert tr.loader.state_dict() == state["loader"], method
        assert tr.flops.totals() == {k: state[k] for k in tr.flops.totals()}, method
        # the method's own state (the random control's generator) is the arm's own, not the trunk's
        assert json.dumps(tr.method.state_dict(), default=str) == json.dumps(fresh_method, default=str), method


def test_a_clm_arm_continues_exactly_as_the_run_that_never_branched(tiny_data, tmp_path, trunk):
    budget = _budget(tiny_data, tmp_path)
    whole = train(_cfg(tiny_data, tmp_path, **{"run.name": "whole", "method.name": "clm", **budget}))
    arm = train(_cfg(tiny_data, tmp_path, **{"run.name": "arm", "method.name": "clm",
                                              "train.branch_from": str(trunk), **budget}))
    assert (arm.step, arm.val_loss) == (whole.step, whole.val_loss) == (DENSE_STEPS, whole.val_loss)
    assert _records(tmp_path / "arm", BRANCH) == _records(tmp_path / "whole", BRANCH)
    # the arm's first record is the trunk's evaluation at the branch point; its totals count the trunk's part
    first = json.loads((tmp_path / "arm" / "metrics.jsonl").read_text().splitlines()[0])
    assert (first["kind"], first["step"]) == ("eval", BRANCH)
    result = json.loads((tmp_path / "arm" / "result.json").read_text())
    assert result["branch"]["step"] == BRANCH and 0 < result["branch"]["flops_paper"] < result["flops_paper"]


def test_a_selective_arm_spends_the_rest_of_the_budget_on_its_own_schedule(tiny_data, tmp_path, trunk):
    budget = _budget(tiny_data, tmp_path)
    tr = Trainer(_cfg(tiny_data, tmp_path, **{"run.name": "r", "method.name": "random", "method.alpha": 0.5,
                                              "train.branch_from": str(trunk), **budget}))
    s = tr.schedule
    assert (s.branch_step, s.decay_steps) == (BRANCH, DENSE_STEPS) and s.end_step > DENSE_STEPS
    res = tr.train()
    assert res.stopped_by == "max_flops" and res.step == s.end_step  # its last step is where its cosine ends


def test_the_branched_schedule_continues_the_cosine_to_the_runs_own_end():
    kw = {"lr": 1.0, "min_lr": 0.1}
    plain = {"warmup_steps": 2, "decay_steps": 10}
    s = Schedule(2, 10, branch_step=4, end_step=16)
    assert [s.lr(i, **kw) for i in range(5)] == [lr_at(i, **kw, **plain) for i in range(5)]
    after = [s.lr(i, **kw) for i in range(4, 17)]
    assert all(a > b for a, b in zip(after, after[1:])) and after[-1] == 0.1 and after[-2] > 0.1
    same_end = Schedule(2, 10, branch_step=4, end_step=10)  # a run of the trunk's own cost: the trunk's schedule
    assert [same_end.lr(i, **kw) for i in range(12)] == [lr_at(i, **kw, **plain) for i in range(12)]


def test_a_checkpoint_of_another_seed_or_none_is_refused(tiny_data, tmp_path, trunk):
    with pytest.raises(ConfigError, match=r"differs from this one in run.seed"):
        Trainer(_cfg(tiny_data, tmp_path, **{"run.name": "x", "run.seed": 6, "train.branch_from": str(trunk)}))
    with pytest.raises(ConfigError, match=r"expected the checkpoint file .* found no such file; train that run"):
        Trainer(_cfg(tiny_data, tmp_path, **{"run.name": "x", "train.branch_from": str(tmp_path / "nope.pt")}))
