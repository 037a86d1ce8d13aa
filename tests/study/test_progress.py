"""eslm study's progress lines: runs done out of the launch's, time elapsed, and an estimate of the time left
from the runs so far (a fake clock; the serial launcher with a stand-in for training)."""

from types import SimpleNamespace

from eslm.study import launch


def test_progress_counts_runs_and_estimates_the_time_left():
    now = [100.0]
    p = launch.Progress(4, clock=lambda: now[0])
    now[0] += 60
    assert p.one_done() == "[1/4 runs done, 1m00s elapsed, about 3m00s left]"
    now[0] += 3540  # an hour in, two done: 30 min per run, two left
    assert p.one_done() == "[2/4 runs done, 1h00m elapsed, about 1h00m left]"
    now[0] += 3600 * 3
    p.one_done()
    assert p.one_done() == "[4/4 runs done, 4h00m elapsed]"  # nothing left: no estimate


def test_serial_launcher_prints_progress(monkeypatch, tmp_path, capsys):
    import eslm.train.trainer as trainer

    monkeypatch.setattr(trainer, "train", lambda c: SimpleNamespace(stopped_by=None))
    configs = [SimpleNamespace(run=SimpleNamespace(name=f"r{i}", out_dir=str(tmp_path), resume=False))
               for i in range(3)]
    monkeypatch.setattr(launch, "with_resume_flag", lambda c: (c, False))
    launched = launch.LocalLauncher(1).launch(configs, tmp_path)
    out = capsys.readouterr().out
    assert launched.code == 0
    assert "== [1/3] r0" in out and "== [3/3] r2" in out
    assert "== r0 finished [1/3 runs done" in out and "left]" in out
    assert "== r2 finished [3/3 runs done" in out
