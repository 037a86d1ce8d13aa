"""Weights & Biases logging (offline) and the one-line warning for a requested logger that is not installed."""

from __future__ import annotations

import json
import sys
import time

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
    log = next(offline[0].glob("*.wandb"))
    deadline = time.monotonic() + 60  # W&B's service may still be writing the log when finish() returns
    while True:
        recs = list(_records(log))
        kinds = [r.WhichOneof("record_type") for r in recs]
        if "run" in kinds and "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    runs = [r.run for r, kind in zip(recs, kinds) if kind == "run"]
    assert len(runs) == 1, f"{log} ({log.stat().st_size} bytes) holds records {sorted(set(kinds))}"
    run = runs[0]
    assert (run.project, run.display_name, run.run_id) == ("p1", "t", run_id)
    conf = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert conf["log"]["wandb_project"] == "p1" and conf["env"]["torch_version"]  # resolved config + env.json
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in recs if r.WhichOneof("record_type") == "history"]
    logged: dict = {}
    for h in history:
        logged.setdefault(h["_step"], {}).update(h)
    expected: dict = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        expected.setdefault(rec["step"], {}).update(
            {k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"})
    assert sorted(logged) == sorted(expected) == [1, 2, 3, 4, 5, 6]
    for step, metrics in expected.items():  # every metric under its metrics.jsonl name, same value
        for k, v in metrics.items():
            assert logged[step][k] == pytest.approx(v), (step, k)
    assert "val_loss" in expected[3] and any("/" in k for k in expected[3])  # per-domain names kept


def _records(path):
    """Records of a W&B transaction log (.wandb): a 7-byte header, then LevelDB-log style 32 KiB blocks of
    (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) chunks of protobuf Records."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


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
