"""Smoke tests of the benchmark scripts on the tiny preset: they run end to end, measure every variant the issue
asks for, and write ratios against the baselines measured in the same run. (Their timings are not tested.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, args: list[str], out: Path) -> dict:
    env = {**os.environ, "ESLM_BENCH_RESULTS": str(out)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--name", "smoke"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (out / "smoke.md").exists()
    return json.loads((out / "smoke.json").read_text())


def test_loss_path_compares_fused_and_triton_rows_with_the_naive_path(monkeypatch):
    """The triton rows' "vs naive twin" is the naive path of the same method (CLM triton: 0.813x time, 0.496x memory
    at 124M on the H200), not the row itself."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import loss_path

    assert loss_path.naive_twin_label("clm-triton") == "clm-naive"
    assert loss_path.naive_twin_label("eslm-entropy-triton@0.2") == "eslm-entropy-naive@0.2"
    assert loss_path.naive_twin_label("eslm-loss-triton@0.2") == "eslm-entropy-naive@0.2"
    assert loss_path.naive_twin_label("eslm-entropy-fused[all_rows]@0.1") == "eslm-entropy-naive@0.1"


@pytest.mark.slow  # a benchmark script end to end in subprocesses (.ci/lowest leaves it out)
def test_loss_path_benchmark_measures_every_variant(tmp_path):
    # no warm-up round: the smoke checks what is measured and written, not the timings
    res = _run("loss_path.py", ["--preset", "tiny", "--seq-len", "16", "--micro-batch", "2", "--steps", "1",
                                "--warmup", "0", "--alphas", "0.1", "0.5", "--peak-flops", "1e12"], tmp_path)
    rows = {r["variant"]: r for r in res["rows"]}
    for a in (0.1, 0.5):
        for v in ("eslm-entropy-naive", "eslm-entropy-fused", "eslm-loss-fused"):
            assert f"{v}@{a}" in rows
        assert rows[f"eslm-entropy-fused@{a}"]["kept_frac"] == pytest.approx(1 - a, abs=1 / 32)
        for route in ("kept_cached", "all_rows", "grads_in_pass", "kept_recompute"):  # each route, forced
            assert rows[f"eslm-entropy-fused[{route}]@{a}"]["route"] == route
        assert rows[f"eslm-entropy-fused@{a}"]["route"] == "kept_cached"  # the rule's pick with scores
    assert rows["clm-fused"]["route"] == "grads_in_pass" and rows["clm-naive"]["route"] is None
    assert rows["clm-naive"]["time_vs_clm_naive"] == 1.0 and rows["clm-fused"]["time_vs_clm_fused"] == 1.0
    assert res["peak_flops"] == 1e12 and res["flops_per_token"] > 0
    for r in rows.values():
        assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(32 / r["step_s"])
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * res["flops_per_token"] / 1e12)
        if sys.platform == "linux":
            assert r["peak_bytes"] and r["peak_bytes"] > 0 and r["mem_vs_naive_twin"] > 0
    for o in res["selection_overhead"].values():
        assert o["select_s"] > 0 and o["entropy_s"] >= 0 and o["fraction_of_clm_fused_step"] > 0


