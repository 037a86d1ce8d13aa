"""The markdown tables of ``eslm eval``: one checkpoint's results, and a run's checkpoints against FLOPs."""

from __future__ import annotations

from eslm import metrics as M

FRACTION_METRICS = ("acc_norm", "acc", "exact_match")  # higher is better, in [0, 1]; 4 decimals as in the paper


def _fmt(metric: str | None, value: float | None, se: float | None) -> str:
    """The paper's cell: ``0.3682 (0.0099)``, value and one standard error as fractions."""
    if value is None:
        return "n/a"
    digits = 4 if metric in FRACTION_METRICS else 2
    return f"{value:.{digits}f} ({se:.{digits}f})" if se is not None else f"{value:.{digits}f}"


def _row(task: str, r: dict, last) -> str:
    """| task | shots | metric | value (stderr) | last |"""
    return f"| {task} | {r['num_fewshot']} | {r['metric']} | {_fmt(r['metric'], r['value'], r['stderr'])} | {last} |"


_NOTE = "Value (one standard error, from lm-eval); accuracy and exact match as fractions, as in the paper."


def checkpoint_table(record: dict) -> str:
    """Markdown table of one checkpoint's results: one row per task."""
    lines = [f"# lm-eval: {record['source']} (step {record['step']})", "",
             "| task | shots | metric | value (stderr) | n |", "|---|---:|---|---:|---:|"]
    for name, r in record["tasks"].items():
        lines.append(_row(name, r, r["n_samples"] if r["n_samples"] is not None else ""))
    return "\n".join(lines + ["", _NOTE]) + "\n"


def best_per_task(records: list[dict]) -> dict[str, dict]:
    """Task -> the best result over checkpoints (highest accuracy / lowest perplexity) plus its step,
    the paper's "best observed accuracy during training"."""
    best: dict[str, dict] = {}
    for r in records:
        for t, res in r["tasks"].items():
            if res["value"] is None:
                continue
            lower_better = res["metric"] not in FRACTION_METRICS
            cur = best.get(t)
            if cur is None or (res["value"] < cur["value"] if lower_better else res["value"] > cur["value"]):
                best[t] = {**res, "step": r["step"]}
    return best


def summary_table(records: list[dict]) -> str:
    """Markdown across checkpoints of a run: one row per step with its FLOPs (accuracy against FLOPs),
    then the best result per task in the paper's layout (task, shots, value (stderr), step)."""
    records = sorted(records, key=lambda r: (r["step"] is None, r["step"] or 0))
    tasks = list(dict.fromkeys(t for r in records for t in r["tasks"]))
    head = ["step", M.FLOPS_PAPER, M.FLOPS_EXECUTED] + [
        f"{t} ({next(r['tasks'][t]['metric'] for r in records if t in r['tasks'])})" for t in tasks]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in records:
        cells = [str(r["step"]), _sci(r.get(M.FLOPS_PAPER)), _sci(r.get(M.FLOPS_EXECUTED))]
        cells += [_fmt(r["tasks"][t]["metric"], r["tasks"][t]["value"], r["tasks"][t]["stderr"])
                  if t in r["tasks"] else "" for t in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Best during training:", "", "| task | shots | metric | value (stderr) | step |",
              "|---|---:|---|---:|---:|"]
    lines += [_row(t, b, b["step"]) for t, b in best_per_task(records).items()]
    return "\n".join(lines + ["", _NOTE]) + "\n"


def _sci(x) -> str:
    return f"{x:.3e}" if isinstance(x, (int, float)) else ""
