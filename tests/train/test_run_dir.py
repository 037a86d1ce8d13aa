"""train/run_dir.py: the one reader of metrics.jsonl (the trainer's tests and the report both use it)."""

import json

from conftest import read_metrics
from eslm.analysis.rundir import read_metrics as report_read
from eslm.train.run_dir import last_records


def _write(path, lines):
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))


def test_last_line_of_each_kind_and_step_wins_and_bad_lines_are_counted(tmp_path):
    _write(tmp_path / "metrics.jsonl", [
        {"kind": "train", "step": 1, "train_loss": 3.0},
        {"kind": "train", "step": 2, "train_loss": 2.9},
        {"kind": "eval", "step": 2, "val_loss": 3.1},
        '{"kind": "train", "st\n',  # torn by a kill
        {"kind": "train", "step": 2, "train_loss": 2.5},  # the resumed run wrote step 2 again
        [1, 2], 7, {"step": 3}, {"kind": "train", "step": None}, {"kind": "train", "step": True},
        "\n",
        {"kind": "train", "step": 3, "train_loss": 2.0},
    ])
    recs, skipped = last_records(tmp_path / "metrics.jsonl")
    assert skipped == 6
    assert [(r["kind"], r["step"]) for r in recs] == [("train", 1), ("eval", 2), ("train", 2), ("train", 3)]
    assert recs[2]["train_loss"] == 2.5
    assert [r["step"] for r in read_metrics(tmp_path, "train")] == [1, 2, 3]
    assert read_metrics(tmp_path / "missing") == []
    warnings = []
    train, evals = report_read(tmp_path / "metrics.jsonl", warnings)
    assert [r["step"] for r in train] == [1, 2, 3] and [r["step"] for r in evals] == [2]
    assert warnings == [f"{tmp_path / 'metrics.jsonl'}: skipped 6 malformed line(s)"]