@pytest.mark.slow  # a benchmark script end to end in subprocesses (.ci/lowest leaves it out)
def test_whole_runs_benchmark_interleaves_real_runs(tmp_path):
    # a small GPT-2-tokenized corpus passed with --data: without it the script prepares the whole stdlib corpus,
    # most of this test's time (the script's default path is the one `eslm prepare stdlib`'s tests cover)
    from conftest import _write_corpus
    from eslm.data.prepare import prepare

    data = tmp_path / "data"
    prepare("text", data, tokenizer="gpt2", paths=_write_corpus(tmp_path / "text"), progress=False, workers=1)
    res = _run("whole_runs.py", ["--preset", "tiny", "--seq-len", "16", "--micro-batch", "2", "--steps", "2",
                                 "--rounds", "2", "--arms", "clm", "eslm-loss@0.5", "--profile-reps", "1",
                                 "--data", str(data)], tmp_path)
    runs, summary = res["runs"], res["summary"]
    assert [len(runs[a]) for a in ("clm", "eslm-loss@0.5")] == [2, 2]
    for r in runs["eslm-loss@0.5"] + runs["clm"]:
        assert r["cpu_s"] > 0 and r["step"] == 2
    s = summary["eslm-loss@0.5"]
    assert s["ratios"] == pytest.approx([e["cpu_s"] / c["cpu_s"] for e, c in zip(runs["eslm-loss@0.5"], runs["clm"])])
    assert summary["clm"]["median_ratio"] == 1.0
    assert 0 < s["bound"]["flops_ratio"] < 1 and "1 - 0.5 * 2/3" in s["bound"]["arithmetic"]
    assert set(res["profile_ms"]) == {"clm", "eslm-loss@0.5"} and res["profile_ms"]["clm"]["head matmuls"] > 0
    assert res["command"].startswith("python benchmarks/whole_runs.py --preset tiny")


def test_whole_runs_bounds_instance_selection_by_its_planned_flops(monkeypatch):
    # an instance arm's bound: the kept rows' step (the head's gradient skipped for the dropped tokens) plus the
    # exit (a 1-layer forward) over the 2 candidates per trained sequence at beta 0.5, against CLM's step; an arm
    # at twice the batch costs twice CLM's step (independent arithmetic from eslm.flops)
    import argparse
    import importlib

    from eslm.flops import FlopsModel, frozen_forward_flops, step_flops
    from eslm.model.gpt import preset
    from eslm.selection.risk import num_kept

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    whole_runs = importlib.import_module("whole_runs")
    a = argparse.Namespace(preset="tiny", seq_len=16, micro_batch=2, set=["method.instance.beta=0.5"])
    cfg = preset("tiny", vocab_size=50304)
    fm, n = FlopsModel.from_config(cfg, 16), 2 * 16
    clm = step_flops(fm, tokens_seen=n, tokens_kept=n, head_backward_tokens=n).executed
    k = num_kept(n, 0.1)
    exit_flops = frozen_forward_flops(preset("tiny", vocab_size=50304, n_layer=1), 16, 2 * n)
    want = (step_flops(fm, tokens_seen=n, tokens_kept=k, head_backward_tokens=k).executed + exit_flops) / clm
    got = whole_runs.bound(a, "eslm-h-entropy@0.1")
    assert got["flops_ratio"] == pytest.approx(want, rel=1e-12) and "exit over every candidate" in got["arithmetic"]
    assert whole_runs.bound(a, "random-instance")["flops_ratio"] == pytest.approx(1.0)
    assert whole_runs.bound(a, "clm/b4")["flops_ratio"] == pytest.approx(2.0)
    assert whole_runs.parse_arm("clm/b4") == ("clm", 0.0) and whole_runs.run_name("eslm-h-loss@0.1/b8") == \
        "eslm-h-loss_a0.1_b8"


def test_restat_recomputes_the_new_statistics_from_an_old_summary(tmp_path):
    # reproduce-cpu's committed summary.json: MDEs from its per-seed differences, censored costs where the runs'
    # budgets are known, Holm over every recomputed comparison; what needs the curves is said to be missing
    import statistics

    from eslm.analysis import stats as S

    src = ROOT / "docs" / "results" / "reproduce-cpu-summary.json"
    out = tmp_path / "restat"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "restat_summary.py"), str(src), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads((tmp_path / "restat.json").read_text())
    summary = json.loads(src.read_text())
    first = summary["comparisons"][0]  # eslm-entropy at alpha 0.1 vs clm
    d = list(first["losses"]["final validation loss"]["per_seed"].values())
    mine = r["comparisons"][0]["losses"]["final validation loss"]
    assert mine["mde"] == pytest.approx(S.mde(statistics.stdev(d), 5)) and mine["mde"] == pytest.approx(0.0349, abs=1e-4)
    loss03 = next(x for x in r["comparisons"] if x["group"] == "eslm-loss (method.alpha=0.3)" and x["kind"] == "baseline")
    paper = loss03["to_target"]["flops_paper"]  # no seed of it reached the target: all 5 at their budget
    assert paper["n"] == 5 and len(paper["censored_x"]) == 5 and paper["bias"] == "x"
    assert r["holm_family"] == 70 and len(r["not_recomputable"]) == 2
    assert "not recomputable" in (tmp_path / "restat.md").read_text()


