"""`eslm report` on synthetic run directories: files written, grouping, FLOPs-to-target numbers, errors."""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml

from eslm import metrics as M
from eslm.analysis import report
from eslm.analysis.rundir import RunDirError, group_runs, load_run
from eslm.errors import ESLMError

DOMAINS = ("web", "code")
FLOPS_PER_STEP = 1e12


def _loss(method: str, seed: int, step: int) -> float:
    """A decreasing synthetic curve; ESLM is a bit better per FLOP, seeds differ slightly."""
    base = 3.0 if method == "clm" else 2.9
    return base + 6.0 / math.sqrt(step) + 0.01 * seed


def make_run(root, name, method, seed, *, steps=(10, 20, 40, 80, 160), alpha=0.1, resume_dup=False,
             downstream=None, evals=True, finished=True):
    """Write a run directory in the trainer's format; returns its path."""
    d = root / name
    (d / "checkpoints").mkdir(parents=True)
    cfg = {"run": {"name": name, "seed": seed, "out_dir": str(root)},
           "method": {"name": method, "alpha": alpha}, "model": {"preset": "tiny"},
           "data": {"source": "stdlib", "weights": "natural"}, "flops": {"count_per": "global"}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "env.json").write_text(json.dumps({"git_commit": "abc", "device": "cpu", "world_size": 1, "seed": seed,
                                            "model_params_non_embedding": 12345}))
    kept = 1.0 if method == "clm" else 1.0 - alpha
    lines = []
    for step in range(10, steps[-1] + 1, 10):
        flops = FLOPS_PER_STEP * step * (1.0 + 2.0 * kept) / 3.0
        rec = {M.KIND: M.KIND_TRAIN, M.STEP: step, M.TOKENS_SEEN: 1000 * step, M.TRAIN_LOSS: _loss(method, seed, step),
               M.TRAIN_LOSS_ALL: _loss(method, seed, step) + 0.01, M.TOKENS_PER_S: 2000.0 + step + seed,
               M.ELAPSED_S: 0.5 * step, M.FLOPS_PAPER: flops, M.FLOPS_EXECUTED: FLOPS_PER_STEP * step}
        if method != "clm":
            rec.update({M.KEPT_FRAC: kept, M.ALPHA: alpha, M.kept_frac_key("web"): kept})
        lines.append(rec)
        if evals and step in steps:
            ev = {M.KIND: M.KIND_EVAL, M.STEP: step, M.TOKENS_SEEN: 1000 * step, M.ELAPSED_S: 0.5 * step,
                  M.FLOPS_PAPER: flops, M.FLOPS_EXECUTED: FLOPS_PER_STEP * step,
                  M.VAL_LOSS: _loss(method, seed, step)}
            for i, dom in enumerate(DOMAINS):
                ev[M.val_loss_key(dom)] = _loss(method, seed, step) + 0.3 * i
            lines.append(ev)
    if resume_dup:  # crashed after step 40 and resumed from step 20: the stale lines of 30, 40 come first
        stale = [dict(r, **{k: r[k] + 0.5 for k in (M.VAL_LOSS, M.TRAIN_LOSS) if k in r})
                 for r in lines if 20 < r[M.STEP] <= 40]
        lines = [r for r in lines if r[M.STEP] <= 20] + stale + [r for r in lines if r[M.STEP] > 20]
    text = "\n".join(json.dumps(r) for r in lines) + "\n"
    (d / "metrics.jsonl").write_text(text)
    if finished:  # the trainer's end-of-run marker
        (d / "result.json").write_text(json.dumps({"step": steps[-1], "stopped_by": "max_steps"}))
    if downstream:
        (d / "eval").mkdir()
        (d / "eval" / "step_0000160.json").write_text(json.dumps(downstream))
    return d


