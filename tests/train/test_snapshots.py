"""Model-only safetensors snapshots: written at every evaluation (or every N steps), own retention, loadable
everywhere a checkpoint is (load_model, eval --all-checkpoints, export-hf, init_from), and harmless to training."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_overrides
from eslm.config import build_config
from eslm.errors import CheckpointError, ConfigError
from eslm.model.loading import list_evaluable, list_snapshots, load_model, read_weights
from eslm.train.trainer import train


def _run(tiny_data, out, **extra):
    return train(build_config([], tiny_overrides(tiny_data, out, **extra))).run_dir


@pytest.fixture(scope="module")
def run_dir(tiny_data, tmp_path_factory):
    return _run(tiny_data, tmp_path_factory.mktemp("snap"))


def _steps(files):
    return [int(f.name[5:12]) for f in files]


def test_a_snapshot_at_every_evaluation_all_kept(run_dir):
    snaps = list_snapshots(run_dir)
    assert _steps(snaps) == [3, 6]  # eval.interval=3, max_steps=6; checkpoints keep_last=2 is not applied
    state, meta = read_weights(snaps[-1])
    assert meta["format"] == "eslm-snapshot-v1" and meta["step"] == 6 and meta["tokenizer"] == "byte"
    assert meta["flops_paper"] > 0 and "lm_head.weight" not in state  # tied to the embedding, stored once
    assert all(t.dtype == torch.float32 for t in state.values())  # the parameters' dtype
    ckpt = run_dir / "checkpoints" / "step_0000006.pt"
    assert snaps[-1].stat().st_mode & 0o777 == ckpt.stat().st_mode & 0o777  # not safetensors' 0600


def test_snapshot_equals_the_checkpoint_of_the_same_step(run_dir):
    snap, info = load_model(run_dir / "snapshots" / "step_0000006.safetensors")
    full, _ = load_model(run_dir / "checkpoints" / "step_0000006.pt")
    for (n, a), (_, b) in zip(snap.state_dict().items(), full.state_dict().items()):
        assert torch.equal(a, b), n
    assert info["step"] == 6 and info["run_dir"] == str(run_dir.resolve()) and info["tokenizer"] == "byte"


def test_eval_all_checkpoints_takes_snapshots_first(run_dir):
    files = list_evaluable(run_dir)
    assert _steps(files) == [3, 6] and all(f.suffix == ".safetensors" for f in files)


def test_interval_keep_and_off(tiny_data, tmp_path):
    every2 = _run(tiny_data, tmp_path / "a", **{"checkpoint.snapshot_interval": 2, "checkpoint.snapshot_keep": 2})
    assert _steps(list_snapshots(every2)) == [4, 6]
    off = _run(tiny_data, tmp_path / "b", **{"checkpoint.snapshot_interval": -1})
    assert list_snapshots(off) == []
    with pytest.raises(ConfigError, match="snapshot_interval"):
        build_config([], ["checkpoint.snapshot_interval=-2"])


def test_snapshots_do_not_change_training(tiny_data, tmp_path, run_dir):
    off = _run(tiny_data, tmp_path / "off", **{"checkpoint.snapshot_interval": -1})
    def numbers(d):  # every metric but the clocks
        return [{k: v for k, v in json.loads(x).items() if not k.endswith(("_s", "_per_s", "mfu")) and "time" not in k
                 and "cpu" not in k and "load" not in k} for x in (d / "metrics.jsonl").read_text().splitlines()]

    on = numbers(run_dir)
    assert on == numbers(off) and len(on) > 6 and all("train_loss" in r or "val_loss" in r for r in on)


def test_export_hf_and_init_from_read_snapshots(run_dir, tiny_data, tmp_path):
    pytest.importorskip("transformers")
    from eslm.model.export_hf import export

    snap = run_dir / "snapshots" / "step_0000003.safetensors"
    meta = export(snap, tmp_path / "hf", with_tokenizer=False)
    assert meta["step"] == 3 and (tmp_path / "hf" / "config.json").is_file()
    cfg = build_config([], tiny_overrides(tiny_data, tmp_path / "init", **{"model.init_from": str(snap),
                                                                            "train.max_steps": 1}))
    from eslm.train.trainer import Trainer

    t = Trainer(cfg)
    src, _ = load_model(snap)
    for (n, a), (_, b) in zip(t.raw_model.state_dict().items(), src.state_dict().items()):
        assert torch.equal(a, b), n


def test_a_broken_snapshot_is_one_clear_error(tmp_path):
    bad = tmp_path / "step_0000001.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="expected an eslm snapshot"):
        load_model(bad)
