"""Downstream (``eslm eval``) results of ``eslm report``: the latest result file of each run, aggregated over
the seeds of a group."""

from __future__ import annotations

import math
import statistics

from eslm.analysis.rundir import Group, Run, is_number

PERCENT_METRICS = ("acc", "exact_match", "em", "f1")


def is_percent(metric: str) -> bool:
    """Accuracy-like metrics (shown x100 in the table); perplexities etc. are shown as they are."""
    return str(metric).split(",")[0].startswith(PERCENT_METRICS)


def run_downstream(run: Run) -> dict:
    """task -> {metric, value, stderr, num_fewshot} of the run's latest downstream result file."""
    tasks = run.downstream[-1]["tasks"] if run.downstream else {}
    return {task: {"metric": res.get("metric", "?"), "value": float(res["value"]),
                   "stderr": float(res["stderr"]) if is_number(res.get("stderr")) else None,
                   "num_fewshot": res.get("num_fewshot")}
            for task, res in tasks.items() if isinstance(res, dict) and is_number(res.get("value"))}


def group_downstream(group: Group) -> dict:
    """task -> mean value over the seeds that have it; stderr = sqrt(sum stderr_i^2) / k (mean of k
    independent estimates); min/max over seeds."""
    per_run = [run_downstream(r) for r in group.runs]
    tasks = sorted(set().union(*per_run)) if per_run else []
    out = {}
    for t in tasks:
        rows = [d[t] for d in per_run if t in d]
        errs = [r["stderr"] for r in rows]
        se = math.sqrt(sum(e * e for e in errs)) / len(rows) if all(e is not None for e in errs) else None
        vals = [r["value"] for r in rows]
        out[t] = {"metric": rows[0]["metric"], "num_fewshot": rows[0]["num_fewshot"], "k": len(rows),
                  "value": statistics.fmean(vals), "stderr": se, "min": min(vals), "max": max(vals)}
    return out
