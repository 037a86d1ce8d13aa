"""Reliability: resume is the same run or refused, finite checkpoints only, locks, stale temporaries, OS errors."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, tiny_overrides
from eslm import metrics as M
from eslm.cli import main as cli_main
from eslm.config import build_config
from eslm.errors import CheckpointError, ConfigError
from eslm.lock import DirLock
from eslm.train.resume import effective_config, read_resumes
from eslm.train.trainer import Trainer, TrainingDiverged, train

TIME_KEYS = set(M.TIMING_KEYS)  # machine measurements (cpu_s, load average, ...): differ between identical runs
# the run of the fixtures base_run and run_copy (tests/train/conftest.py)
BASE = {"method.name": "clm", "train.max_steps": 3, "checkpoint.interval": 1, "checkpoint.keep_last": 5,
        "eval.interval": 0}


def _over(tiny_data, out, **extra):
    return tiny_overrides(tiny_data, out, **{**BASE, **extra})


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(d.rglob("*")) if p.is_file()}


def _comparable(lines):
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in lines]


# ---------------------------------------------------------------- 1. resume is the same run or refused


@pytest.mark.parametrize("change", ["method.alpha=0.3", "train.lr=0.001", "method.name=eslm-entropy",
                                    "model.preset=small"])
def test_resume_with_changed_config_is_refused_before_writing(change, tiny_data, run_copy):
    before = _snapshot(run_copy)
    key = change.split("=")[0]
    with pytest.raises(ConfigError, match=rf"refused.*{key}: "):
        train(build_config(overrides=_over(tiny_data, run_copy.parent, **{"train.max_steps": 4})
                           + [change, "run.resume=true"]))
    assert _snapshot(run_copy) == before  # config.yaml, env.json, metrics, checkpoints: nothing written


def test_resume_records_allowed_changes_and_keeps_config_yaml(tiny_data, run_copy):
    yaml_before = (run_copy / "config.yaml").read_text()
    over = _over(tiny_data, run_copy.parent, **{"train.max_steps": 4, "eval.interval": 2, "train.lr": 0.002})
    res = train(build_config(overrides=over + ["run.resume=true", "run.allow_change=train.lr"]))
    assert res.step == 4
    assert (run_copy / "config.yaml").read_text() == yaml_before  # written once, at creation
    (rec,) = read_resumes(run_copy)
    assert rec["step"] == 3 and rec["time"].endswith("Z")
    assert rec["changed"] == {"train.max_steps": [3, 4], "eval.interval": [0, 2], "train.lr": [0.003, 0.002]}
    eff = effective_config(run_copy)
    assert (eff.train.max_steps, eff.train.lr, eff.eval.interval) == (4, 0.002, 2)


def test_resume_run_dir_alone_continues_with_its_config(run_copy, capsys):
    assert cli_main(["train", "--resume", str(run_copy), "train.max_steps=4"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step_0000003.pt" in out
    assert [r[M.STEP] for r in read_metrics(run_copy, "train")] == [1, 2, 3, 4]
    assert read_resumes(run_copy)[0]["changed"] == {"train.max_steps": [3, 4]}


def test_resume_of_missing_run_is_an_error(tiny_data, tmp_path, capsys):
    with pytest.raises(ConfigError, match="cannot resume"):
        train(build_config(overrides=_over(tiny_data, tmp_path) + ["run.resume=true"]))
    assert not (tmp_path / "t").exists()
    assert cli_main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eslm train: error: --resume") and "\n" not in err


# ---------------------------------------------------------------- 2. only finite weights are saved


def test_nan_weights_are_never_saved_and_the_last_good_checkpoint_is_named(tiny_data, tmp_path):
    trainer = Trainer(build_config(overrides=_over(tiny_data, tmp_path)))
    real_step = trainer.optimizer.step

    def poisoned_step(*a, **k):  # the update of step 2 turns one weight NaN (as lr=inf or an overflow would)
        real_step(*a, **k)
        if trainer.step == 1:
            with torch.no_grad():
                trainer.raw_model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")

    trainer.optimizer.step = poisoned_step
    with pytest.raises(TrainingDiverged, match=r"weights at step 2 are not finite.*step_0000001\.pt"):
        trainer.train()
    ckpts = tmp_path / "t" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_0000001.pt", "step_0000001.pt.sha256"]
    assert (ckpts / "latest").read_text() == "step_0000001.pt"
    assert not (tmp_path / "t" / "eslm.lock").exists()


def test_resume_from_an_earlier_step_replays_the_run_exactly(base_run, run_copy, capsys):
    assert cli_main(["train", "--resume", str(run_copy), "--resume-from", "1"]) == 0
    assert "step_0000002.pt, step_0000003.pt" in capsys.readouterr().out
    ckpts = run_copy / "checkpoints"
    assert sorted(p.name for p in (ckpts / "superseded").iterdir()) == [  # each with its checksum
        "step_0000002.pt", "step_0000002.pt.sha256", "step_0000003.pt", "step_0000003.pt.sha256"]
    assert (ckpts / "latest").read_text() == "step_0000003.pt" and (ckpts / "step_0000003.pt").is_file()
    assert _comparable(read_metrics(run_copy)) == _comparable(read_metrics(base_run))
    assert read_resumes(run_copy)[0]["resume_from"] == 1
    assert cli_main(["train", "--resume", str(run_copy), "--resume-from", "7"]) == 2
    assert "kept steps: 1, 2, 3" in capsys.readouterr().err


# ---------------------------------------------------------------- 3. locks


def test_second_process_on_a_run_directory_is_refused_naming_the_holder(tiny_data, run_copy, capsys):
    before = _snapshot(run_copy)
    with DirLock(run_copy, "run directory"):
        # the test holds the lock like another `eslm train` would (flock: a second open file conflicts)
        before = _snapshot(run_copy)
        code = cli_main(["train", *_over(tiny_data, run_copy.parent, **{"train.max_steps": 4}), "--resume"])
        assert _snapshot(run_copy) == before
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert f"is in use by PID {os.getpid()} on host" in err


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tiny_data, run_copy, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_copy / "eslm.lock").write_text(json.dumps({"pid": dead.pid, "host": "h", "started": "then"}) + "\n")
    res = train(build_config(overrides=_over(tiny_data, run_copy.parent, **{"train.max_steps": 4})
                             + ["run.resume=true"]))
    assert res.step == 4
    assert f"taking over the stale lock {run_copy / 'eslm.lock'} of PID {dead.pid}" in capsys.readouterr().out
    assert not (run_copy / "eslm.lock").exists()


def test_second_prepare_into_one_directory_is_refused(tmp_path, capsys):
    from eslm.data.prepare import WHAT
    from eslm.files import output_lock

    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    out = tmp_path / "prepared"
    with output_lock(out, WHAT).acquire():
        code = cli_main(["prepare", "text", str(tmp_path / "a.txt"), "--out", str(out), "--tokenizer", "byte",
                         "--no-progress", "--workers", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and f"prepare output directory {str(out)!r} is in use by PID" in err
    assert not out.exists()


# ---------------------------------------------------------------- 4. stale temporary checkpoint files


def test_stale_temporary_checkpoints_are_removed_at_start(tiny_data, run_copy, capsys):
    ckpts = run_copy / "checkpoints"
    (ckpts / ".step_0000004.pt.tmp.12345").write_bytes(b"x" * 1000)
    (ckpts / ".latest.tmp.12345").write_bytes(b"step")
    train(build_config(overrides=_over(tiny_data, run_copy.parent, **{"train.max_steps": 4}) + ["run.resume=true"]))
    assert "removed 2 temporary file(s) of interrupted writes" in capsys.readouterr().out
    assert not [p for p in ckpts.iterdir() if ".tmp." in p.name]


# ---------------------------------------------------------------- 5. OS errors: one line, nothing lost


def test_failed_save_keeps_the_previous_checkpoint_and_latest(tiny_data, run_copy, monkeypatch):
    import eslm.train.checkpoint as ckpt

    def disk_full(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", disk_full)
    ckpts = run_copy / "checkpoints"
    before = {p.name: p.read_bytes() for p in ckpts.iterdir()}
    with pytest.raises(CheckpointError) as e:
        train(build_config(overrides=_over(tiny_data, run_copy.parent, **{"train.max_steps": 4})
                           + ["run.resume=true"]))
    msg = str(e.value)
    assert "\n" not in msg and "step_0000004.pt" in msg and "No space left" in msg
    assert "previous checkpoint step_0000003.pt and `latest` are intact" in msg and "free disk space" in msg
    assert {p.name: p.read_bytes() for p in ckpts.iterdir()} == before  # no partial temporary file either


@pytest.fixture
def under_a_file(tmp_path) -> Path:
    """A path no one can create, not even root: its parent is a regular file."""
    (tmp_path / "file").write_text("x")
    return tmp_path / "file" / "out"


def _one_line_error(capsys, code, cmd, path):
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "\n" not in err and err.startswith(f"eslm {cmd}: error: ") and str(path.parent) in err
    assert "Traceback" not in err
    return err


def test_train_into_an_unwritable_directory(tiny_data, under_a_file, capsys):
    code = cli_main(["train", *_over(tiny_data, under_a_file)])
    assert "not a directory" in _one_line_error(capsys, code, "train", under_a_file)


def test_prepare_into_an_unwritable_directory(tmp_path, under_a_file, capsys):
    (tmp_path / "a.txt").write_text("hello\n")
    code = cli_main(["prepare", "text", str(tmp_path / "a.txt"), "--out", str(under_a_file / "d"),
                     "--tokenizer", "byte", "--no-progress"])
    _one_line_error(capsys, code, "prepare", under_a_file)


def test_export_hf_into_an_unwritable_directory(base_run, under_a_file, capsys):
    pytest.importorskip("transformers")
    code = cli_main(["export-hf", str(base_run), "--out", str(under_a_file)])
    _one_line_error(capsys, code, "export-hf", under_a_file)


def test_report_into_an_unwritable_directory(base_run, under_a_file, capsys):
    code = cli_main(["report", str(base_run), "--out", str(under_a_file)])
    _one_line_error(capsys, code, "report", under_a_file)


# ---------------------------------------------------------------- issue 14 items 6-9


def test_out_of_range_token_id_is_found_whatever_the_data_size(tiny_data, tmp_path, monkeypatch):
    import numpy as np

    import eslm.data.manifest as mf
    from eslm.data.loader import open_dataset
    from eslm.errors import DataError

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    monkeypatch.setattr(mf, "AUTO_HASH_MAX_BYTES", 0)  # as for data above the hash threshold: no SHA-256
    manifest = json.loads((data / "manifest.json").read_text())
    shard = next(data / f["path"] for f in manifest["files"] if f["num_tokens"] > 100)
    ids = np.memmap(shard, dtype=np.dtype(manifest["dtype"]).newbyteorder("<"), mode="r+")
    ids[77] = 60000  # the byte tokenizer has 257 ids
    ids.flush()
    del ids
    with pytest.raises(DataError, match=rf"expected token ids < 257 .* in shard {shard}; found id 60000 at token 77"):
        open_dataset(data)


def test_torn_last_metrics_line_is_cut_before_appending(tiny_data, run_copy):
    metrics = run_copy / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"kind": "train", "step": 4, "train_lo')  # a kill in the middle of writing step 4
    train(build_config(overrides=_over(tiny_data, run_copy.parent, **{"train.max_steps": 4}) + ["run.resume=true"]))
    lines = metrics.read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # no line glued to a torn one
    assert [r[M.STEP] for r in read_metrics(run_copy, "train")] == [1, 2, 3, 4]


def test_data_of_another_tokenizer_is_refused(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match="data.tokenizer='gpt2', but .* prepared with the 'byte' tokenizer"):
        Trainer(build_config(overrides=_over(tiny_data, tmp_path, **{"data.tokenizer": "gpt2"})))


def test_init_from_a_model_of_another_tokenizer_is_refused(tiny_data, base_run, tmp_path):
    state = torch.load(base_run / "checkpoints" / "step_0000003.pt", weights_only=True)
    state["tokenizer"] = "gpt2"
    torch.save(state, tmp_path / "gpt2.pt")
    with pytest.raises(ConfigError, match="trained with the 'gpt2' tokenizer, the data .* with 'byte'"):
        Trainer(build_config(overrides=_over(tiny_data, tmp_path, **{"model.init_from": tmp_path / "gpt2.pt"})))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_config_errors(value):
    with pytest.raises(ConfigError, match=rf"train.lr: expected a finite number, got {value}"):
        build_config(overrides=[f"train.lr={value}"])


def test_init_from_our_own_hf_export_under_defaults(tiny_data, base_run, tmp_path, capsys):
    pytest.importorskip("transformers")
    assert cli_main(["export-hf", str(base_run), "--out", str(tmp_path / "hf"), "--no-tokenizer"]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 257  # trimmed from 320
    trainer = Trainer(build_config(overrides=_over(tiny_data, tmp_path, **{"model.init_from": tmp_path / "hf"})))
    assert trainer.model_config.vocab_size == 257
    src = torch.load(base_run / "checkpoints" / "step_0000003.pt", weights_only=True)["model"]
    assert torch.equal(trainer.raw_model.transformer.wte.weight, src["transformer.wte.weight"][:257])


class _NotAPlainType:
    pass


def test_checkpoint_read_errors_never_advise_unsafe_loading(tmp_path):
    from eslm.model.loading import load_model
    from eslm.train.checkpoint import load_checkpoint

    torch.save({"format": "eslm-checkpoint-v1", "x": _NotAPlainType()}, tmp_path / "evil.pt")
    for load in (load_model, load_checkpoint):
        with pytest.raises(CheckpointError) as e:
            load(tmp_path / "evil.pt")
        msg = str(e.value)  # torch's own text: "This file can still be loaded ... if you trust the source" + ANSI
        assert "\n" not in msg and "\x1b" not in msg
        assert not any(w in msg for w in ("weights_only", "Weights only", "still be loaded", "trust"))


def test_study_file_with_a_yaml_syntax_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("methods: [clm, eslm-entropy\nseeds: [1]\n")
    code = cli_main(["study", str(bad), "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and f"study {str(bad)!r} is not valid YAML" in err


def test_a_lock_whose_write_fails_leaves_no_lock_file(tmp_path, monkeypatch):
    """issue 47: a full disk when the lock records its holder: one OSError naming the lock file, and no empty
    lock file left behind (the next start would otherwise find it)."""
    import errno
    import os

    from eslm import lock as lock_module

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lock_module.os, "write", full)
    with pytest.raises(OSError, match="eslm.lock") as e:
        lock_module.DirLock(tmp_path, "run directory").acquire()
    monkeypatch.undo()
    assert e.value.errno == errno.ENOSPC and not (tmp_path / "eslm.lock").exists(), os.listdir(tmp_path)
