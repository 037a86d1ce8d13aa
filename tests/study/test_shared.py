"""Study-level shared models (``models:`` in a study file, ``eslm.study.shared``): trained once per study and used
by every run and seed, never retrained on a later ``eslm study``, refused when their config changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from eslm import study
from eslm.errors import ConfigError
from eslm.files import new_marker


def _study_file(tmp_path: Path, data: Path, teacher_steps: int = 2, **extra) -> Path:
    doc = {
        "methods": ["clm", "dense-kd", "random-kd"],
        "seeds": [1, 2],
        "models": {"teacher": {"method": "clm", "train.max_steps": teacher_steps, "train.lr": 5e-3}},
        "config": {
            "model": {"preset": "tiny"},
            "data": {"dir": str(data), "tokenizer": "byte", "seq_len": 32},
            "train": {"micro_batch_size_seqs": 2, "max_steps": 2, "warmup_steps": 1, "num_threads": 1},
            "method": {"alpha": 0.5, "kd": {"teacher": "teacher"}},
            "eval": {"interval": 2, "tokens_per_domain": 128, "batch_size_seqs": 2},
            "checkpoint": {"interval": 2}, "log": {"interval": 1, "tensorboard": False},
        },
        **extra,
    }
    path = tmp_path / "kd.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def trained(monkeypatch):
    """Every run the study trains, by run directory, in order (the trainer is the real one)."""
    from eslm.train import trainer

    calls: list[str] = []
    real = trainer.train

    def counting(cfg, *a, **kw):
        calls.append(str(Path(cfg.run.out_dir) / cfg.run.name))
        return real(cfg, *a, **kw)

    monkeypatch.setattr(trainer, "train", counting)
    return calls


def test_a_shared_model_is_trained_once_and_used_by_every_run_and_seed(tiny_data, tmp_path, trained):
    path = _study_file(tmp_path, tiny_data)
    out = tmp_path / "out"
    assert study.run_study(str(path), out) == 0
    teacher = out / "kd" / "models" / "teacher"
    assert trained.count(str(teacher)) == 1 and trained[0] == str(teacher)  # first, once for two seeds
    runs = ["dense-kd-s1", "random-kd-s1", "dense-kd-s2", "random-kd-s2"]
    for name in runs:
        cfg = yaml.safe_load((out / "kd" / name / "config.yaml").read_text())
        assert cfg["method"]["kd"]["teacher"] == str(teacher), name  # recorded in every run that uses it
    teacher_cfg = yaml.safe_load((teacher / "config.yaml").read_text())
    assert teacher_cfg["method"]["name"] == "clm" and teacher_cfg["train"]["max_steps"] == 2
    assert teacher_cfg["method"]["kd"]["teacher"] == ""  # the study's key for the runs is not the model's own
    record = json.loads((out / "kd" / "models" / "models.json").read_text())
    # CLM has the study-wide key in its config but does not use the model
    assert sorted(record["teacher"]["used_by"]) == sorted(runs) and len(record["teacher"]["sha256"]) == 64


def test_a_later_study_reuses_the_model_without_training_it_again(tiny_data, tmp_path, trained):
    path = _study_file(tmp_path, tiny_data)
    out = tmp_path / "out"
    assert study.run_study(str(path), out, seeds=[1]) == 0
    teacher = out / "kd" / "models" / "teacher"
    before = {p: p.read_bytes() for p in teacher.rglob("*") if p.is_file()}
    trained.clear()
    # a second seed, and one run of the first seed to resume: the model stays as it is
    (out / "kd" / "random-kd-s1" / "result.json").unlink()
    assert study.run_study(str(path), out) == 0
    assert str(teacher) not in trained
    assert sorted(Path(t).name for t in trained) == ["clm-s2", "dense-kd-s2", "random-kd-s1", "random-kd-s2"]
    assert {p: p.read_bytes() for p in teacher.rglob("*") if p.is_file() and p.name != "models.json"} == before


def test_an_interrupted_model_resumes_from_its_checkpoint(tiny_data, tmp_path, trained, monkeypatch):
    from eslm.train.trainer import Trainer

    path = _study_file(tmp_path, tiny_data, teacher_steps=4)
    out = tmp_path / "out"
    real = Trainer._train_one_step

    def killed_after_step_2(self):
        if self.cfg.run.name == "teacher" and self.step == 2:
            raise KeyboardInterrupt  # the study is stopped while the model trains (its checkpoint: step 2)
        return real(self)

    monkeypatch.setattr(Trainer, "_train_one_step", killed_after_step_2)
    with pytest.raises(KeyboardInterrupt):
        study.run_study(str(path), out, seeds=[1])
    teacher = out / "kd" / "models" / "teacher"
    assert not (teacher / "result.json").exists() and (teacher / "checkpoints" / "step_0000002.pt").is_file()
    monkeypatch.setattr(Trainer, "_train_one_step", real)
    assert study.run_study(str(path), out, seeds=[1]) == 0
    lines = [json.loads(x) for x in (teacher / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r.get("kind") == "train"] == [1, 2, 3, 4]  # resumed at step 3
    assert trained.count(str(teacher)) == 2


def test_a_changed_model_config_is_refused_before_anything_runs(tiny_data, tmp_path, trained):
    out = tmp_path / "out"
    assert study.run_study(str(_study_file(tmp_path, tiny_data)), out, seeds=[1]) == 0
    snapshot = {p: p.stat().st_mtime_ns for p in (out / "kd").rglob("*") if p.is_file()}
    trained.clear()
    changed = _study_file(tmp_path, tiny_data, teacher_steps=3)
    with pytest.raises(ConfigError) as e:
        study.run_study(str(changed), out, seeds=[1, 2])
    msg = str(e.value)
    assert "shared model" in msg and "train.max_steps: 2 -> 3" in msg and "new name" in msg
    with pytest.raises(ConfigError, match="train.max_steps: 2 -> 3"):
        study.run_study(str(changed), out, dry_run=True)
    assert trained == [] and {p: p.stat().st_mtime_ns for p in (out / "kd").rglob("*") if p.is_file()} == snapshot


def test_a_gone_model_whose_runs_remain_is_refused(tiny_data, tmp_path, trained):
    import shutil

    path = _study_file(tmp_path, tiny_data)
    out = tmp_path / "out"
    assert study.run_study(str(path), out, seeds=[1]) == 0
    shutil.rmtree(out / "kd" / "models" / "teacher")
    trained.clear()
    with pytest.raises(ConfigError, match="is gone.*dense-kd-s1"):
        study.run_study(str(path), out, seeds=[1])
    assert trained == []


def test_per_seed_models_and_plan_problems(tiny_data, tmp_path):
    path = _study_file(tmp_path, tiny_data)
    doc = yaml.safe_load(path.read_text())
    doc["models"]["teacher"]["per_seed"] = True
    path.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    configs = study.plan(study.load_study(str(path)), out)
    for c in configs:  # each run uses the model of its own seed
        assert c.method.kd.teacher == str(out / "kd" / "models" / f"teacher-s{c.run.seed}")
    models, problems = study.shared.plan_models(study.load_study(str(path)), out / "kd",
                                                study.schema.flatten(doc["config"]), [1, 2])
    assert problems == [] and [(m.run.name, m.run.seed) for m in models] == [("teacher-s1", 1), ("teacher-s2", 2)]

    doc["models"] = {"te/acher": {"method": "clm"}, "t2": {"method": "cml", "seed": "x", "run.name": "a"},
                     "t3": {"method": "dense-kd", "method.kd.teacher": "t2"}}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as e:
        study.load_study(str(path))
    msg = str(e.value)
    assert "te/acher" in msg and "did you mean 'clm'" in msg and "seed: expected an integer" in msg
    assert "run.* keys" in msg


def test_a_later_seed_that_would_load_another_checkpoint_of_the_model_is_refused(tiny_data, tmp_path, trained):
    """issue 47: models.json pins the checkpoint every run used (its file, step and sha256); with the model's
    checkpoints and last snapshot deleted it would resolve to an earlier snapshot: a later seed is refused."""
    path = _study_file(tmp_path, tiny_data, teacher_steps=4)
    out = tmp_path / "out"
    assert study.run_study(str(path), out, seeds=[1]) == 0
    teacher = out / "kd" / "models" / "teacher"
    entry = json.loads((teacher.parent / "models.json").read_text())["teacher"]
    assert Path(entry["checkpoint"]).name == "step_0000004.pt" and entry["step"] == 4  # the file's own step
    for p in [*(teacher / "checkpoints").iterdir(), teacher / "snapshots" / "step_0000004.safetensors"]:
        p.unlink()
    trained.clear()
    with pytest.raises(ConfigError) as e:
        study.run_study(str(path), out, seeds=[1, 2])
    msg = str(e.value)
    assert "is pinned to step_0000004.pt (step 4" in msg and "now resolves to step_0000002.safetensors" in msg, msg
    assert "dense-kd-s1" in msg and trained == []


def test_a_mistyped_model_name_is_refused_by_the_dry_run(tiny_data, tmp_path, trained):
    """issue 47: method.kd.teacher naming no model of the study (and no path) is refused before anything trains,
    --dry-run included, naming the runs, the value and the study's model names."""
    path = _study_file(tmp_path, tiny_data)
    path.write_text(path.read_text().replace("teacher: teacher", "teacher: teachr"))
    for dry in (True, False):
        with pytest.raises(ConfigError) as e:
            study.run_study(str(path), tmp_path / "out", dry_run=dry)
        msg = str(e.value)
        assert "method.kd.teacher='teachr' names neither a model of the study's models section ('teacher')" in msg
        assert "dense-kd-s1" in msg and "clm-s1" not in msg, msg  # CLM reads no teacher
    assert trained == [] and not (tmp_path / "out").exists()


def test_a_users_models_json_is_refused_not_overwritten(tiny_data, tmp_path, trained):
    """issue 47: models/ is eslm's by its marker (models.json's format), not by its name."""
    from eslm.errors import OwnershipError

    path = _study_file(tmp_path, tiny_data)
    mine = tmp_path / "out" / "kd" / "models" / "models.json"
    mine.parent.mkdir(parents=True)
    mine.write_text('{"my": "notes"}')
    with pytest.raises(OwnershipError, match="found other files"):  # no eslm-study.json: not a study
        study.run_study(str(path), tmp_path / "out", seeds=[1])
    (mine.parent.parent / study.STUDY_MARKER).write_text(json.dumps(new_marker(study.STUDY_FORMAT)))
    with pytest.raises(OwnershipError, match="was not written by eslm"):  # a study's, but not its models.json
        study.run_study(str(path), tmp_path / "out", seeds=[1])
    assert mine.read_text() == '{"my": "notes"}' and trained == []
