"""Reading run directories into seed groups (eslm.analysis.rundir): what splits a group and what does not."""

from __future__ import annotations

import json

import pytest
import yaml

from eslm.analysis import report
from eslm.analysis.rundir import group_runs, load_run

from .test_report import make_run


def _set(run_dir, section: str, key: str, value) -> None:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg.setdefault(section, {})[key] = value
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))


def test_machine_only_settings_do_not_split_groups(tmp_path):
    # a study continued with another --jobs: seed 2 ran with 2 threads, seed 3 resumed with a recorded change
    runs = [make_run(tmp_path, f"clm-s{s}", "clm", s) for s in (1, 2, 3)]
    _set(runs[0], "train", "num_threads", 1)
    _set(runs[1], "train", "num_threads", 2)
    _set(runs[2], "train", "num_threads", 1)
    (runs[2] / "resumes.jsonl").write_text(json.dumps({"step": 20, "changed": {
        "train.num_threads": [1, 4], "checkpoint.interval": [100, 50], "train.device": ["cpu", "auto"]}}) + "\n")
    _set(runs[1], "log", "interval", 5)
    groups = group_runs([load_run(p) for p in runs])
    assert [(g.label, [r.seed for r in g.runs]) for g in groups] == [("clm", [1, 2, 3])]
    # what is trained still splits: another learning rate, or another length
    _set(runs[1], "train", "lr", 0.01)
    _set(runs[2], "train", "max_steps", 500)
    assert len(group_runs([load_run(p) for p in runs])) == 3


def test_runs_on_different_thread_counts_are_grouped_with_a_warning_on_time(tmp_path):
    runs = [make_run(tmp_path, f"clm-s{s}", "clm", s) for s in (1, 2)]
    for d, threads in zip(runs, (1, 2)):
        env = json.loads((d / "env.json").read_text())
        (d / "env.json").write_text(json.dumps({**env, "num_threads": threads}))
        _set(d, "train", "num_threads", threads)
    loaded, _, warnings = report.load_runs([str(p) for p in runs])
    s = report.summarize(loaded, group_runs(loaded), target=4.0, target_source="given", flops="paper",
                         skipped=[], warnings=warnings)
    assert len(s["groups"]) == 1
    assert any("different machine settings (CPU threads 1 (1 run), 2 (1 run))" in w and
               "times are not comparable" in w for w in s["warnings"]), s["warnings"]


def _build(tmp_path, runs, **kw):
    from eslm.analysis import figures

    available, figures.available = figures.available, lambda: False  # the numbers only: faster
    try:
        return report.build_report([str(p) for p in runs], tmp_path / "rep", **kw)
    finally:
        figures.available = available


def test_a_repeated_seed_counts_once_and_is_named(tmp_path):
    # seeds [1, 2, 2]: a copied run directory (another name, the same settings and seed) must not make n=3
    runs = [make_run(tmp_path, "clm-s1", "clm", 1), make_run(tmp_path, "clm-s2", "clm", 2),
            make_run(tmp_path, "clm-s2-copy", "clm", 2), make_run(tmp_path, "e-s1", "eslm-entropy", 1),
            make_run(tmp_path, "e-s2", "eslm-entropy", 2)]
    s = _build(tmp_path, runs)
    g = {x["label"]: x for x in s["groups"]}["clm"]
    assert g["seeds"] == [1, 2] and g["final_val_loss"]["n"] == 2 and len(s["runs"]) == 4
    assert [x["path"] for x in s["skipped"]] == [str(runs[2])]
    assert any(w.startswith(f"{runs[2]}: repeats seed 2 of its group, already read from {runs[1]}")
               for w in s["warnings"])
    c = {x["group"]: x for x in s["comparisons"]}["eslm-entropy"]
    assert c["losses"]["final validation loss"]["n"] == 2


def test_two_directories_sharing_a_run_name_are_reported_together(tmp_path):
    # two studies with the same run names (different settings): runs are known by directory, not by run.name
    a = make_run(tmp_path / "study-a", "clm-s1", "clm", 1)
    b = make_run(tmp_path / "study-b", "clm-s1", "clm", 1)
    _set(b, "train", "lr", 0.01)
    s = _build(tmp_path, [a, b, a], baseline="study-a/clm")  # a directory given twice is read once
    assert sorted(r["name"] for r in s["runs"]) == ["study-a/clm-s1", "study-b/clm-s1"]
    assert sorted(r["path"] for r in s["runs"]) == sorted([str(a), str(b)]) and len(s["groups"]) == 2
    assert s["baseline"].startswith("clm (train.lr=None") and s["comparisons"][0]["group"].startswith("clm (train.lr=0.01")
    assert any("given more than once; read once" in w for w in s["warnings"])


def test_runs_on_other_data_tokenizer_or_model_are_never_put_on_one_target(tmp_path):
    from eslm.errors import ESLMError

    base = [make_run(tmp_path, "clm-s1", "clm", 1), make_run(tmp_path, "e-s1", "eslm-entropy", 1)]
    for i, (section, key, value) in enumerate((("data", "tokenizer", "byte"), ("model", "preset", "small"),
                                              ("data", "dir", "/data/other"), ("data", "seq_len", 512))):
        other = make_run(tmp_path, f"x{i}-s1", "eslm-entropy", 1)
        _set(other, section, key, value)
        with pytest.raises(ESLMError) as e:
            _build(tmp_path, base + [other])
        msg = str(e.value)
        what = "data" if key == "dir" else f"{section}.{key}"
        assert f"found 2 sets that differ in {what}: " in msg and "report each set separately" in msg, msg
        assert f"{what}={value} (x{i})" in msg  # the set, with its groups
    assert len(_build(tmp_path, base)["groups"]) == 2
