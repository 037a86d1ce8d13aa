"""eslm study --dry-run's time estimate (eslm.study.estimate): from a head-matmul and softmax timing on this CPU."""

import importlib
import re
from pathlib import Path

est = importlib.import_module("eslm.study.estimate")  # the module (eslm.study.estimate is also a function)


def _demo(tmp_path, *over):
    from eslm.study import load_study, plan

    return plan(load_study("demo"), tmp_path / "runs", None, list(over))


def test_the_estimate_follows_the_timed_rates(tmp_path, monkeypatch):
    """A CPU whose head matmuls are 4x slower gets a longer estimate, in proportion to the share of its work
    that is matmuls; the estimate says which rates it used; the rates are timed once, at the run's threads."""
    configs = _demo(tmp_path)
    flop, elem = est.rates(1, False)  # the demo's runs use one thread
    assert 0 < flop < 1e-8 and 0 < elem < 1e-6 and est.rates(1, False) == (flop, elem)
    here = est.estimate(configs, jobs=2)
    assert here["rates"] == (flop, elem) and f"{1e-9 / flop:.0f} GFLOP/s head matmuls" in est.describe(here)
    monkeypatch.setattr(est, "rates", lambda threads, bf16: (4 * flop, elem))
    slow = est.estimate(configs, jobs=2)
    assert 2.5 * here["cpu_s"] < slow["cpu_s"] < 4 * here["cpu_s"]
    assert slow["cores"] == 2 and slow["wall_s"] < slow["cpu_s"]


def test_the_estimate_scales_with_the_run_and_skips_the_gpu(tmp_path, monkeypatch):
    from eslm.study.estimate import PREP_STDLIB_S, REPORT_S, RUN_OVERHEAD_S, STUDY_OVERHEAD_S, estimate

    configs = _demo(tmp_path)
    short, long = estimate(configs, jobs=2), estimate(_demo(tmp_path, "train.max_steps=90"), jobs=2)
    # what does not grow with the steps: each run's start, the study's own work, the corpus preparation if due
    fixed = len(configs) * RUN_OVERHEAD_S + STUDY_OVERHEAD_S + REPORT_S + (PREP_STDLIB_S if short["prep"] else 0.0)
    # the same two lengths evaluated once each (the interval beyond the run): only training grows
    once = [estimate(_demo(tmp_path, f"train.max_steps={n}", "eval.interval=1000"), jobs=2)["cpu_s"] for n in (45, 90)]
    grow, grow_once = long["cpu_s"] - short["cpu_s"], once[1] - once[0]  # 45 more steps, with / without evals
    one_eval = once[0] - fixed - grow_once  # what a run evaluated once costs beyond its 45 steps' training
    assert grow_once > 0 and one_eval > 0
    # evaluation every 15 steps: 45 // 15 + 1 = 4 evaluations, 90 // 15 + 1 = 7; so 3 more, and 4 in the short run
    assert abs(grow - (grow_once + 3 * one_eval)) < 1e-9 * long["cpu_s"]
    assert abs(short["cpu_s"] - (fixed + grow_once + 4 * one_eval)) < 1e-9 * long["cpu_s"]
    assert estimate(_demo(tmp_path), jobs=1)["wall_s"] > short["wall_s"]
    assert estimate(_demo(tmp_path, "train.device=cuda"), jobs=2) is None


def test_dry_run_prints_the_estimate(tmp_path, capsys, monkeypatch):
    from eslm.study import run_study

    monkeypatch.chdir(tmp_path)
    assert run_study("demo", tmp_path / "runs", dry_run=True) == 0
    lines = capsys.readouterr().out.splitlines()
    est = [line for line in lines if line.startswith("estimate: about ")]
    assert len(est) == 1 and "CPU-minutes" in est[0] and "idle cores" in est[0]
    assert "corpus preparation included" in est[0]  # nothing prepared in this directory
    runs = [line for line in lines if line.startswith("  ")]  # each run with its steps beside its budget
    assert len(runs) == 6 and all(re.search(r"seed=\d, \d+ steps, budget [0-9.e+]+ flops_paper$", r) for r in runs)
    assert not Path(tmp_path / "runs").exists()


def test_the_dry_run_steps_are_the_steps_the_runs_take(tiny_data, tmp_path):
    """Each run's planned step count (eslm.study.estimate.run_steps, what --dry-run prints) is the step at which
    the trained run stops on its FLOPs budget: counters, scopes and a branched run from its trunk's checkpoint."""
    from conftest import tiny_overrides
    from eslm.config import build_config
    from eslm.study.estimate import steps_by_run
    from eslm.study.grid import Stage, _with_budget
    from eslm.train.trainer import train

    def cfg(name, counter="flops_paper", **extra):
        c = build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{
            "run.name": name, "method.name": name.split("_")[0], "train.max_steps": 6, "checkpoint.interval": 0,
            "train.lr_decay_steps": 6, "train.lr_schedule": "budget", **extra}))
        return _with_budget(c, {"steps_of": "clm", "counter": counter})

    runs = [cfg("clm"), cfg("eslm-entropy", **{"method.alpha": 0.5}),
            cfg("random", "flops_executed", **{"method.alpha": 0.3}),
            cfg("eslm-loss", "flops_executed", **{"method.alpha": 0.5, "method.scope": "step"})]
    trunk = build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{
        "run.name": "trunk", "method.name": "clm", "train.max_steps": 3, "checkpoint.interval": 3,
        "train.lr_decay_steps": 6, "train.lr_schedule": "steps"}))
    train(trunk)
    arm = cfg("eslm-entropy_arm", **{"method.alpha": 0.5,
                                     "train.branch_from": str(tmp_path / "trunk" / "checkpoints" / "step_0000003.pt")})
    planned = steps_by_run([Stage("trunks", (trunk,)), Stage("runs", (*runs, arm))])
    assert planned[trunk] == (3, "exact")
    steps = {c.run.name: planned[c][0] for c in (*runs, arm)}
    assert steps["clm"] == 6 and steps["eslm-entropy"] > 6 and len(set(steps.values())) > 2, steps
    for c in (*runs, arm):
        res = train(c)
        assert res.stopped_by == "max_flops" and res.step == steps[c.run.name], (c.run.name, res.step, steps)


def test_the_estimate_says_it_is_low_for_work_it_cannot_price(tmp_path):
    """GREATS' held-out gradients and a teacher's or reference's forwards are not in the model: the estimate of a
    study with such runs says "at least" and names them, and one without them does not."""
    from eslm.study import load_study, plan
    from eslm.study.estimate import describe, estimate

    greats = estimate(plan(load_study("greats-pilot-cpu"), tmp_path / "runs", None, []), jobs=2)
    assert greats["unpriced"] == {"greats": 3}
    line = describe(greats)
    assert line.startswith("estimate: at least about ") and "greats (3 runs)" in line and "not priced" in line
    demo = describe(estimate(_demo(tmp_path), jobs=2))
    assert demo.startswith("estimate: about ") and "not priced" not in demo
