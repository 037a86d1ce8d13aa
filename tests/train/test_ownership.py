"""Run directories: eslm writes, prunes or deletes only what it made (issue 24 items 1, 4, 6, 12).

A run directory carries a marker (eslm-run.json: format, id); a directory without one that holds files is not
eslm's and is refused (one an earlier eslm wrote, before markers, too); nothing is written through a symbolic link; a resume records the eslm version
and commit of every segment and refuses a changed one without consent; temporary files of killed writes are
removed on the next start, only those eslm's names prove it made."""

import json
import shutil
from pathlib import Path

from conftest import tiny_overrides
from eslm.cli import main as cli_main
from eslm.config import build_config
from eslm.train.resume import read_resumes
from eslm.train.trainer import train

RUN_MARKER, RUN_FORMAT = "eslm-run.json", "eslm-run-v1"  # the marker's name and format (eslm.train.run_dir)

# the run of the fixtures base_run and run_copy (tests/train/conftest.py)
BASE = {"method.name": "clm", "train.max_steps": 2, "checkpoint.interval": 1, "checkpoint.keep_last": 1,
        "eval.interval": 2}


def _over(tiny_data, out, **extra):
    return tiny_overrides(tiny_data, out, **{**BASE, **extra})


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() and not p.is_symlink() else str(p.readlink())
                                    if p.is_symlink() else None) for p in sorted(d.rglob("*"))}


def _one_line(capsys, code):
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- 1. a directory eslm did not make


def test_a_run_directory_carries_a_marker_with_an_id(base_run):
    marker = json.loads((base_run / RUN_MARKER).read_text())
    assert marker["format"] == RUN_FORMAT and len(marker["id"]) == 32 and marker["created"].endswith("Z")


def test_train_refuses_a_non_empty_directory_it_did_not_make(tiny_data, tmp_path, capsys):
    d = tmp_path / "t"  # a user's folder that happens to have the run's name
    (d / "checkpoints").mkdir(parents=True)
    (d / "config.yaml").write_text("my: own config\n")
    (d / "notes.txt").write_text("precious\n")
    (d / "checkpoints" / "step_0000001.pt").write_bytes(b"my own file")
    (d / "checkpoints" / ".step_0000002.pt.tmp.77").write_bytes(b"also mine")
    before = _tree(d)
    code = cli_main(["train", *_over(tiny_data, tmp_path)])
    err = _one_line(capsys, code)
    assert f"run directory {str(d)!r} holds files eslm did not write" in err and "run.name" in err
    assert _tree(d) == before
    code = cli_main(["train", *_over(tiny_data, tmp_path), "--resume"])  # a resume is refused the same way
    assert "did not write" in _one_line(capsys, code) and _tree(d) == before


def test_a_new_run_may_start_in_an_empty_directory(tiny_data, tmp_path):
    (tmp_path / "t").mkdir()
    train(build_config(overrides=_over(tiny_data, tmp_path, **{"train.max_steps": 1})))
    assert (tmp_path / "t" / RUN_MARKER).is_file()


def test_a_run_directory_without_marker_is_refused_even_if_eslm_wrote_it(tiny_data, run_copy, capsys):
    (run_copy / RUN_MARKER).unlink()  # as an eslm from before markers wrote it: no longer adopted
    before = _tree(run_copy)
    code = cli_main(["train", "--resume", str(run_copy), "train.max_steps=3"])
    assert "holds files eslm did not write" in _one_line(capsys, code) and _tree(run_copy) == before


def test_unsafe_run_names_are_refused_before_anything_is_written(tiny_data, tmp_path, capsys):
    for name in ("../escape", str(tmp_path / "abs"), "."):
        code = cli_main(["train", *_over(tiny_data, tmp_path / "runs"), f"run.name={name}"])
        assert "run.name: expected a single path-safe name" in _one_line(capsys, code)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "escape").exists() and not (tmp_path / "abs").exists()


# ---------------------------------------------------------------- 4. never write through a symbolic link


