"""`eslm study`: finding study files, the equal-FLOPs plan."""

from __future__ import annotations

import pytest

from eslm import study
from eslm.errors import ConfigError

STUDY = """methods: [clm, eslm-entropy]
seeds: [1]
budget: {steps_of: clm}
config:
  model: {preset: tiny}
  data: {seq_len: 64}
  train: {max_steps: 10}
"""


def test_builtin_demo_is_found_by_name():
    s = study.load_study("demo")
    assert s["name"] == "demo" and "clm" in s["methods"]


def test_installed_without_source_tree_falls_back_to_cwd(tmp_path, monkeypatch):
    # a non-editable install: the package's parents hold no configs/studies; the repository root is the cwd
    monkeypatch.setattr(study, "STUDIES_DIR", tmp_path / "site-packages" / "configs" / "studies")
    (tmp_path / "repo" / "configs" / "studies").mkdir(parents=True)
    (tmp_path / "repo" / "configs" / "studies" / "mine.yaml").write_text(STUDY)
    monkeypatch.chdir(tmp_path / "repo")
    assert study.load_study("mine")["methods"] == ["clm", "eslm-entropy"]
    with pytest.raises(ConfigError, match="one of: mine"):
        study.load_study("nope")


def test_no_study_files_anywhere_gives_a_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "STUDIES_DIR", tmp_path / "nowhere")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"looked in: .*fix: run from the eslm repository root"):
        study.load_study("demo")


def test_a_path_always_works(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "STUDIES_DIR", tmp_path / "nowhere")
    f = tmp_path / "grid.yaml"
    f.write_text(STUDY)
    runs = study.plan(study.load_study(str(f)), tmp_path / "out")
    assert [r.method.name for r in runs] == ["clm", "eslm-entropy"]
    # equal FLOPs: the same budget for every run, and max_steps raised so that the budget binds
    assert len({r.train.max_flops for r in runs}) == 1 and all(r.train.max_steps > 10 for r in runs)
    assert all(r.train.lr_decay_steps == 10 for r in runs)


def test_sigterm_stops_the_study_without_a_report(tmp_path, monkeypatch):
    # a run stopped by SIGTERM (preempted) must not be followed by the next run or by a report of unfinished runs
    import argparse

    import eslm.cli
    import eslm.train.trainer as trainer

    f = tmp_path / "grid.yaml"
    f.write_text(STUDY)
    started, reported = [], []

    def fake_train(cfg):
        started.append(cfg.run.name)
        return trainer.RunResult(tmp_path, 3, None, "preempted")

    monkeypatch.setattr(trainer, "train", fake_train)
    monkeypatch.setattr(eslm.cli, "main", lambda argv: reported.append(argv) or 0)
    args = argparse.Namespace(preset=str(f), out=str(tmp_path / "out"), seeds=None, dry_run=False, overrides=[])
    assert study.run(args) == 143
    assert started == ["clm-s1"] and reported == []
