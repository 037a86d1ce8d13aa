"""Training: every registered method trains on CPU, exact resume after SIGKILL, SIGTERM, divergence."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import needs_overrides, read_metrics, tiny_overrides
from eslm import metrics as M
from eslm.config import build_config
from eslm.methods import METHODS
from eslm.train.trainer import Trainer, TrainingDiverged, train

# the registry says which methods need a frozen model (a reference or teacher checkpoint named by a config key)
SELF_CONTAINED = [n for n, spec in METHODS.items() if not spec.frozen_models]
WITH_FROZEN_MODEL = [n for n, spec in METHODS.items() if spec.frozen_models]
TIME_KEYS = set(M.TIMING_KEYS)


@pytest.mark.parametrize("name", SELF_CONTAINED)
def test_every_method_trains(name, tiny_data, tmp_path):
    cfg = build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{"method.name": name, "train.max_steps": 4}))
    res = train(cfg)
    train_lines = read_metrics(res.run_dir, "train")
    eval_lines = read_metrics(res.run_dir, "eval")
    assert [r[M.STEP] for r in train_lines] == [1, 2, 3, 4]
    assert all(r[M.FLOPS_PAPER] > 0 and r[M.FLOPS_EXECUTED] > 0 for r in train_lines)
    assert eval_lines and all(M.val_loss_key(d) in eval_lines[-1] for d in ("code", "prose"))
    assert (res.run_dir / "config.yaml").is_file() and (res.run_dir / "env.json").is_file()
    assert res.val_loss is not None and res.val_loss < 6.0  # byte vocab: ln(257) = 5.55 at init


def test_selective_metrics_and_flops_ratio(tiny_data, tmp_path):
    res = train(build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{"method.name": "eslm-entropy",
                                                                             "train.max_steps": 2})))
    last = read_metrics(res.run_dir, "train")[-1]
    n = 4 * 32
    assert last[M.KEPT_FRAC] == pytest.approx((n - int(0.1 * n)) / n)
    assert last[M.ALPHA] == 0.1 and M.CVAR in last and M.kept_frac_key("code") in last
    assert last[M.FLOPS_PAPER] < last[M.FLOPS_DENSE]


def test_loss_decreases(tiny_data, tmp_path):
    res = train(build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{
        "method.name": "clm", "train.max_steps": 30, "eval.interval": 30, "checkpoint.interval": 0})))
    lines = read_metrics(res.run_dir, "train")
    assert lines[-1][M.TRAIN_LOSS] < lines[0][M.TRAIN_LOSS] - 0.5


def _cli(args, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "eslm.cli", "train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _comparable(lines):
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in lines]


@pytest.mark.slow
def test_exact_resume_after_sigkill(tiny_data, tmp_path):
    steps = 12
    common = dict(**{"method.name": "ada-eslm-entropy", "train.max_steps": steps, "checkpoint.interval": 2,
                     "eval.interval": 4})
    ref = _cli(tiny_overrides(tiny_data, tmp_path / "a", **common))
    assert ref.wait(timeout=240) == 0, ref.stdout.read()
    kill_at = int(torch.randint(3, steps - 2, ()).item())
    run = _cli(tiny_overrides(tiny_data, tmp_path / "b", **common))
    metrics = tmp_path / "b" / "t" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline:
        if metrics.is_file() and any(json.loads(l).get("step", 0) >= kill_at for l in metrics.read_text().splitlines()):
            break
        time.sleep(0.02)
    run.send_signal(signal.SIGKILL)
    run.wait()
    resumed = _cli(tiny_overrides(tiny_data, tmp_path / "b", **common) + ["--resume"])
    out = resumed.communicate(timeout=240)[0]
    assert resumed.returncode == 0, out
    assert "resumed from" in out
    a, b = read_metrics(tmp_path / "a" / "t"), read_metrics(tmp_path / "b" / "t")
    assert _comparable(a) == _comparable(b)  # bitwise: every metric of every step, train and eval
    assert len(a) >= steps


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tiny_data, tmp_path):
    run = _cli(tiny_overrides(tiny_data, tmp_path, **{"train.max_steps": 500, "checkpoint.interval": 0,
                                                     "eval.interval": 0}))
    metrics = tmp_path / "t" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and metrics.stat().st_size > 0):
        time.sleep(0.05)
    run.send_signal(signal.SIGTERM)
    out = run.communicate(timeout=120)[0]
    assert run.returncode == 0, out
    latest = (tmp_path / "t" / "checkpoints" / "latest").read_text().strip()
    step = int(latest[5:12])
    assert 0 < step < 500 and "preempted" in out


def test_non_finite_loss_stops_before_update_and_keeps_checkpoint(tiny_data, tmp_path):
    over = tiny_overrides(tiny_data, tmp_path, **{"train.max_steps": 3, "method.name": "clm"})
    train(build_config(overrides=over))
    ckpts = sorted(p.name for p in (tmp_path / "t" / "checkpoints").iterdir())
    trainer = Trainer(build_config(overrides=over + ["train.max_steps=6", "run.resume=true"]))
    with torch.no_grad():
        trainer.raw_model.transformer.h[0].mlp.c_fc.weight.fill_(float("nan"))
    trainer._maybe_resume = lambda: None  # keep the poisoned weights
    with pytest.raises(TrainingDiverged, match="step 1"):
        trainer.train()
    assert sorted(p.name for p in (tmp_path / "t" / "checkpoints").iterdir()) == ckpts


def test_existing_run_is_not_overwritten(tiny_data, tmp_path):
    from eslm.errors import ConfigError

    over = tiny_overrides(tiny_data, tmp_path, **{"train.max_steps": 1})
    train(build_config(overrides=over))
    before = (tmp_path / "t" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="already holds a run"):
        train(build_config(overrides=over))
    assert (tmp_path / "t" / "metrics.jsonl").read_text() == before


def test_checkpoint_of_another_model_is_rejected(tiny_data, tmp_path):
    from eslm.errors import CheckpointError, ConfigError

    over = tiny_overrides(tiny_data, tmp_path, **{"train.max_steps": 1})
    train(build_config(overrides=over))
    before = {p: p.read_bytes() for p in (tmp_path / "t").rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="model.preset: 'tiny' -> 'small'"):  # the config check comes first
        train(build_config(overrides=over + ["model.preset=small", "run.resume=true"]))
    with pytest.raises(CheckpointError, match="another model"):  # and the checkpoint's own model_config
        train(build_config(overrides=over + ["model.preset=small", "run.resume=true", "run.allow_change=model.preset"]))
    assert {p: p.read_bytes() for p in (tmp_path / "t").rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("name", WITH_FROZEN_MODEL)
def test_reference_and_teacher_methods_train_and_resume(name, tiny_data, tmp_path, frozen_run):
    extra = {"method.name": name, **needs_overrides(name, frozen_run), "method.salt.kd_steps": 2,
             "train.max_steps": 2}
    res = train(build_config(overrides=tiny_overrides(tiny_data, tmp_path, **extra)))
    first = read_metrics(res.run_dir, "train")
    assert first[-1][M.FLOPS_PAPER] > 0
    extra["train.max_steps"] = 4
    res = train(build_config(overrides=tiny_overrides(tiny_data, tmp_path, **extra) + ["run.resume=true"]))
    lines = read_metrics(res.run_dir, "train")
    assert [r[M.STEP] for r in lines] == [1, 2, 3, 4]
    # a reference / teacher forward is counted: paper FLOPs exceed the trained model's own dense cost
    if name != "salt":
        assert lines[-1][M.FLOPS_PAPER] > lines[-1][M.FLOPS_DENSE] * (0.9 if name == "rho1" else 1.0)


def test_missing_teacher_is_a_config_error():
    from eslm.errors import ConfigError

    with pytest.raises(ConfigError, match="method.kd.teacher"):
        build_config(overrides=["method.name=dense-kd"])


def test_cpu_seconds_are_logged_monotone_and_bounded_by_wall_clock(tiny_data, tmp_path):
    """cpu_s: process CPU seconds of training (eval excluded), cumulative, at most wall-clock x threads."""
    res = train(build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{
        "method.name": "eslm-loss", "train.max_steps": 6, "train.num_threads": 1})))
    lines = read_metrics(res.run_dir, "train")
    cpu = [r[M.CPU_S] for r in lines]
    assert all(b > a for a, b in zip(cpu, cpu[1:])) and cpu[0] > 0
    for r in lines:
        assert r[M.STEP_CPU_S] > 0
        assert r[M.CPU_S] <= r[M.ELAPSED_S] * torch.get_num_threads() + 0.05  # + clock granularity
    result = json.loads((res.run_dir / "result.json").read_text())
    assert result[M.CPU_S] == pytest.approx(cpu[-1])
    assert all(r[M.CPU_S] == pytest.approx(cpu[r[M.STEP] - 1]) for r in read_metrics(res.run_dir, "eval"))
    env = json.loads((res.run_dir / "env.json").read_text())
    assert len(env["load_avg_at_start"]) == 3 and env["load_avg_during_run"][0]["until_step"] == 6


def test_progress_line_follows_a_binding_flops_budget(tiny_data, tmp_path, capsys):
    cfg = build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{
        "method.name": "clm", "train.max_steps": 50, "train.max_flops": 2.0e9, "log.interval": 2}))
    res = train(cfg)
    out = capsys.readouterr().out
    assert res.stopped_by == "max_flops" and res.step < 50
    lines = [x for x in out.splitlines() if x.startswith("step ")]
    assert lines and all(f"/~{res.step} " in x or "of the FLOPs budget" in x for x in lines)
    assert "/50 " not in out


def test_the_banner_splits_the_parameters_into_blocks_and_tied_embedding(tiny_data, tmp_path):
    # with GPT-2's vocabulary the tied embedding is most of a small model: calling the total "non-embedding"
    # made a 0.79M-parameter trunk read as 7.2M
    cfg = build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{"train.max_steps": 1}))
    t = Trainer(cfg)
    model = t.raw_model
    emb = model.transformer.wte.weight.numel()
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("transformer.h.", "transformer.ln_f")))
    banner = t._banner()
    assert f"{model.num_params() / 1e6:.2f}M params: " in banner
    assert f"{blocks / 1e6:.2f}M in the blocks + {emb / 1e6:.2f}M tied embedding/head" in banner
    assert "non-embedding" not in banner


def test_evaluation_announces_itself_and_throughput_excludes_it(tiny_data, tmp_path, capsys, monkeypatch):
    """An evaluation says what it evaluates before it starts; the tok/s logged after it counts the training
    steps' own time only (a 2 s evaluation between two logged steps left the reading unchanged)."""
    import eslm.eval.val_loss as vl

    real = vl.evaluate

    def slow_evaluate(*a, **kw):
        time.sleep(2.0)
        return real(*a, **kw)

    monkeypatch.setattr(vl, "evaluate", slow_evaluate)
    cfg = build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{
        "method.name": "clm", "train.max_steps": 4, "eval.interval": 2, "log.interval": 1}))
    res = train(cfg)
    out = capsys.readouterr().out
    start = out.index("eval step 2: ")
    assert "batches over" in out[start:start + 80] and out.index("eval step 2: val_loss") > start
    recs = {r[M.STEP]: r for r in read_metrics(res.run_dir, "train")}
    # step 3 follows the 2 s evaluation: its reading is tokens over step 3's own time
    assert recs[3][M.TOKENS_PER_S] == pytest.approx(cfg.train.micro_batch_size_seqs * cfg.data.seq_len
                                                    * cfg.train.grad_accum_steps / recs[3][M.STEP_TIME_S], rel=1e-6)