def independent_crossing(run_dir, key, target):
    """Recompute x at the target from the raw file: first eval with loss <= target, log-linear crossing."""
    last = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        last[(r["kind"], r["step"])] = r
    ev = sorted((r for r in last.values() if r["kind"] == "eval"), key=lambda r: r["step"])
    prev = None
    for r in ev:
        if r["val_loss"] <= target:
            if prev is None:
                return r[key]
            frac = (prev["val_loss"] - target) / (prev["val_loss"] - r["val_loss"])
            return 10 ** (math.log10(prev[key]) + frac * (math.log10(r[key]) - math.log10(prev[key])))
        prev = r
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("runs")
    down = {"step": 160, "flops_paper": 1e14, "tasks": {
        "arc_easy": {"metric": "acc_norm", "value": 0.40, "stderr": 0.01, "num_fewshot": 0},
        "piqa": {"metric": "acc_norm", "value": 0.60, "stderr": 0.02, "num_fewshot": 5}}}
    as_eslm_eval = {"format": "eslm-eval-v1", "step": 160, "tasks": down["tasks"]}
    return [make_run(tmp_path, "eslm-s1", "eslm-entropy", 1, resume_dup=True, downstream=down),
            make_run(tmp_path, "eslm-s2", "eslm-entropy", 2, downstream=as_eslm_eval),
            make_run(tmp_path, "clm-s1", "clm", 1, steps=(10, 20, 40, 80))]


def test_grouping_by_config_except_seed(runs):
    groups = group_runs([load_run(p) for p in runs])
    assert [g.label for g in groups] == ["eslm-entropy", "clm"]
    assert [r.name for r in groups[0].runs] == ["eslm-s1", "eslm-s2"]


def test_grouping_separates_settings(tmp_path):
    a = make_run(tmp_path, "a", "eslm-entropy", 1, alpha=0.1)
    b = make_run(tmp_path, "b", "eslm-entropy", 1, alpha=0.2)
    labels = [g.label for g in group_runs([load_run(a), load_run(b)])]
    assert labels == ["eslm-entropy (method.alpha=0.1)", "eslm-entropy (method.alpha=0.2)"]


def test_resumed_run_keeps_last_occurrence(tmp_path):
    d = make_run(tmp_path, "r", "clm", 1)
    with open(d / "metrics.jsonl", "a") as f:  # resumed: step 20 eval rewritten with another value
        f.write(json.dumps({M.KIND: M.KIND_EVAL, M.STEP: 20, M.FLOPS_PAPER: 2e13, M.VAL_LOSS: 1.0}) + "\n")
        f.write('{"kind": "train", "step": 30, "trunc')  # half-written line of a crash
    run = load_run(d)
    assert [r[M.STEP] for r in run.eval] == [10, 20, 40, 80, 160]
    assert run.eval[1][M.VAL_LOSS] == 1.0
    assert any("malformed" in w for w in run.warnings)


