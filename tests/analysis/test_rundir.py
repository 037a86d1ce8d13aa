"""Reading run directories into seed groups (eslm.analysis.rundir): what splits a group and what does not."""

from __future__ import annotations

import json

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
