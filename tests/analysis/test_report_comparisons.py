"""`eslm report`'s comparisons on a hand-made study: the primary line, Holm's family, the equal-token read-out,
censored to-target costs, the paired difference over training, and colours that are never reused."""

from __future__ import annotations

import json

import pytest
import yaml

from eslm import metrics as M
from eslm.analysis import report
from eslm.analysis import stats as S
from eslm.analysis.report import comparisons as C

TOKENS = 512  # per step
SEEDS = (1, 2, 3, 4)
STEPS = {"clm": (30, 60, 90), "eslm-entropy": (30, 60, 90, 104), "random": (30, 60, 90, 104)}
STUCK = 3  # eslm-entropy's seed 3 never reaches the target


def loss(method: str, seed: int, step: int) -> float:
    """CLM falls linearly; ESLM gains 0.02 nats per 90 steps on it, random 0.01; seed-dependent offsets."""
    base = 5.0 - step / 100.0 + 0.01 * seed
    if method == "eslm-entropy":
        return base - 0.02 * step / 90 + 0.003 * (seed % 2) + (0.5 if seed == STUCK else 0.0)
    if method == "random":
        return base - 0.01 * step / 90 - 0.002 * (seed % 3)
    return base


def write_run(root, method: str, seed: int):
    name = f"{method}-s{seed}"
    d = root / name
    d.mkdir(parents=True)
    cfg = {"run": {"name": name, "seed": seed, "out_dir": str(root)},
           "method": {"name": method, "alpha": 0.2}, "model": {"preset": "tiny"},
           "train": {"max_flops": 9.0e12, "lr_schedule": "budget"}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "env.json").write_text(json.dumps({"device": "cpu", "world_size": 1, "seed": seed}))
    keep = 1.0 if method == "clm" else 0.8
    lines = []
    for step in range(10, STEPS[method][-1] + 1, 2):
        flops = 1e11 * step * (1 + 2 * keep) / 3
        rec = {M.KIND: M.KIND_TRAIN, M.STEP: step, M.TOKENS_SEEN: TOKENS * step, M.TRAIN_LOSS: 5.0,
               M.FLOPS_PAPER: flops, M.FLOPS_EXECUTED: 1e11 * step, M.ELAPSED_S: step, M.CPU_S: step}
        if method == "eslm-entropy":  # a score-based selector logs alpha and the mean scores of its two sets
            rec.update({M.ALPHA: 0.2, M.KEPT_FRAC: 0.8, M.CVAR: 6.0 - step / 100, M.SCORE_DROPPED_MEAN: 1.0})
        lines.append(rec)
    for step in STEPS[method]:
        lines.append({M.KIND: M.KIND_EVAL, M.STEP: step, M.TOKENS_SEEN: TOKENS * step, M.ELAPSED_S: step,
                      M.CPU_S: step, M.FLOPS_PAPER: 1e11 * step * (1 + 2 * keep) / 3,
                      M.FLOPS_EXECUTED: 1e11 * step, M.VAL_LOSS: loss(method, seed, step)})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    (d / "result.json").write_text(json.dumps({"step": STEPS[method][-1], "stopped_by": "max_flops"}))
    return d


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    runs = [str(write_run(root, m, s)) for s in SEEDS for m in STEPS]
    out = root / "report"
    return report.build_report(runs, out, target_loss="baseline", primary=["eslm-entropy", "random"]), out


def test_the_primary_comparison_is_first_and_unadjusted(study, capsys):
    s, out = study
    p = s["primary"]
    assert (p["group"], p["against"], p["primary"]) == ("eslm-entropy", "random", True)
    final = p["losses"][C.FINAL]
    want = {str(k): loss("eslm-entropy", k, 104) - loss("random", k, 104) for k in SEEDS}
    assert final["per_seed"] == pytest.approx(want) and "p_adjusted" not in final
    assert p["primary_verdict"].startswith("PRIMARY (named in advance, not adjusted, p = ")
    assert f"detectable at 80% power: {final['mde']:.4f} nats" in p["primary_verdict"]
    assert p is next(c for c in s["controls"] if c["group"] == "eslm-entropy")  # the control comparison itself
    report.print_summary(s, out)
    assert capsys.readouterr().out.splitlines()[0] == p["primary_verdict"]
    md = (out / "summary.md").read_text().splitlines()  # after the header, before the verdict table
    assert md.index(f"**{p['primary_verdict']}**") < md.index("## Verdicts") and md[0].startswith("# eslm report")
    page = (out / "index.html").read_text()
    assert page.index("Primary comparison") < page.index("<h2>Verdicts</h2>")


def test_every_other_verdict_is_holm_adjusted_over_the_report_one_test_per_quantity(study):
    s, _ = study
    comps = s["comparisons"] + s["controls"]
    assert len(comps) == 3  # eslm and random vs clm, eslm vs random
    members = []
    for c in comps:
        members += [c["losses"][C.FINAL]] if not c["primary"] else []
        members += [c["losses"][C.EQUAL]] + [c["to_target"][k] for k in ("flops_paper", "flops_executed",
                                                                           "tokens", "time_s")]
    assert len(members) == 3 * 6 - 1
    # in these runs tokens, executed FLOPs and time grow alike with steps: to a target they are one number of a
    # pair (and ESLM vs random at one alpha also in paper-FLOPs): 17 read-outs, 10 distinct quantities
    tt = s["controls"][0]["to_target"]
    assert tt["tokens"]["per_seed"] == pytest.approx(tt["flops_paper"]["per_seed"], abs=1e-12)
    distinct = [ci for ci in members if not ci.get("same_quantity_as_earlier")]
    assert s["holm_family"] == len(distinct) == 10
    assert [ci["p_adjusted"] for ci in distinct] == pytest.approx(S.holm([ci["p"] for ci in distinct]))
    assert all(ci["family"] == 10 for ci in members)
    assert len({tt[k]["p_adjusted"] for k in ("flops_paper", "flops_executed", "tokens", "time_s")}) == 1


