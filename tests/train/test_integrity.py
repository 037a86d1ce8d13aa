"""Checkpoints and snapshots are verified, not trusted (issue 24 items 5 and 9).

Every checkpoint carries a SHA-256 (``step_XXXXXXX.pt.sha256``) and every snapshot one in its header, written at
save and checked at load; non-finite weights or optimizer state are never saved and are refused at load with the
newest good file named; a write that fails inside torch's zip writer or safetensors (a full disk, a file-size
limit) is one line, not a traceback."""

import hashlib
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch

from conftest import tiny_overrides
from eslm.cli import main as cli_main
from eslm.config import build_config
from eslm.errors import CheckpointError
from eslm.train.stopping import last_good_hint
from eslm.train.trainer import Trainer, TrainingDiverged, train

# the run of the fixtures base_run and run_copy (tests/train/conftest.py)
BASE = {"method.name": "clm", "train.max_steps": 3, "checkpoint.interval": 1, "checkpoint.keep_last": 3,
        "eval.interval": 1}


def _over(tiny_data, out, **extra):
    return tiny_overrides(tiny_data, out, **{**BASE, **extra})


def _flip_byte(path, at=0.6):
    """Change one byte in the middle of the file (inside tensor data), as a bad disk or copy would."""
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def _one_line(capsys, code):
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err, err
    return err


def test_every_checkpoint_has_a_sha256_sidecar(base_run):
    for p in sorted((base_run / "checkpoints").glob("step_*.pt")):
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        assert (base_run / "checkpoints" / f"{p.name}.sha256").read_text() == f"{digest}  {p.name}\n"


def test_a_damaged_checkpoint_is_refused_at_resume_naming_the_newest_good_one(run_copy, capsys):
    _flip_byte(run_copy / "checkpoints" / "step_0000003.pt")
    code = cli_main(["train", "--resume", str(run_copy), "train.max_steps=4"])
    err = _one_line(capsys, code)
    assert "step_0000003.pt does not match its checksum" in err
    assert "newest good checkpoint is" in err and "step_0000002.pt" in err and "--resume-from 2" in err
    assert cli_main(["train", "--resume", str(run_copy), "--resume-from", "2", "train.max_steps=4"]) == 0


def test_non_finite_optimizer_state_is_refused_at_load_naming_the_newest_good_one(run_copy, capsys):
    path = run_copy / "checkpoints" / "step_0000003.pt"
    state = torch.load(path, weights_only=True)
    next(iter(state["optimizer"]["state"].values()))["exp_avg"].view(-1)[0] = float("nan")
    torch.save(state, path)  # a file that holds NaN but is intact on disk (its checksum made to match)
    (path.parent / f"{path.name}.sha256").write_text(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n")
    code = cli_main(["train", "--resume", str(run_copy), "train.max_steps=4"])
    err = _one_line(capsys, code)
    assert "non-finite values in its optimizer state" in err and "step_0000002.pt" in err


def test_non_finite_optimizer_state_is_never_saved(tiny_data, tmp_path):
    trainer = Trainer(build_config(overrides=_over(tiny_data, tmp_path, **{"eval.interval": 0})))
    real_step = trainer.optimizer.step

    def poisoned_step(*a, **k):  # after step 2 an optimizer moment turns NaN, the weights stay finite
        real_step(*a, **k)
        if trainer.step == 1:
            st = next(iter(trainer.optimizer.state.values()))
            st["exp_avg_sq"].view(-1)[0] = float("nan")

    trainer.optimizer.step = poisoned_step
    with pytest.raises(TrainingDiverged, match=r"optimizer state at step 2 is not finite.*step_0000001\.pt"):
        trainer.train()
    assert sorted(p.name for p in (tmp_path / "t" / "checkpoints").glob("step_*.pt")) == ["step_0000001.pt"]


def test_the_last_good_checkpoint_skips_a_damaged_latest(run_copy):
    _flip_byte(run_copy / "checkpoints" / "step_0000003.pt")
    hint = last_good_hint(run_copy)
    assert "last good checkpoint is" in hint and "step_0000002.pt" in hint and "step_0000003.pt is damaged" in hint


def test_a_snapshot_carries_a_checksum_and_a_damaged_one_is_refused(run_copy):
    from safetensors import safe_open

    from eslm.model.loading import load_model

    snap = run_copy / "snapshots" / "step_0000003.safetensors"
    with safe_open(str(snap), framework="pt") as f:
        assert len(f.metadata()["sha256"]) == 64
    _flip_byte(snap)
    with pytest.raises(CheckpointError, match=r"step_0000003.safetensors does not match its checksum.*newest good "
                                              r"file of the run is .*step_0000003\.pt"):
        load_model(snap)


def test_snapshots_are_fsynced_before_the_rename(tiny_data, tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *a, **k):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    train(build_config(overrides=_over(tiny_data, tmp_path, **{"train.max_steps": 1})))
    (i, (_, tmp, dst)), = [(i, e) for i, e in enumerate(events) if e[0] == "replace" and e[2].endswith(".safetensors")]
    assert ("fsync", tmp) in events[:i]


# ---------------------------------------------------------------- 9. OS errors inside torch and safetensors


def _train_with_file_size_limit(args, limit_bytes):
    """``eslm train ARGS`` in a process whose files cannot grow past ``limit_bytes`` (writes fail with EFBIG,
    an OSError raised inside whichever library writes)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "eslm.cli", "train", *args], capture_output=True, text=True,
                          preexec_fn=limit, env=env, timeout=600)


def test_a_write_error_inside_torchs_zip_writer_is_one_line(tiny_data, tmp_path):
    out = _train_with_file_size_limit(_over(tiny_data, tmp_path, **{"eval.interval": 0}), 1_000_000)
    err = out.stderr.strip()
    assert out.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "could not write checkpoint" in err and "step_0000001.pt" in err and "File too large" in err
    ckpts = tmp_path / "t" / "checkpoints"
    assert not [p for p in ckpts.iterdir() if ".tmp." in p.name]  # the partial file was removed


def test_a_write_error_inside_safetensors_is_one_line(tiny_data, tmp_path):
    out = _train_with_file_size_limit(_over(tiny_data, tmp_path, **{"checkpoint.interval": 0}), 200_000)
    err = out.stderr.strip()
    assert out.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "could not write snapshot" in err and "step_0000001.safetensors" in err and "File too large" in err
    assert not [p for p in (tmp_path / "t" / "snapshots").iterdir() if ".tmp." in p.name]
