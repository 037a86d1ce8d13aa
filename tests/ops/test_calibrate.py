"""eslm calibrate (eslm.ops.calibrate): measured coefficients, the file the chooser reads, and the command."""

import json
import math
from pathlib import Path

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


def test_the_command_writes_the_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("eslm.ops.calibrate.SHAPES", {"cpu": (16, 8, 64), "cuda": (16, 8, 64)})
    from eslm.cli import main

    out = tmp_path / "c.json"
    assert main(["calibrate", "--device", "cpu", "--dtype", "fp32", "--reps", "1", "--out", str(out)]) == 0
    assert "cpu/float32" in json.loads(out.read_text())["costs"]
    assert "GFLOP/s" in capsys.readouterr().out
    assert main(["calibrate", "--device", "tpu", "--reps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "eslm calibrate: error:" in err


# ------------------------------------------------------------------ the per-machine cache

from eslm.ops import calibrate as cal  # noqa: E402
from eslm.ops import head_costs as hc  # noqa: E402

TINY = {"cpu": (16, 8, 64), "cuda": (16, 8, 64)}


@pytest.fixture
def machine_cache(tmp_path, monkeypatch):
    """An empty cache directory, no ESLM_HEAD_COSTS (the per-machine table), a fresh process memo, and tiny
    calibration shapes (milliseconds, not seconds)."""
    monkeypatch.setenv(hc.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(hc, "_MEMO", {})
    monkeypatch.setattr(hc, "_NOTED", set())
    monkeypatch.setattr(cal, "SHAPES", TINY)
    return tmp_path / "cache" / hc.CACHE_SUBDIR


def test_the_cache_directory_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(hc.CACHE_ENV, str(tmp_path / "mine"))
    assert hc.cache_dir() == tmp_path / "mine" / "head-costs"
    monkeypatch.delenv(hc.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hc.cache_dir() == tmp_path / "xdg" / "eslm" / "head-costs"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG specification: relative paths are ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hc.cache_dir() == tmp_path / "home" / ".cache" / "eslm" / "head-costs"
    import eslm

    assert Path(eslm.__file__).parent not in hc.cache_dir().parents


def test_the_key_names_the_machine_and_its_threads(monkeypatch):
    key = hc.machine_key("cpu")
    assert {"processor", "cpu_id", "threads", "torch", "blas", "cpu_capability"} <= set(key)
    assert key["threads"] == torch.get_num_threads() and key["torch"] == torch.__version__
    other = hc.machine_key("cpu", threads=key["threads"] + 1)
    assert hc.cache_file(other) != hc.cache_file(key)  # another thread count: another table


def test_a_machine_without_a_cache_measures_once_then_reuses_it(machine_cache, capsys):
    logs = []
    rec = cal.ensure_measured("cpu", "float32", log=logs.append)
    assert rec["table"] == "measured" and rec["entry"] == "cpu/float32" and len(logs) == 1
    assert logs[0].startswith("measured the head-route costs of cpu/float32") and str(machine_cache) in logs[0]
    path = Path(rec["path"])
    assert path.parent == machine_cache and hc._CACHE_NAME.match(path.name)
    data = json.loads(path.read_text())
    assert data["format"] == hc.CACHE_FORMAT and data["key"] == hc.machine_key("cpu") == rec["machine"]
    assert (machine_cache / hc.DIR_MARKER).is_file()
    assert sorted(p.name for p in machine_cache.iterdir()) == sorted([hc.DIR_MARKER, path.name])  # no lock left
    hc._MEMO.clear()  # a new process: reads the file, measures nothing
    assert cal.ensure_measured("cpu", "float32", log=logs.append) == rec and len(logs) == 1
    assert json.loads(path.read_text())["id"] == data["id"]
    assert hc.lookup("cpu", "float32")[1] == rec and capsys.readouterr().err == ""
    cal.ensure_measured("cpu", "bfloat16", log=logs.append)  # another dtype joins the same file
    assert set(json.loads(path.read_text())["costs"]) == {"cpu/float32", "cpu/bfloat16"} and len(logs) == 2


@pytest.mark.parametrize("damage, says", [
    ("{", "not JSON"), ('{"format": "x"}', "not an eslm head-costs cache"),
    ("KEY", "another machine key"), ("NEGATIVE", "four positive coefficients")])
def test_a_damaged_cache_is_refused_in_one_line_and_measured_again(machine_cache, capsys, damage, says):
    rec = cal.ensure_measured("cpu", "float32", log=lambda m: None)
    path = Path(rec["path"])
    data = json.loads(path.read_text())
    if damage == "KEY":
        data["key"]["processor"] = "another"
        damage = json.dumps(data)
    elif damage == "NEGATIVE":
        data["costs"]["cpu/float32"]["matmul_s_per_flop"] = -1.0
        damage = json.dumps(data)
    path.write_text(damage)
    hc._MEMO.clear()
    c, used = hc.lookup("cpu", "float32")  # read by the chooser: refused, the shipped table, one line
    err = capsys.readouterr().err
    assert used["table"] == "shipped" and c == hc.BUILTIN[("cpu", "float32")]
    assert err.count("\n") == 1 and "refused" in err and says in err and "fix: eslm calibrate" in err
    logs = []
    again = cal.ensure_measured("cpu", "float32", log=logs.append)  # a run: refused, measured again
    assert again["table"] == "measured" and json.loads(path.read_text())["format"] == hc.CACHE_FORMAT
    assert len(logs) == 2 and "refused" in logs[0] and says in logs[0] and logs[1].startswith("measured")


def test_a_directory_eslm_did_not_make_is_never_written(machine_cache, capsys):
    machine_cache.mkdir(parents=True)
    (machine_cache / "notes.txt").write_text("mine")
    rec = cal.ensure_measured("cpu", "float32", log=lambda m: None)
    err = capsys.readouterr().err
    assert rec["table"] == "shipped" and err.count("\n") == 1 and "eslm did not make it" in err
    assert sorted(p.name for p in machine_cache.iterdir()) == ["notes.txt"]


def test_without_a_measured_table_the_shipped_one_is_used_with_one_note(machine_cache, capsys):
    for _ in range(3):
        c, used = hc.lookup("cpu", "float32")
    err = capsys.readouterr().err
    assert c == hc.BUILTIN[("cpu", "float32")] and used["table"] == "shipped" and used["path"] is None
    assert err.count("\n") == 1 and "none measured for this machine" in err and "shipped table" in err
    assert not machine_cache.exists()  # a lookup measures and writes nothing


def test_the_command_caches_for_this_machine(machine_cache, capsys):
    from eslm.cli import main

    assert main(["calibrate", "--device", "cpu", "--dtype", "fp32", "--reps", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    files = [p for p in machine_cache.iterdir() if hc._CACHE_NAME.match(p.name)]
    assert len(files) == 1 and str(files[0]) in out
    assert json.loads(files[0].read_text())["key"]["threads"] == 1


def test_a_selective_run_records_the_table_it_used(machine_cache, tiny_data, tmp_path):
    """The first selective run measures (tiny shapes here), records the table in env.json and result.json; a
    CLM run measures nothing and records the table its chooser would read."""
    from conftest import tiny_overrides
    from eslm.config import build_config
    from eslm.train.trainer import train

    train(build_config(overrides=tiny_overrides(tiny_data, tmp_path / "runs", **{
        "method.name": "eslm-entropy", "method.alpha": 0.5, "train.max_steps": 2, "eval.interval": 0,
        "checkpoint.interval": 0})))
    run = tmp_path / "runs" / "t"
    result, env = json.loads((run / "result.json").read_text()), json.loads((run / "env.json").read_text())
    assert result["head_costs"]["table"] == "measured" and Path(result["head_costs"]["path"]).parent == machine_cache
    assert env["head_costs"] == [{"from_step": 0, **result["head_costs"]}]
    hc._MEMO.clear()
    train(build_config(overrides=tiny_overrides(tiny_data, tmp_path / "runs", **{
        "run.name": "clm", "train.max_steps": 1, "train.warmup_steps": 0, "eval.interval": 0, "checkpoint.interval": 0})))
    assert json.loads((tmp_path / "runs" / "clm" / "result.json").read_text())["head_costs"] == result["head_costs"]


def test_concurrent_runs_measure_once(machine_cache, monkeypatch):
    """Two runs starting together on a machine without a cache (the demo's two jobs): the cache directory's lock
    lets one measure; the other waits, then reads what the first wrote."""
    import threading

    calls = []
    real = cal.measure

    def slow_measure(*a, **k):
        calls.append(1)
        threading.Event().wait(0.3)  # long enough for the other thread to reach the lock
        return real(*a, **k)

    monkeypatch.setattr(cal, "measure", slow_measure)
    logs, recs = [], []

    def run():
        recs.append(cal.ensure_measured("cpu", "float32", log=logs.append))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(logs) == 1 and recs[0] == recs[1] and recs[0]["table"] == "measured"