def test_equal_token_read_out_is_at_the_baselines_last_step(study):
    s, _ = study
    eslm = next(g for g in s["groups"] if g["label"] == "eslm-entropy")
    at90 = [loss("eslm-entropy", k, 90) for k in SEEDS]
    assert eslm["equal_tokens_val_loss"]["mean"] == pytest.approx(sum(at90) / 4)
    c = next(c for c in s["comparisons"] if c["group"] == "eslm-entropy")
    want = {str(k): loss("eslm-entropy", k, 90) - loss("clm", k, 90) for k in SEEDS}
    assert c["losses"][C.EQUAL]["per_seed"] == pytest.approx(want)
    assert any(v.startswith("validation loss at clm's last evaluation (equal tokens)") for v in c["verdicts"])


def test_a_seed_that_never_reaches_the_target_is_censored_in_the_report(study):
    s, _ = study
    target = max(loss("clm", k, 90) for k in SEEDS)
    assert s["target_loss"] == pytest.approx(target)
    eslm = next(g for g in s["groups"] if g["label"] == "eslm-entropy")
    tt = eslm["to_target"]["flops_paper"]
    assert tt["reached"] == 3 and tt["censored"] == [str(STUCK)]
    budget = 1e11 * 104 * (1 + 2 * 0.8) / 3  # the stuck run's paper-FLOPs at its last evaluation
    assert tt["budget_per_seed"][str(STUCK)] == pytest.approx(budget)
    c = next(c for c in s["comparisons"] if c["group"] == "eslm-entropy")
    ci = c["to_target"]["flops_paper"]
    assert ci["n"] == 4 and ci["censored_x"] == [str(STUCK)] and ci["bias"] == "x"
    clm_cost = next(g for g in s["groups"] if g["label"] == "clm")["to_target"]["flops_paper"]["per_seed"][str(STUCK)]
    assert ci["per_seed"][str(STUCK)] == pytest.approx(budget / clm_cost - 1)
    verdict = next(v for v in c["verdicts"] if v.startswith(("paper-FLOPs", "reaches", "needs")) and "paper" in v)
    assert "1 of 4 seeds of eslm-entropy never reached the target and counts at its budget" in verdict


def test_the_paired_difference_over_training(study):
    s, out = study
    d = s["differences_over_training"]
    vs_clm = next(x for x in d["baseline"] if x["label"] == "eslm-entropy")
    assert vs_clm["step"] == [30, 60, 90]  # the steps both groups evaluate
    for i, step in enumerate(vs_clm["step"]):
        ci = S.mean_ci([loss("eslm-entropy", k, step) - loss("clm", k, step) for k in SEEDS])
        assert (vs_clm["mean"][i], vs_clm["lo"][i], vs_clm["hi"][i]) == pytest.approx((ci["mean"], ci["lo"], ci["hi"]))
        assert vs_clm["x"][i] == TOKENS * step
    vs_random = d["control"][0]
    assert (vs_random["label"], vs_random["against"], vs_random["step"]) == ("eslm-entropy", "random", [30, 60, 90, 104])
    if report.figures.available():
        assert {"difference_over_training", "kept_dropped_scores"} <= set(s["figures"])
        assert (out / "difference_over_training.png").stat().st_size > 1000


def test_the_schedule_is_stated(study):
    assert study[0]["schedule"].startswith("under the FLOPs budget each run's warmup and cosine end at its own")


def test_a_primary_that_names_no_group_is_one_line(study, tmp_path):
    s, out = study
    runs = [r["path"] for r in s["runs"]]
    with pytest.raises(report.ReportError, match=r"^--primary: no group 'eslm-loss' among the runs; expected one of"):
        report.build_report(runs, tmp_path / "r", primary=["eslm-loss", "random"])
    with pytest.raises(report.ReportError, match="two different groups"):
        report.build_report(runs, tmp_path / "r", primary=["random", "random"])


@pytest.mark.parametrize("n", [3, 10, 12, 20, 45])
def test_colours_are_never_reused(n):
    colors = report.figures.color_map([f"g{i}" for i in range(n)])
    assert len(set(colors.values())) == n


def test_a_control_that_is_the_baseline_is_compared_once(tmp_path, capsys):
    """A study whose baseline is the random control (confirm-loss-cpu): each method is compared with random once,
    one verdict line per pair (not a second, identical 'control' line), and the table's control column shows
    that comparison."""
    runs = [str(write_run(tmp_path, m, s)) for s in SEEDS for m in ("eslm-entropy", "random")]
    out = tmp_path / "report"
    s = report.build_report(runs, out, target_loss="baseline", baseline="random",
                            primary=["eslm-entropy", "random"])
    assert [(c["group"], c["against"]) for c in s["comparisons"]] == [("eslm-entropy", "random")]
    assert s["controls"] == []
    md = (out / "summary.md").read_text()
    assert sum(line.startswith("- **eslm-entropy** vs random: ") for line in md.splitlines()) == 1
    lines = md.splitlines()
    row = next(line for line in lines[lines.index("## Summary"):] if line.startswith("| eslm-entropy"))
    final = s["comparisons"][0]["losses"][C.FINAL]
    assert row.split(" | ")[3] == row.split(" | ")[4] != "—" and f"{final['mean']:+.4f}" in row.split(" | ")[4]
    report.print_summary(s, out)
    assert sum(line.startswith("eslm-entropy vs random: ") for line in capsys.readouterr().out.splitlines()) == 1
