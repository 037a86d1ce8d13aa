"""Weights & Biases logging (offline) and the one-line warning for a requested logger that is not installed."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import tiny_overrides
from eslm.config import build_config
from eslm.train.trainer import train


def test_wandb_offline_run_holds_the_metrics(tiny_data, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb not installed (pip install 'eslm[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = build_config([], tiny_overrides(tiny_data, tmp_path, **{"log.wandb": "true", "log.wandb_project": "p1"}))
    run_dir = train(cfg).run_dir
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert offline[0].name.endswith(run_id)
    summary = json.loads((offline[0] / "files" / "wandb-summary.json").read_text())
    last = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        last.update({k: v for k, v in json.loads(line).items() if isinstance(v, float)})
    assert {"loss", "val_loss", "flops_paper"} <= set(summary)  # the names of metrics.jsonl
    for k in ("loss", "val_loss", "flops_paper"):
        assert summary[k] == pytest.approx(last[k]), k
    conf = (offline[0] / "files" / "config.yaml").read_text()
    assert "wandb_project" in conf and "torch_version" in conf  # resolved config and env.json
    records = _history(offline[0])
    assert records and {r["_step"] for r in records if "loss" in r} == set(range(1, 7))


def _history(run_path):
    """The history rows of an offline W&B run (its .wandb transaction log)."""
    from wandb.sdk.internal import datastore
    from wandb.proto import wandb_internal_pb2

    ds = datastore.DataStore()
    ds.open_for_scan(str(next(run_path.glob("*.wandb"))))
    rows = []
    while (data := ds.scan_data()) is not None:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_missing_logger_is_one_warning_line(tiny_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails: "not installed"
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = build_config([], tiny_overrides(tiny_data, tmp_path, **{"log.tensorboard": "true", "log.wandb": "true",
                                                                  "train.max_steps": 2}))
    train(cfg)
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(err) == 2, err
    assert "log.tensorboard=true but tensorboard is not installed" in err[0]
    assert "log.wandb=true but wandb is not installed" in err[1]