def test_a_linked_metrics_file_is_refused_and_its_target_untouched(tiny_data, run_copy, tmp_path, capsys):
    target = tmp_path / "precious.txt"
    target.write_text("precious\n")
    (run_copy / "metrics.jsonl").unlink()
    (run_copy / "metrics.jsonl").symlink_to(target)
    code = cli_main(["train", "--resume", str(run_copy), "train.max_steps=3"])
    err = _one_line(capsys, code)
    assert "metrics.jsonl' is a symbolic link" in err and target.read_text() == "precious\n"


def test_linked_files_written_whole_are_replaced_not_followed(tiny_data, run_copy, tmp_path):
    target = tmp_path / "precious.json"
    target.write_text("{}\n")
    (run_copy / "env.json").unlink()
    (run_copy / "env.json").symlink_to(target)  # env.json is rewritten at the end of every segment
    assert cli_main(["train", "--resume", str(run_copy), "train.max_steps=3"]) == 0
    assert target.read_text() == "{}\n" and not (run_copy / "env.json").is_symlink()


def test_a_linked_checkpoints_directory_is_refused(tiny_data, run_copy, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    shutil.move(run_copy / "checkpoints", elsewhere)
    (elsewhere / "step_0000001.pt").write_bytes(b"someone's file with eslm's name")
    (run_copy / "checkpoints").symlink_to(elsewhere)
    before = _tree(elsewhere)
    code = cli_main(["train", "--resume", str(run_copy), "train.max_steps=4"])
    assert "checkpoints' is a symbolic link" in _one_line(capsys, code)
    assert _tree(elsewhere) == before  # nothing pruned or added there


# ---------------------------------------------------------------- 6. provenance of every segment


def test_resume_records_version_and_commit_and_refuses_a_changed_one(tiny_data, run_copy, monkeypatch, capsys):
    import eslm
    from eslm.train import run_dir

    assert cli_main(["train", "--resume", str(run_copy), "train.max_steps=3"]) == 0
    (rec,) = read_resumes(run_copy)
    env = json.loads((run_copy / "env.json").read_text())
    assert rec["eslm_version"] == eslm.__version__ and rec["git_commit"] == env["git_commit"]
    assert [s["step"] for s in env["segments"]] == [0, 2]
    assert env["segments"][1]["eslm_version"] == eslm.__version__

    monkeypatch.setattr(eslm, "__version__", "99.0")
    monkeypatch.setattr(run_dir, "git_info", lambda: {"git_commit": "f" * 40, "git_dirty": False})
    before = _tree(run_copy)
    code = cli_main(["train", "--resume", str(run_copy), "train.max_steps=4"])
    err = _one_line(capsys, code)
    assert "-> '99.0'" in err and "-> 'fffffff" in err and "run.allow_version_change=true" in err
    assert _tree(run_copy) == before  # refused before anything was written

    assert cli_main(["train", "--resume", str(run_copy), "train.max_steps=4", "run.allow_version_change=true"]) == 0
    last = read_resumes(run_copy)[-1]
    assert last["eslm_version"] == "99.0" and last["git_commit"] == "f" * 40
    assert last["version_change"]["eslm_version"] == [rec["eslm_version"], "99.0"]
    assert json.loads((run_copy / "env.json").read_text())["segments"][-1]["eslm_version"] == "99.0"


# ---------------------------------------------------------------- 12. leftovers of killed writes


def test_temporary_files_of_killed_writes_are_removed_only_when_eslm_named_them(tiny_data, run_copy, capsys):
    snaps = run_copy / "snapshots"
    ours = [snaps / ".step_0000009.safetensors.tmp.4242", run_copy / ".env.json.tmp.4242",
            run_copy / "checkpoints" / ".step_0000005.pt.sha256.tmp.4242"]
    theirs = [snaps / ".my-notes.tmp.4242", snaps / "keep.safetensors.tmp", run_copy / ".profile.tmp.1"]
    for p in ours + theirs:
        p.write_bytes(b"x" * 100)
    assert cli_main(["train", "--resume", str(run_copy), "train.max_steps=3"]) == 0
    assert "removed 3 temporary file(s)" in capsys.readouterr().out
    assert not any(p.exists() for p in ours) and all(p.exists() for p in theirs)
