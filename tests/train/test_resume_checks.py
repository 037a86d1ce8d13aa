"""A resume continues only the run it names, from that run's own checkpoint (issue 35).

A run that wrote checkpoints and lost them is refused (not retrained from step 0 over its results); a checkpoint
of another run placed in checkpoints/ is refused; train.max_steps below the resume step is refused; checkpoints
set aside by a --resume-from are never overwritten by a second one; uncommitted code changes count like a new
commit and a missing env.json is refused; a file where eslm keeps a directory is refused before training."""

import json
import shutil
from pathlib import Path

import pytest

from conftest import tiny_overrides
from eslm.cli import main as cli_main
from eslm.config import build_config
from eslm.train.resume import read_resumes
from eslm.train.trainer import train

# the run of the fixtures base_run and run_copy (tests/train/conftest.py)
BASE = {"method.name": "clm", "train.max_steps": 3, "checkpoint.interval": 1, "checkpoint.keep_last": 3,
        "eval.interval": 3}


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


def _one_line(capsys, code):
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err, err
    return err


def test_a_finished_run_whose_checkpoints_are_gone_is_not_retrained(run_copy, capsys):
    shutil.rmtree(run_copy / "checkpoints")
    before = _tree(run_copy)
    err = _one_line(capsys, cli_main(["train", "--resume", str(run_copy)]))
    assert "found result.json (a finished run) and metrics.jsonl up to step 3 but no checkpoint" in err
    assert "run.name=NEW, without --resume" in err
    assert _tree(run_copy) == before  # nothing replaced


def test_a_run_killed_before_its_first_checkpoint_still_starts_again(run_copy, capsys):
    shutil.rmtree(run_copy / "checkpoints")
    (run_copy / "result.json").unlink()
    assert cli_main(["train", "--resume", str(run_copy), "checkpoint.interval=10"]) == 0  # step 3 < first save
    assert "no checkpoint" in capsys.readouterr().out


def test_max_steps_below_the_resume_step_is_refused(run_copy, capsys):
    before = _tree(run_copy)
    err = _one_line(capsys, cli_main(["train", "--resume", str(run_copy), "train.max_steps=2"]))
    assert "train.max_steps=2 is below step 3, where the resume continues (step_0000003.pt)" in err
    assert _tree(run_copy) == before


def test_a_checkpoint_of_another_run_is_refused(tiny_data, run_copy, tmp_path, capsys):
    other = tmp_path / "other"
    train(build_config(overrides=tiny_overrides(tiny_data, other, **{**BASE, "method.name": "eslm-entropy",
                                                                     "train.max_steps": 4})))
    src = other / "t" / "checkpoints"
    for name in ("step_0000004.pt", "step_0000004.pt.sha256", "latest"):
        shutil.copy2(src / name, run_copy / "checkpoints" / name)
    err = _one_line(capsys, cli_main(["train", "--resume", str(run_copy), "train.max_steps=5"]))
    assert "step_0000004.pt' is not of this run: method.name='eslm-entropy' (run: 'clm')" in err


def test_a_second_resume_from_never_overwrites_what_the_first_set_aside(run_copy, capsys):
    ckpts = run_copy / "checkpoints"
    first = {n: (ckpts / n).read_bytes() for n in ("step_0000002.pt", "step_0000003.pt")}
    assert cli_main(["train", "--resume", str(run_copy), "--resume-from", "1", "train.lr=0.002",
                     "run.allow_change=train.lr"]) == 0
    second = {n: (ckpts / n).read_bytes() for n in first}
    assert second != first  # another lr: another branch
    assert cli_main(["train", "--resume", str(run_copy), "--resume-from", "1"]) == 0
    assert {n: (ckpts / "superseded" / n).read_bytes() for n in first} == first
    assert {n: (ckpts / "superseded" / "2" / n).read_bytes() for n in first} == second
    assert "superseded/2" in capsys.readouterr().out
    assert read_resumes(run_copy)[-1]["superseded_to"] == "checkpoints/superseded/2"


def test_uncommitted_changes_at_resume_count_as_a_code_change(run_copy, monkeypatch, capsys):
    from eslm.train import run_dir

    env = json.loads((run_copy / "env.json").read_text())
    commit = env["git_commit"] or "a" * 40
    env.update(git_commit=commit, git_dirty=False)
    env.pop("git_diff_sha256", None)
    (run_copy / "env.json").write_text(json.dumps(env))
    monkeypatch.setattr(run_dir, "git_info", lambda: {"git_commit": commit, "git_dirty": True,
                                                      "git_diff_sha256": "d" * 64})
    before = _tree(run_copy)
    err = _one_line(capsys, cli_main(["train", "--resume", str(run_copy), "train.max_steps=4"]))
    assert "uncommitted_changes 'none' -> 'diff dddddddddddd'" in err and "run.allow_version_change=true" in err
    assert _tree(run_copy) == before
    assert cli_main(["train", "--resume", str(run_copy), "train.max_steps=4", "run.allow_version_change=true"]) == 0
    rec = read_resumes(run_copy)[-1]
    assert rec["version_change"]["uncommitted_changes"] == ["none", "diff dddddddddddd"]
    assert rec["git_diff_sha256"] == "d" * 64
    # the same uncommitted change again: the same code, resumed without a word
    assert cli_main(["train", "--resume", str(run_copy), "train.max_steps=5"]) == 0


def test_a_missing_env_json_is_refused_not_skipped(run_copy, capsys):
    (run_copy / "env.json").unlink()
    before = _tree(run_copy)
    err = _one_line(capsys, cli_main(["train", "--resume", str(run_copy), "train.max_steps=4"]))
    assert "env.json (which eslm and code started the run) is missing" in err
    assert _tree(run_copy) == before
    assert cli_main(["train", "--resume", str(run_copy), "train.max_steps=4", "run.allow_version_change=true"]) == 0
    assert read_resumes(run_copy)[-1]["env_missing"] is True


@pytest.mark.parametrize("name", ["checkpoints", "snapshots"])
def test_a_file_where_eslm_keeps_a_directory_is_refused_before_training(run_copy, capsys, name):
    shutil.rmtree(run_copy / name, ignore_errors=True)
    (run_copy / name).write_text("mine")
    err = _one_line(capsys, cli_main(["train", "--resume", str(run_copy), "train.max_steps=4"]))
    assert f"{str(run_copy / name)!r} is a file; eslm keeps a directory of that name" in err
    assert (run_copy / name).read_text() == "mine"


def test_snapshot_keep_may_change_at_resume_like_keep_last(run_copy):
    assert cli_main(["train", "--resume", str(run_copy), "train.max_steps=4", "checkpoint.snapshot_keep=1",
                     "checkpoint.keep_last=1"]) == 0
    assert set(read_resumes(run_copy)[-1]["changed"]) >= {"checkpoint.snapshot_keep", "checkpoint.keep_last"}


def test_docs_training_lists_every_key_a_resume_may_change():
    # docs/training.md tells a user which keys may change on a resume; it names RESUME_MAY_CHANGE exactly
    import dataclasses
    import re

    from eslm.config import Config
    from eslm.train.resume import RESUME_MAY_CHANGE

    doc = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    section = doc.split("These keys may change", 1)[1].split("(the list is", 1)[0]
    sections = {f.name for f in dataclasses.fields(Config)}  # config keys, not file names like resumes.jsonl
    named = {k for k in re.findall(r"`([a-z_]+\.[a-z_]+)`", section) if k.split(".")[0] in sections}
    assert named == set(RESUME_MAY_CHANGE)
