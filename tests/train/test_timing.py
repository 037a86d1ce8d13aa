"""train/timing.py and train/records.py's progress line: clocks, throughput, the load record, MFU off CUDA, the progress line."""

import json
import time

import pytest
import torch

from eslm import metrics as M
from eslm.train.records import fmt_time, progress_line
from eslm.train.timing import LoadSampler, Throughput, mfu, timed


def test_timed_returns_the_value_and_both_clocks():
    out, wall, cpu = timed(lambda: sum(i * i for i in range(200_000)), torch.device("cpu"))
    assert out == sum(i * i for i in range(200_000)) and wall > 0 and cpu > 0


def test_throughput_is_tokens_over_the_steps_own_time_and_restarts():
    """Time between steps (an evaluation, a checkpoint) does not count: the issue's small-model run showed
    0.16k tok/s after each evaluation."""
    tp = Throughput()
    tp.add(1000, 0.5)
    time.sleep(0.05)  # an evaluation between the steps
    tp.add(1000, 0.5)
    assert tp.read() == 2000.0
    assert tp.tokens == 0 and tp.seconds == 0.0


def test_load_sampler_records_one_entry_per_process_in_env_json(tmp_path):
    (tmp_path / "env.json").write_text(json.dumps({"seed": 1}))
    s = LoadSampler()
    s.samples += [1.0, 3.0]
    s.record_in_env(tmp_path, step=5)
    s.record_in_env(tmp_path, step=9)
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["seed"] == 1
    assert env["load_avg_during_run"] == [{"until_step": 5, "mean_1m": 2.0, "max_1m": 3.0, "samples": 2},
                                          {"until_step": 9, "mean_1m": 2.0, "max_1m": 3.0, "samples": 2}]
    LoadSampler().record_in_env(tmp_path / "missing", step=1)  # no samples / no file: nothing, no error


def test_mfu_is_none_off_cuda():
    assert mfu(1e6, 1e9, torch.device("cpu"), 1) is None


def test_progress_line_and_time_format():
    rec = {M.TRAIN_LOSS: 2.5, M.LR: 1e-3, M.KEPT_FRAC: 0.25, M.ALPHA: 0.25, M.TOKENS_PER_S: 12_345.0}
    line = progress_line(rec, 10, "40", done=0.25, elapsed_s=30.0)
    assert line == "step 10/40 | loss 2.5000 | lr 1.00e-03 | kept 0.250 (alpha 0.250) | 12.3k tok/s | ETA 1m30s"
    assert "MFU 40.0%" in progress_line({**rec, M.MFU: 0.4}, 10, "40", 0.25, 30.0)
    assert fmt_time(3725) == "1h02m" and fmt_time(59) == "0m59s"


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 80GB HBM3", 989e12),
                                       ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12)])
def test_mfu_takes_the_peak_of_the_gpus_own_variant(monkeypatch, name, peak):
    """An H100 PCIe is not rated at the SXM's 989 TFLOP/s: its MFU divides by its own 756."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert mfu(1e12, 100.0, torch.device("cuda"), 1) == pytest.approx(1e14 / peak)
