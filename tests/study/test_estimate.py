"""eslm study --dry-run's time estimate (eslm.study.estimate): from this machine's measured head-route costs."""

from pathlib import Path


from eslm.ops import head_costs as hc
from eslm.ops.head_costs import HeadCosts


def _demo(tmp_path, *over):
    from eslm.study import load_study, plan

    return plan(load_study("demo"), tmp_path / "runs", None, list(over))


def test_the_estimate_follows_the_measured_costs(tmp_path, monkeypatch):
    """A machine whose measured head matmuls are 4x slower gets a longer estimate, in proportion to the share of
    its work that is matmuls; the estimate says which table it used."""
    from eslm.ops.calibrate import store
    from eslm.study.estimate import describe, estimate

    monkeypatch.delenv(hc.ENV, raising=False)
    monkeypatch.setattr(hc, "_MEMO", {})
    configs = _demo(tmp_path)
    shipped = estimate(configs, jobs=2)
    assert shipped["table"]["table"] == "shipped" and "shipped head costs" in describe(shipped)
    base = hc.BUILTIN[("cpu", "float32")]
    slow = HeadCosts(4 * base.matmul_s_per_flop, base.copy_s_per_byte, base.softmax_s_per_elem,
                     base.entropy_s_per_elem, "test")
    store(hc.machine_key("cpu", threads=1), {"float32": slow})  # the demo's runs use one thread
    measured = estimate(configs, jobs=2)
    assert measured["table"]["table"] == "measured" and "this machine's measured head costs" in describe(measured)
    assert 2.5 * shipped["cpu_s"] < measured["cpu_s"] < 4 * shipped["cpu_s"]
    assert measured["cores"] == 2 and measured["wall_s"] < measured["cpu_s"]


def test_the_estimate_scales_with_the_run_and_skips_the_gpu(tmp_path, monkeypatch):
    from eslm.study.estimate import estimate

    short, long = estimate(_demo(tmp_path), jobs=2), estimate(_demo(tmp_path, "train.max_steps=90"), jobs=2)
    assert 1.6 * (short["cpu_s"] - 30) < long["cpu_s"] - 30 < 2.4 * (short["cpu_s"] - 30)
    assert estimate(_demo(tmp_path), jobs=1)["wall_s"] > short["wall_s"]
    assert estimate(_demo(tmp_path, "train.device=cuda"), jobs=2) is None


def test_dry_run_prints_the_estimate(tmp_path, capsys, monkeypatch):
    from eslm.study import run_study

    monkeypatch.chdir(tmp_path)
    assert run_study("demo", tmp_path / "runs", dry_run=True) == 0
    lines = capsys.readouterr().out.splitlines()
    est = [line for line in lines if line.startswith("estimate: about ")]
    assert len(est) == 1 and "CPU-minutes" in est[0] and "idle cores" in est[0]
    assert "corpus preparation included" in est[0]  # nothing prepared in this directory
    assert not Path(tmp_path / "runs").exists()