def test_report_files_and_flops_to_target(runs, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "rep"
    s = report.build_report([str(p) for p in runs], out)
    for f in ("index.html", "summary.json", "loss_vs_flops.png", "loss_vs_tokens.png", "loss_vs_time.png",
              "flops_to_target.png", "time_to_target.png", "domain_final.png", "domain_curves.png", "training_curve.png",
              "throughput.png"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    # the kept fraction and alpha of a fixed alpha are constant over training: said in the header, not drawn
    assert not (out / "selection.png").exists() and "selection" not in s["figures"]
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["target_loss"] == pytest.approx(s["target_loss"])
    # default target = max over runs of min val loss (clm stops at step 80)
    target = max(_loss("clm", 1, 80), _loss("eslm-entropy", 1, 160), _loss("eslm-entropy", 2, 160))
    assert s["target_loss"] == pytest.approx(target)
    g = {x["label"]: x for x in on_disk["groups"]}
    assert g["eslm-entropy"]["runs"] == ["eslm-s1", "eslm-s2"] and g["eslm-entropy"]["seeds"] == [1, 2]
    for label, names in (("eslm-entropy", runs[:2]), ("clm", runs[2:])):
        ft = g[label]["to_target"]["flops"]
        expect = [independent_crossing(p, M.FLOPS_PAPER, target) for p in names]
        assert [ft["per_run"][p.name] for p in names] == pytest.approx(expect, rel=1e-9)
        assert ft["mean"] == pytest.approx(sum(expect) / len(expect))
        assert ft["reached"] == len(names)
    html = (out / "index.html").read_text()
    assert "http" not in html.lower().replace("http-equiv", "")  # offline: no external resources
    assert "eslm-s1, eslm-s2" in html and "40.0 ± " in html  # group runs and downstream table
    arc = g["eslm-entropy"]["downstream"]["arc_easy"]
    assert arc["k"] == 2 and arc["value"] == pytest.approx(0.40)
    assert arc["stderr"] == pytest.approx(math.sqrt(2 * 0.01 ** 2) / 2)


def test_one_table_of_figures_drives_drawing_and_the_page(runs, tmp_path, monkeypatch):
    # a figure is declared once, in FIGURES: a new entry is drawn, listed in summary.json and placed on the
    # page under its section, with no other edit; one that draws nothing is left out (no placeholder)
    pytest.importorskip("matplotlib")
    from eslm.analysis.report import figure_table as T

    def draw(path, scene):
        assert [g.label for g in scene.groups] == ["eslm-entropy", "clm"] and set(scene.colors) == {"eslm-entropy", "clm"}
        path.write_bytes(b"png")
        return True

    extra = (T.Figure("extra_fig", "Extra section", "an extra figure", draw),
             T.Figure("empty_fig", "Extra section", "nothing to draw", lambda path, scene: False))
    monkeypatch.setattr(T, "FIGURES", T.FIGURES + extra)
    out = tmp_path / "rep"
    s = report.build_report([str(p) for p in runs], out)
    # one seed per group and no selection scores: no paired difference over training, no kept/dropped scores
    # a fixed alpha: kept fraction and alpha are constant, no selection panel
    no_data = {"empty_fig", "difference_over_training", "kept_dropped_scores", "alpha_per_run", "selection"}
    assert list(s["figures"]) == [f.id for f in T.FIGURES if f.id not in no_data]
    assert (out / "extra_fig.png").read_bytes() == b"png" and not (out / "empty_fig.png").exists()
    page = (out / "index.html").read_text()
    ids = re.findall(r"<img src='([a-z_]+)\.png'", page)
    assert ids == list(s["figures"])
    assert "<h2>Extra section</h2>\n<p><img src='extra_fig.png' alt='an extra figure'></p>\n<h2" in page
    assert "nothing to draw" not in page and "no data" not in page
    assert page.count("<h2>Validation loss</h2>") == 1


def test_alpha_per_run_draws_every_seed_of_a_group_whose_alpha_moves(tmp_path, monkeypatch):
    # Ada-ESLM: one line per run (seed) of each group whose alpha changed in some run; fixed-alpha groups: none
    from eslm.analysis.report import figure_table as T

    runs = [load_run(make_run(tmp_path, f"{m}-s{s}", m, s)) for m in ("ada-eslm-entropy", "eslm-entropy") for s in (1, 2)]
    for r in runs[:2]:
        for i, rec in enumerate(r.train):
            rec[M.ALPHA] = 0.1 * (1 + 0.1 * i * r.seed)  # each seed its own path
    groups = group_runs(runs)
    drawn = {}
    monkeypatch.setattr(T.figures, "panels", lambda path, panel, *a, **kw: drawn.update(panel))
    assert T._alpha_per_run(tmp_path / "a.png", T.Scene(groups, {}, {}))
    assert list(drawn) == ["ada-eslm-entropy"]
    lines = drawn["ada-eslm-entropy"]
    assert [x["label"] for x in lines] == ["seed 1", "seed 2"]
    assert lines[1]["mean"] == [r[M.ALPHA] for r in runs[1].train] and lines[0]["x"] == [r[M.STEP] for r in runs[0].train]
    drawn.clear()
    assert not T._alpha_per_run(tmp_path / "b.png", T.Scene(group_runs(runs[2:]), {}, {})) and not drawn


def test_crossing_interpolates_in_log_flops_and_not_reached():
    # loss 4 at 1e10, 2 at 1e12: target 3 is halfway in log10 -> 1e11
    assert report.crossing([1e10, 1e12], [4.0, 2.0], 3.0) == pytest.approx(1e11)
    assert report.crossing([1e10, 1e12], [4.0, 2.0], 5.0) == pytest.approx(1e10)
    assert report.crossing([1e10, 1e12], [4.0, 3.5], 3.0) is None


def test_given_target_not_reached_is_null(runs):
    loaded = [load_run(p) for p in runs]
    s = report.summarize(loaded, group_runs(loaded), target=3.4, target_source="given", flops="executed",
                         skipped=[], warnings=[])
    g = {x["label"]: x for x in s["groups"]}
    assert g["clm"]["to_target"]["flops"]["reached"] == 0
    assert g["clm"]["to_target"]["flops"]["mean"] is None
    assert g["clm"]["to_target"]["flops"]["per_run"] == {"clm-s1": None}
    ft = g["eslm-entropy"]["to_target"]["flops"]
    assert ft["reached"] == 2
    assert ft["per_run"]["eslm-s2"] == pytest.approx(independent_crossing(runs[1], M.FLOPS_EXECUTED, 3.4))
    assert "not reached" in report.render_html(s, {})


def test_errors_and_skips(runs, tmp_path):
    with pytest.raises(RunDirError, match="expected a run directory"):
        load_run(tmp_path / "nope")
    with pytest.raises(RunDirError, match="metrics.jsonl"):
        load_run(tmp_path)
    with pytest.raises(ESLMError, match="--target"):
        report.build_report([str(runs[0])], tmp_path / "x", target_loss=-1.0)
    empty = make_run(tmp_path, "noeval", "clm", 3, evals=False)
    with pytest.raises(ESLMError, match="at least one run with eval lines"):
        report.load_runs([str(empty)])
    loaded, skipped, warnings = report.load_runs([str(runs[0]), str(empty)])
    assert [r.name for r in loaded] == ["eslm-s1"] and skipped[0]["path"] == str(empty)
    assert any("skipped" in w for w in warnings)


def test_cli_dispatch(runs, tmp_path, capsys, monkeypatch):
    from eslm.cli import main

    monkeypatch.setattr(report, "make_figures", lambda out, groups, summary: {})  # figures tested above

    assert main(["report", str(runs[2]), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "index.html").is_file()
    assert main(["report", str(tmp_path / "missing"), "--out", str(tmp_path / "o2")]) == 2
    assert "error: expected a run directory" in capsys.readouterr().err


def test_without_matplotlib_the_tables_are_still_written(runs, tmp_path, monkeypatch):
    # the demo study trains for minutes and then reports: a missing plot extra must not lose the numbers
    from eslm.analysis import figures

    monkeypatch.setattr(figures, "available", lambda: False)
    out = tmp_path / "rep"
    s = report.build_report([str(p) for p in runs], out)
    assert (out / "index.html").is_file() and (out / "summary.json").is_file()
    assert not list(out.glob("*.png")) and s["figures"] == {}
    assert any("pip install 'eslm[plot]'" in w for w in s["warnings"])
    assert "eslm[plot]" in (out / "index.html").read_text()


def test_unfinished_run_is_flagged(tmp_path):
    # a run without result.json (still running / interrupted): its "final" loss is only its latest eval
    done = make_run(tmp_path, "clm-s1", "clm", 1)
    partial = make_run(tmp_path, "eslm-s1", "eslm-entropy", 1, steps=(10, 20, 40), finished=False)
    loaded, _, warnings = report.load_runs([str(done), str(partial)])
    assert [r.finished for r in loaded] == [True, False]
    assert [w for w in warnings if "result.json" in w] == [w for w in warnings if str(partial) in w] != []
    s = report.summarize(loaded, group_runs(loaded), target=4.0, target_source="given", flops="paper",
                         skipped=[], warnings=warnings)
    g = {x["label"]: x for x in s["groups"]}
    assert g["clm"]["unfinished"] == [] and g["eslm-entropy"]["unfinished"] == ["eslm-s1"]
    assert [r["finished"] for r in s["runs"]] == [True, False]
    page = report.render_html(s, {})
    assert page.count("(1/1 unfinished)") >= 3  # the summary, cost and groups tables (and every other one)
    md = report.render_markdown(s)  # summary.md marks them too, and says what their numbers are
    assert "| eslm-entropy (**1/1 unfinished**) |" in md and "**unfinished**: runs without result.json" in md
    assert "| clm |" in md


def test_log_loss_axis_below_a_decade_has_readable_ticks():
    # losses 4.05..5.6 on a log axis: the log locator alone labels only "4" and "5"
    pytest.importorskip("matplotlib")
    from eslm.analysis import figures

    plt = figures.pyplot()
    fig, ax = plt.subplots()
    s = {"label": "clm", "x": [1e11, 1e12, 1e13], "mean": [5.6, 4.5, 4.05], "lo": [5.6, 4.5, 4.05],
         "hi": [5.6, 4.5, 4.05], "n": 1}
    figures._draw_series(ax, [s], {}, logx=True, logy=True)
    lo, hi = ax.get_ylim()
    ticks = [t for t in ax.yaxis.get_majorticklocs() if lo <= t <= hi]
    assert ax.get_yscale() == "log" and len(ticks) >= 4
    plt.close(fig)


def test_domain_final_panels_have_their_own_y_range(tmp_path):
    # domains several nats apart, methods hundredths apart within a domain: one shared axis hides the latter
    pytest.importorskip("matplotlib")
    from eslm.analysis import figures

    values = {"clm": [4.08, 7.17], "eslm-loss": [4.04, 7.07], "eslm-entropy": [None, 7.21]}
    limits = figures.category_points(tmp_path / "d.png", ["code", "docs"], values, {}, ylabel="loss", title="t",
                                     spread={"clm": [(4.07, 4.09), None]})
    assert (tmp_path / "d.png").stat().st_size > 0
    (c0, c1), (d0, d1) = limits["code"], limits["docs"]
    assert c0 < 4.04 and 4.09 < c1 < 4.2 and d0 > 7.0 and d1 > 7.21


# ---------------------------------------------------------------- statistics over seeds (issue 12)


def _shift_run(d, dv: float, cpu_per_step: float | None = None):
    """Add ``dv`` to every loss of a written run and, optionally, log cpu_s = cpu_per_step * step."""
    lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    for r in lines:
        for k in list(r):
            if k == M.VAL_LOSS or k.startswith(M.VAL_LOSS_DOMAIN_PREFIX) or k == M.TRAIN_LOSS:
                r[k] += dv
        if cpu_per_step is not None:
            r[M.CPU_S] = cpu_per_step * r[M.STEP]
        if M.FLOPS_EXECUTED in r:
            r[M.FLOPS_DENSE] = FLOPS_PER_STEP * r[M.STEP]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return d


def _study(root, seeds, shifts):
    """clm, eslm-entropy and random (alpha 0.1) runs for each seed; shifts[method](seed) -> loss offset."""
    runs = []
    for s in seeds:
        for m in ("clm", "eslm-entropy", "random"):
            cpu = {"clm": 0.5, "eslm-entropy": 0.6, "random": 0.45}[m]
            runs.append(_shift_run(make_run(root, f"{m}-s{s}", m, s), shifts[m](s), cpu))
    return runs


def test_report_with_five_seeds_has_intervals_paired_verdicts_and_controls(tmp_path):
    # eslm is 0.05 nats better than clm at every seed (plus seed noise it shares with clm: a paired effect),
    # random equals clm; per-seed offsets of +-0.1 make the unpaired intervals wide
    noise = {1: 0.1, 2: -0.1, 3: 0.05, 4: -0.05, 5: 0.0}
    jitter = {1: 0.002, 2: -0.001, 3: 0.0, 4: 0.001, 5: -0.002}
    shifts = {"clm": lambda s: noise[s] + 0.1, "eslm-entropy": lambda s: noise[s] + 0.05 + jitter[s],
              "random": lambda s: noise[s] + 0.1 - jitter[s]}
    runs = _study(tmp_path / "r", [1, 2, 3, 4, 5], shifts)
    s = report.build_report([str(p) for p in runs], tmp_path / "rep", target_loss="baseline")
    g = {x["label"]: x for x in s["groups"]}
    assert s["baseline"] == "clm" and s["time_key"] == M.CPU_S
    fin = g["clm"]["final_val_loss"]
    assert fin["count"] == 5 and fin["ci_half_width"] > 0.05  # unpaired: wide
    comp = {c["group"]: c for c in s["comparisons"]}
    d = comp["eslm-entropy"]["losses"]["final validation loss"]
    # ESLM's synthetic curve is 0.1 below CLM's base plus the shifts: -0.1 + (-0.05) + jitter
    assert d["n"] == 5 and d["mean"] == pytest.approx(-0.15, abs=1e-9) and d["hi"] < 0
    assert d["half_width"] < 0.01  # paired: narrow
    assert comp["eslm-entropy"]["verdicts"][0].startswith("final validation loss lower than clm by 0.1500")
    assert any(v.startswith("reaches the target with") and "less paper-FLOPs than clm" in v
               for v in comp["eslm-entropy"]["verdicts"])
    # the control: random at the same alpha, paired too
    ctrl = {c["group"]: c for c in s["controls"]}
    assert ctrl["eslm-entropy"]["against"] == "random"
    # both FLOPs conventions and CPU time, side by side
    tt = g["eslm-entropy"]["to_target"]
    assert {"flops_paper", "flops_executed", "tokens", "time_s"} <= set(tt)
    assert tt["time_s"]["key"] == M.CPU_S
    assert any("paper-FLOPs per token seen" in x for x in s["flops_gaps"])
    # executed FLOPs per step in CLM steps: the synthetic runs execute exactly their dense FLOPs
    assert g["clm"]["step_cost_vs_clm"]["mean"] == pytest.approx(1.0)
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert md.startswith("# eslm report\n") and "## Summary\n\n| group | n | final val loss" in md
    assert "reaches the target with" in md
    html = (tmp_path / "rep" / "index.html").read_text()
    assert "Verdicts" in html and "flops_executed to target" in html and "CPU s" in html
    assert html.count("n = 5 per group") == 1 and "(n=" not in html  # the seeds said once, in the header


def test_report_with_one_seed_says_no_interval_once(tmp_path, capsys):
    """A one-seed study's report says once that nothing has an interval (summary.md, index.html, the printed
    verdicts), and no cell, verdict or the primary line repeats it."""
    shifts = {"clm": lambda s: 0.0, "eslm-entropy": lambda s: 0.0, "random": lambda s: 0.0}
    runs = _study(tmp_path / "r", [1], shifts)
    out = tmp_path / "rep"
    s = report.build_report([str(p) for p in runs], out, primary=["eslm-entropy", "random"])
    note = "One seed per group: no number in this report has an interval"
    assert s["one_seed"] is True
    verdicts = [v for c in s["comparisons"] + s["controls"] for v in c["verdicts"]] + [s["primary"]["primary_verdict"]]
    assert len(verdicts) > 6 and not any("n=1" in v or "interval" in v for v in verdicts), verdicts
    assert s["primary"]["primary_verdict"].endswith("final validation loss: +0.0000 nats vs random")
    page = (out / "index.html").read_text()
    assert page.count(note) == 1 and page.index(note) < page.index("<h2>Primary comparison</h2>")
    assert "n=1" not in page and "no interval" not in page
    md = (out / "summary.md").read_text()
    lines = md.splitlines()
    # after the header (as on the page): the note once, then the primary line, then the verdict table
    note_at = next(i for i, x in enumerate(lines) if x.startswith("**One seed per group**: no number in this "
                                                                   "report has an interval"))
    assert lines[0].startswith("# eslm report") and lines[note_at + 2] == f"**{s['primary']['primary_verdict']}**"
    assert lines.index("## Verdicts") == note_at + 4
    assert md.count("One seed per group") == 1 and "n=1" not in md and "no interval" not in md, md
    report.print_summary(s, out)
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == s["primary"]["primary_verdict"]
    assert printed.count(note) == 1 and "n=1" not in printed and "no interval" not in printed, printed


def test_a_one_pair_verdict_in_a_report_with_more_seeds_says_n_1(tmp_path):
    """Only a report whose groups all have one seed drops the words: beside groups with two seeds, a group with
    one run still reads "(n=1, no interval)" in its verdicts and cells, and no one-seed note is shown."""
    shifts = {"clm": lambda s: 0.0, "eslm-entropy": lambda s: 0.0, "random": lambda s: 0.0}
    runs = [p for p in _study(tmp_path / "r", [1, 2], shifts) if p.name != "eslm-entropy-s2"]
    s = report.build_report([str(p) for p in runs], tmp_path / "rep")
    assert s["one_seed"] is False
    c = {x["group"]: x for x in s["comparisons"]}
    assert all(v.endswith("(n=1, no interval)") for v in c["eslm-entropy"]["verdicts"])
    assert not any("n=1" in v for v in c["random"]["verdicts"])
    page = (tmp_path / "rep" / "index.html").read_text()
    # the verdict sentences say n=1; the cells say only that they have no interval (the seeds: once, in the header)
    assert "One seed per group" not in page and "(n=1, no interval)" in page
    assert "<small>(no interval)</small>" in page and "<small>(n=" not in page
    assert "One seed per group" not in (tmp_path / "rep" / "summary.md").read_text()


def test_baseline_option_and_its_errors(tmp_path):
    shifts = {m: (lambda s: 0.0) for m in ("clm", "eslm-entropy", "random")}
    runs = _study(tmp_path / "r", [1, 2], shifts)
    s = report.build_report([str(p) for p in runs], tmp_path / "rep", baseline="random")
    assert s["baseline"] == "random" and {c["against"] for c in s["comparisons"]} == {"random"}
    with pytest.raises(ESLMError, match="no group 'nope'"):
        report.build_report([str(p) for p in runs], tmp_path / "rep2", baseline="nope")


def test_load_warning_when_compared_runs_ran_under_different_loads(tmp_path):
    a = make_run(tmp_path, "a", "clm", 1)
    b = make_run(tmp_path, "b", "eslm-entropy", 1)
    for d, load in ((a, 0.3), (b, 6.0)):
        lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        for r in lines:
            if r[M.KIND] == M.KIND_TRAIN:
                r[M.LOAD_AVG_1M] = load
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    s = report.build_report([str(a), str(b)], tmp_path / "rep")
    assert any("different machine loads" in w for w in s["warnings"])
    # without cpu_s the time axis falls back to wall-clock and says so
    assert s["time_key"] == M.ELAPSED_S


def test_an_eval_json_that_is_not_utf8_is_one_warning(tmp_path):
    # issue 47: non-UTF-8 bytes in eval/*.json stopped the report with a UnicodeDecodeError traceback
    d = make_run(tmp_path, "r", "clm", 1)
    (d / "eval").mkdir(exist_ok=True)
    (d / "eval" / "step_0000160.json").write_bytes(b'{"step": 160, "tasks": {"t\xff": {}}}')
    run = load_run(d)
    assert run.downstream == []
    assert [w for w in run.warnings if "step_0000160.json" in w] == [
        f"{d / 'eval' / 'step_0000160.json'}: not UTF-8 text (byte 0xff at position 26); ignored"]