@pytest.mark.slow  # a benchmark script end to end in subprocesses (.ci/lowest leaves it out)
def test_head_paths_benchmark_times_every_path_interleaved(tmp_path):
    res = _run("head_paths.py", ["--preset", "tiny", "--seq-len", "16", "--micro-batch", "2", "--steps", "2",
                                 "--warmup", "0"], tmp_path)
    cells = {(r["method"], r["path"]) for r in res["rows"]}
    paths = {p for _, p in cells}
    assert {"fp32", "fp32-2threads"} <= paths and len(cells) == 2 * len(paths)
    for r in res["rows"]:
        assert r["cpu_s"] > 0 and len(res["cpu_s"][f"{r['method']}/{r['path']}"]) == 2
        if r["path"] == "fp32":
            assert r["cpu_vs_fp32"] == 1.0
    assert res["env"]["cpu"] and res["env"]["cpu_id"] is not None


def _fake_study(root: Path, losses: dict[str, dict[int, float]]) -> Path:
    """A study directory with one finished run per (group, seed): only its result.json's final loss."""
    for group, per_seed in losses.items():
        for seed, loss in per_seed.items():
            (root / f"{group}-s{seed}").mkdir(parents=True)
            (root / f"{group}-s{seed}" / "result.json").write_text(json.dumps({"val_loss": loss}))
    return root


def test_dose_response_slope_against_scipy(tmp_path):
    # the slope of ESLM - random against alpha (alpha-cpu's primary): the mean of the per-seed least-squares
    # slopes with its t interval, checked against scipy's linregress per seed and its one-sample t test
    scipy_stats = pytest.importorskip("scipy.stats")
    import random as _random

    rng = _random.Random(7)
    alphas, seeds = [0.1, 0.3, 0.5], [1, 2, 3, 4, 5]
    losses: dict[str, dict[int, float]] = {}
    for a in alphas:
        losses[f"eslm-entropy-alpha{a:g}"] = {s: 4.0 - 0.05 * a + rng.gauss(0, 0.02) for s in seeds}
        losses[f"random-alpha{a:g}"] = {s: 4.0 + rng.gauss(0, 0.02) for s in seeds if s != 5 or a != 0.3}
    study = _fake_study(tmp_path / "alpha-cpu", losses)
    out = tmp_path / "slope.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dose_response.py"), str(study),
                           "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["seeds"] == [1, 2, 3, 4]  # seed 5 lacks random at 0.3: left out, not half-counted
    slopes = [scipy_stats.linregress(alphas, [losses[f"eslm-entropy-alpha{a:g}"][s] - losses[f"random-alpha{a:g}"][s]
                                              for a in alphas]).slope for s in r["seeds"]]
    t = scipy_stats.ttest_1samp(slopes, 0.0)
    ci = t.confidence_interval(0.95)
    assert r["slope"]["mean"] == pytest.approx(sum(slopes) / 4, abs=1e-12)
    assert (r["slope"]["lo"], r["slope"]["hi"]) == (pytest.approx(ci.low, abs=1e-9), pytest.approx(ci.high, abs=1e-9))
    assert r["p"] == pytest.approx(t.pvalue, rel=1e-6)
    assert "nats per unit of alpha" in proc.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dose_response.py"), str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "fix:" in bad.stderr


