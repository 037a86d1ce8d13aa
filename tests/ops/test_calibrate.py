"""eslm calibrate (eslm.ops.calibrate): measured coefficients, the file the chooser reads, and the command."""

import json
import math

import pytest
import torch

from eslm.errors import ESLMError
from eslm.ops.calibrate import calibrate, measure, write
from eslm.ops.head_costs import ENV, FILE_KIND, costs_for


def test_measure_gives_positive_finite_coefficients():
    c = measure(torch.device("cpu"), torch.float32, reps=1, shape=(64, 32, 1024))
    for x in (c.matmul_s_per_flop, c.copy_s_per_byte, c.softmax_s_per_elem, c.entropy_s_per_elem):
        assert math.isfinite(x) and x > 0
    assert c.source.startswith("measured ") and "R,C,V=64,32,1024" in c.source


def test_the_file_round_trips_and_foreign_files_are_never_overwritten(tmp_path, monkeypatch):
    c = measure(torch.device("cpu"), torch.float32, reps=1, shape=(64, 32, 1024))
    out = tmp_path / "costs.json"
    write(str(out), "cuda", {"bfloat16": c})
    write(str(out), "cpu", {"float32": c})  # a second device is added to the same file
    data = json.loads(out.read_text())
    assert data["kind"] == FILE_KIND and set(data["costs"]) == {"cuda/bfloat16", "cpu/float32"}
    monkeypatch.setenv(ENV, str(out))
    assert costs_for("cuda", "bfloat16") == c
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": 1}')
    with pytest.raises(ESLMError, match="not a head-costs file") as e:
        write(str(foreign), "cpu", {"float32": c})
    assert foreign.read_text() == '{"mine": 1}' and "fix:" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["costs.json", "notes.json"]  # no temp file left


def test_bad_arguments_are_one_line_errors():
    for device, says in (("cuda:0", "CUDA is not available") if not torch.cuda.is_available() else ("tpu", "expected"),
                         ("tpu", "expected cpu | cuda")):
        with pytest.raises(ESLMError, match=says) as e:
            calibrate(device, ["fp32"], 1)
        assert "\n" not in str(e.value)
    with pytest.raises(ESLMError, match="--reps"):
        calibrate("cpu", ["fp32"], 0)


def test_the_command_writes_the_file(tmp_path, capsys):
    from eslm.cli import main

    out = tmp_path / "c.json"
    assert main(["calibrate", "--device", "cpu", "--dtype", "fp32", "--reps", "1", "--out", str(out)]) == 0
    assert "cpu/float32" in json.loads(out.read_text())["costs"]
    assert "GFLOP/s" in capsys.readouterr().out
    assert main(["calibrate", "--device", "tpu", "--reps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "eslm calibrate: error:" in err
