"""train/stopping.py: the FLOPs budget and progress, SIGTERM as a context manager, the non-finite refusal."""

import os
import signal

import pytest
import torch

from eslm.train.distributed import DistInfo
from eslm.train.stopping import Budget, Preemption, TrainingDiverged, check_update, last_good_hint


def test_budget_progress_by_steps_without_a_flops_budget():
    b = Budget(max_steps=10, max_flops=0, counter="flops_paper")
    assert b.progress(3, {"flops_paper": 1e30}) == (0.3, "10")
    assert not b.flops_reached({"flops_paper": 1e30})


def test_budget_progress_follows_a_binding_flops_budget():
    b = Budget(max_steps=100, max_flops=1000.0, counter="flops_executed")
    totals = {"flops_executed": 250.0, "flops_paper": 0.0}  # 25% of the budget after 5 steps: ~20 steps
    assert b.progress(5, totals) == (0.25, "~20 (25% of the FLOPs budget)")
    assert not b.flops_reached(totals)
    assert b.flops_reached({"flops_executed": 1000.0})
    # a budget that binds later than max_steps: progress by steps
    assert Budget(10, 1e9, "flops_executed").progress(5, totals) == (0.5, "10")


def test_check_update_refuses_non_finite_values_with_the_way_back(tmp_path):
    check_update(2.5, 1.0, 3, tmp_path)
    for loss, norm in ((float("nan"), 1.0), (1.0, float("inf"))):
        with pytest.raises(TrainingDiverged, match="at step 3; the optimizer step was not taken. There is no "
                                                   "checkpoint of this run"):
            check_update(loss, norm, 3, tmp_path)


def test_last_good_hint_names_the_latest_checkpoint(tmp_path):
    from eslm.train import checkpoint as ckpt

    ckpt.save_checkpoint(tmp_path / "checkpoints", {"step": 4, "model": {"x": torch.zeros(1)}, "model_config": {}},
                         keep_last=2, milestones=())
    hint = last_good_hint(tmp_path)
    assert "step_0000004.pt" in hint and "kept steps: 4" in hint and "--resume" in hint


def test_preemption_catches_sigterm_and_restores_the_handler():
    seen = []
    before = signal.getsignal(signal.SIGTERM)
    with Preemption(DistInfo(), torch.device("cpu"), seen.append) as p:
        assert not p.any_rank()
        os.kill(os.getpid(), signal.SIGTERM)
        assert p.any_rank() and seen and "SIGTERM" in seen[0]
    assert signal.getsignal(signal.SIGTERM) == before