def test_plan_from_pilot_against_scipy(tmp_path):
    # the pilot's paired SD, its chi-squared interval and the pairs it plans, recomputed with scipy
    scipy_stats = pytest.importorskip("scipy.stats")
    import math

    a = {1: 4.06, 2: 4.01, 3: 4.09, 4: 4.03, 5: 4.05}
    b = {1: 4.07, 2: 4.05, 3: 4.08, 4: 4.06, 5: 4.10}
    study = _fake_study(tmp_path / "pilot", {"eslm-loss": a, "random": b})
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plan_from_pilot.py"), str(study), "--margin",
                           "0.015", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(out.read_text())[0]
    d = [a[s] - b[s] for s in a]
    n, sd = len(d), statistics_stdev(d)
    assert row["pairs"] == n and row["sd"] == pytest.approx(sd, rel=1e-9)
    assert row["sd_lo"] == pytest.approx(sd * math.sqrt((n - 1) / scipy_stats.chi2.ppf(0.975, n - 1)), rel=1e-6)
    assert row["sd_hi"] == pytest.approx(sd * math.sqrt((n - 1) / scipy_stats.chi2.ppf(0.025, n - 1)), rel=1e-6)
    upper = sd * math.sqrt((n - 1) / scipy_stats.chi2.ppf(0.2, n - 1))
    assert row["sd_upper"] == pytest.approx(upper, rel=1e-6)

    def power(k, s, effect):  # a two-sided paired t test at 5%: scipy's noncentral t
        tc = scipy_stats.t.ppf(0.975, k - 1)
        ncp = effect / (s / math.sqrt(k))
        return scipy_stats.nct.sf(tc, k - 1, ncp) + scipy_stats.nct.cdf(-tc, k - 1, ncp)

    k = row["pairs_at_upper"]
    assert power(k, upper, 0.025) >= 0.8 > power(k - 1, upper, 0.025)


def statistics_stdev(values):
    import statistics

    return statistics.stdev(values)


def test_the_gpu_pilot_table_pairs_finished_seeds_from_the_logs(tmp_path, monkeypatch):
    """benchmarks/gpu_pilot_table.py: every evaluation line under its run's header, the final and CLM's-last-step
    losses per seed, paired differences by seed; a seed with a preempted arm is left out."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_pilot_table

    def run(name, losses, done="done (max_flops) at step 9; run directory: x"):
        head = f"run directory: /tmp/p/study/{name}  | method m | model gpt2-124m"
        evals = [f"eval step {s}: val_loss {v} (code=1) [0.1s]" for s, v in losses]
        return [head, "step 50/~600 | loss 4.0", *evals, done]
    lines = []
    for seed, (c, e, r) in {1: (3.10, 3.00, 3.03), 2: (3.09, 2.97, 3.02)}.items():
        lines += run(f"clm-s{seed}", [(300, 3.4), (600, c)])
        lines += run(f"eslm-entropy-s{seed}", [(300, 3.4), (600, e + 0.05), (693, e)])
        lines += run(f"random-s{seed}", [(300, 3.4), (600, r + 0.04), (693, r)])
    lines += run("clm-s3", [(150, 3.6)], done="done (preempted) at step 248; run directory: x")
    log = tmp_path / "a.log"
    log.write_text("\n".join(lines) + "\n")
    out = tmp_path / "t.md"
    assert gpu_pilot_table.main([str(log), "--out", str(out)]) == 0
    text = out.read_text()
    assert "2 seeds (1, 2)" in text
    assert "| 1 | 3.1000 | 3.0000 | 3.0300 | 3.1000 | 3.0500 | 3.0700 |" in text
    row = next(r for r in text.splitlines() if r.startswith("| eslm-entropy - random | final |"))
    assert row.split(" | ")[2] == "-0.0400"  # mean of -0.03 and -0.05
