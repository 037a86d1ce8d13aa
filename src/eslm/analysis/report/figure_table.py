"""The figures of ``eslm report``: ``FIGURES``, one table that both drawing (``make_figures``) and the HTML page
iterate, so a figure is declared once. A new figure is one ``Figure`` line here plus its draw function;
matplotlib itself is called only in ``eslm.analysis.figures``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

from eslm import metrics as M
from eslm.analysis import figures
from eslm.analysis.report.curves import domains_of, group_curve, series
from eslm.analysis.rundir import Group


@dataclass(frozen=True)
class Scene:
    """What every draw function reads: the groups, the summary, one colour per group label."""

    groups: list[Group]
    summary: dict
    colors: dict[str, str]


@dataclass(frozen=True)
class Figure:
    id: str  # file <id>.png, key of summary["figures"]
    section: str  # the <h2> of the HTML page it appears under (consecutive figures share it)
    alt: str  # alt text (a figure without data is not drawn, and the page leaves it out)
    draw: Callable[[Path, Scene], bool]  # writes the PNG at the path; False when there is nothing to draw


def _curve_set(groups, records_of, x_key, y_key) -> list[dict]:
    return [c for g in groups if (c := group_curve(g, records_of, x_key, y_key)) is not None]


_eval, _train = attrgetter("eval"), attrgetter("train")  # a run's records


def _loss_curves(axis: Callable[[dict], tuple[str, str]], logx: bool) -> Callable[[Path, Scene], bool]:
    """Validation loss of every group against the x axis ``axis(summary) -> (metric, words)``."""
    def draw(path: Path, sc: Scene) -> bool:
        x_key, xlabel = axis(sc.summary)
        s = _curve_set(sc.groups, _eval, x_key, M.VAL_LOSS)
        if not s:
            return False
        figures.curves(path, s, sc.colors, xlabel=xlabel, ylabel="validation loss",
                       title=f"Validation loss vs {xlabel.split(' (')[0]}", logx=logx, logy=True,
                       hline=sc.summary["target_loss"])
        return True
    return draw


def _to_target_bars(what: str, ylabel: Callable[[dict], str]) -> Callable[[Path, Scene], bool]:
    """One bar per group: the cost ``what`` (a key of a group's to_target) to reach the target loss."""
    def draw(path: Path, sc: Scene) -> bool:
        label, bars = ylabel(sc.summary), []
        for g in sc.summary["groups"]:
            t = g["to_target"][what]
            ci = t["ci_lo"] is not None  # whisker: the 95% interval over seeds (min..max would hide n)
            bars.append({"label": g["label"], "mean": t["mean"], "lo": t["ci_lo"] if ci else t["min"],
                         "hi": t["ci_hi"] if ci else t["max"], "reached": t["reached"], "n": t["n"]})
        figures.target_bars(path, bars, sc.colors, ylabel=label,
                            title=f"{label.split(' (')[0]} to reach validation loss {sc.summary['target_loss']:.4g}")
        return True
    return draw


def _domain_final(path: Path, sc: Scene) -> bool:
    domains, groups = sc.summary["domains"], sc.summary["groups"]
    if not domains:
        return False
    values = {g["label"]: [g["final_val_loss_domain"][d]["mean"] for d in domains] for g in groups}
    finals = {g["label"]: [g["final_val_loss_domain"][d] for d in domains] for g in groups}
    spread = {lab: [(a["min"], a["max"]) if a["count"] > 1 else None for a in f] for lab, f in finals.items()}
    figures.category_points(path, domains, values, sc.colors, spread=spread,
                            ylabel="final validation loss", title="Final validation loss per domain (own y range each)")
    return True


def _domain_curves(path: Path, sc: Scene) -> bool:
    domains = sc.summary["domains"]
    if not domains:
        return False
    panel = {d: _curve_set(sc.groups, _eval, sc.summary["flops_key"], M.val_loss_key(d)) for d in domains}
    figures.panels(path, panel, sc.colors, xlabel=f"FLOPs ({sc.summary['flops_convention']})",
                   ylabel="val loss", title="Validation loss per domain vs FLOPs", logx=True, logy=True)
    return True


def varies(curve: dict) -> bool:
    """A curve whose values move over training (its mean or its band); a constant one is said once in the header
    (alpha, and the kept fraction 1 - alpha of a fixed alpha), not drawn as a flat line."""
    values = curve["mean"] + curve["lo"] + curve["hi"]
    return max(values) - min(values) > 1e-9 * max(1.0, max(abs(v) for v in values))


def _selection(path: Path, sc: Scene) -> bool:
    """Kept fraction (overall and per domain) and alpha over training: only the panels where some group's curve
    moves (a fixed alpha keeps a constant fraction: the header says it)."""
    keys = [("kept fraction", M.KEPT_FRAC), ("alpha", M.ALPHA)]
    keys += [(f"kept fraction: {d}", M.kept_frac_key(d))
             for d in domains_of([r for g in sc.groups for r in g.runs], M.KEPT_FRAC_DOMAIN_PREFIX, _train)]
    panel = {name: _curve_set(sc.groups, _train, M.STEP, key) for name, key in keys}
    panel = {k: v for k, v in panel.items() if any(varies(c) for c in v)}
    if not panel:
        return False
    figures.panels(path, panel, sc.colors, xlabel="optimizer step", ylabel="value",
                   title="Token selection over training (selective methods)", logx=False, logy=False,
                   ylim=(0.0, 1.02))
    return True


def _training_curve(x: str, y: str, xlabel: str, ylabel: str, title: str, log: bool):
    """A figure of a training record's ``y`` against ``x``, one line per group (mean over seeds)."""
    def draw(path: Path, sc: Scene) -> bool:
        s = _curve_set(sc.groups, _train, x, y)
        if not s:
            return False
        figures.curves(path, s, sc.colors, xlabel=xlabel, ylabel=ylabel, title=title, logx=log, logy=log)
        return True
    return draw


# the training loss over every token of a step (comparable across methods; the loss a selective method optimises
# covers its kept tokens only) against tokens seen; the throughput (tokens per second of step time) over training
_train_loss = _training_curve(M.TOKENS_SEEN, M.TRAIN_LOSS_ALL, "tokens seen", "training loss (all tokens of the step)",
                         "Training loss vs tokens", True)
_throughput = _training_curve(M.STEP, M.TOKENS_PER_S, "optimizer step", "tokens / s", "Training throughput", False)


def _alpha_per_run(path: Path, sc: Scene) -> bool:
    """Adaptive alpha (Ada-ESLM): every run's alpha over training, one line per seed, one panel per group whose
    alpha moved in some run. Does the path repeat across seeds?"""
    panel = {}
    for g in sc.groups:
        lines = []
        for r in g.runs:
            steps, _, alphas = series(r.train, M.STEP, M.ALPHA)
            if len(set(alphas)) > 1:
                lines.append({"label": f"seed {r.seed}", "n": 1, "x": steps, "mean": alphas, "lo": alphas,
                              "hi": alphas})
        if lines:
            panel[g.label] = lines
    if not panel:
        return False
    figures.panels(path, panel, {}, xlabel="optimizer step", ylabel="alpha", logx=False, logy=False,
                   title="alpha of every run (adaptive alpha)")
    return True


def _differences(path: Path, sc: Scene) -> bool:
    """The paired difference of the validation loss against the baseline and against the random-drop control
    over training: does an effect grow with training?"""
    d = sc.summary["differences_over_training"]
    base = sc.summary["baseline"]
    panel = {}
    if d["baseline"]:
        panel[f"minus {base} (baseline)"] = d["baseline"]
    if d["control"]:
        panel["minus random at the same alpha"] = d["control"]
    if not panel:
        return False
    figures.panels(path, panel, sc.colors, xlabel="tokens seen", ylabel="Δ validation loss (nats)", logx=False,
                   logy=False, hline=0.0, title="Paired difference over training: mean and 95% interval over seeds")
    return True


def _kept_dropped(path: Path, sc: Scene) -> bool:
    """Mean score of the kept and the dropped tokens per selective group (groups that log alpha: a score-based
    selector; the random control has no score) over training."""
    per_group = {}
    for g in sc.groups:
        if not any(M.ALPHA in rec for r in g.runs for rec in r.train):
            continue
        kept = group_curve(g, _train, M.STEP, M.CVAR)  # the CVaR is the mean score of the kept tokens
        dropped = group_curve(g, _train, M.STEP, M.SCORE_DROPPED_MEAN)
        if kept and dropped:
            per_group[g.label] = [{**kept, "label": "kept", "color": g.label},
                                  {**dropped, "label": "dropped", "color": g.label, "ls": "--"}]
    if not per_group:
        return False
    figures.panels(path, per_group, sc.colors, xlabel="optimizer step", ylabel="mean score", logx=False, logy=False,
                   title="Mean score of kept (solid) and dropped (dashed) tokens")
    return True


_LOSS, _COST = "Validation loss", "Cost to reach the target loss (figures)"
FIGURES: tuple[Figure, ...] = (
    Figure("loss_vs_flops", _LOSS, "validation loss vs FLOPs (log-log)",
           _loss_curves(lambda s: (s["flops_key"], f"training FLOPs ({s['flops_convention']} convention)"), True)),
    Figure("loss_vs_tokens", _LOSS, "validation loss vs tokens", _loss_curves(lambda s: (M.TOKENS_SEEN, "tokens seen"), True)),
    Figure("loss_vs_time", _LOSS, "validation loss vs wall-clock",
           _loss_curves(lambda s: (s["time_key"], s["time_words"]), False)),
    Figure("training_curve", "Training", "training loss vs tokens", _train_loss),
    Figure("throughput", "Training", "training throughput (tokens/s) over training", _throughput),
    Figure("difference_over_training", "Paired differences over training",
           "paired difference vs the baseline and vs random over training", _differences),
    Figure("flops_to_target", _COST, "paper FLOPs to target",
           _to_target_bars(M.FLOPS_PAPER, lambda s: "FLOPs (paper convention)")),
    Figure("executed_to_target", _COST, "executed FLOPs to target",
           _to_target_bars(M.FLOPS_EXECUTED, lambda s: "FLOPs (executed)")),
    Figure("tokens_to_target", _COST, "tokens to target", _to_target_bars("tokens", lambda s: "tokens seen")),
    Figure("time_to_target", _COST, "time to target", _to_target_bars("time_s", lambda s: s["time_words"])),
    Figure("domain_final", "Per-domain validation loss", "final loss per domain", _domain_final),
    Figure("domain_curves", "Per-domain validation loss", "per-domain curves", _domain_curves),
    Figure("selection", "Token selection", "kept fraction and alpha over training", _selection),
    Figure("kept_dropped_scores", "Token selection", "mean score of kept and dropped tokens over training",
           _kept_dropped),
    Figure("alpha_per_run", "Token selection", "alpha of every run over training (adaptive alpha)", _alpha_per_run),
)


def make_figures(out: Path, groups: list[Group], summary: dict) -> dict[str, str]:
    """Draw every figure of ``FIGURES`` that has data into ``out``; returns {figure id: file name} of those written."""
    scene = Scene(groups, summary, figures.color_map([g.label for g in groups]))
    # FIGURES read at call time: a figure added to the table is drawn without other edits
    return {fig.id: f"{fig.id}.png" for fig in FIGURES if fig.draw(out / f"{fig.id}.png", scene)}


def drawn(written: dict[str, str]) -> list[dict]:
    """The figures of ``FIGURES`` that were drawn (``written``: {id: file}), in its order: {heading (its section,
    where one begins), alt, src}. A figure without data is left out, and so is a section without a drawn figure."""
    out: list[dict] = []
    section = None
    for fig in FIGURES:
        if fig.id in written:
            out.append({"heading": fig.section if fig.section != section else None, "alt": fig.alt,
                        "src": written[fig.id]})
            section = fig.section
    return out
