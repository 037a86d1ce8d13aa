"""lm-eval tasks on our model: which tasks at how many shots (the paper's suite by default), one harness call per
shot count, and each task's headline metric. See docs/evaluation.md.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import torch

from eslm.errors import ConfigError, DataError
from eslm.eval.adapter import lm_class

# The paper's downstream suite: task -> number of few-shot examples.
PAPER_TASKS: dict[str, int] = {
    "arc_easy": 0, "lambada_openai": 5, "sciq": 5, "hellaswag": 5, "triviaqa": 1,
    "copa": 5, "multirc": 5, "openbookqa": 5, "piqa": 5,
}
# The headline metric of a task: normalised accuracy where the task provides it, else accuracy, else exact
# match; perplexity-only tasks (rolling loglikelihood) report word perplexity, then bits per byte.
METRIC_PREFERENCE = ("acc_norm", "acc", "exact_match", "word_perplexity", "bits_per_byte", "byte_perplexity",
                     "perplexity")


def parse_tasks(specs: list[str] | None, num_fewshot: int | None) -> dict[str, int]:
    """Task name -> shots. ``specs``: names or ``name:K`` (comma or space separated). Shots come from
    ``:K``, else ``--num-fewshot``, else the paper's count for that task, else 0. None -> the paper's suite."""
    if not specs:
        return {t: (num_fewshot if num_fewshot is not None else k) for t, k in PAPER_TASKS.items()}
    out: dict[str, int] = {}
    for item in (s for spec in specs for s in spec.split(",")):
        name, _, shots = item.strip().partition(":")
        if not name:
            continue
        if shots and not shots.isdigit():
            raise ConfigError(f"expected TASK or TASK:SHOTS with integer SHOTS, found {item!r}; e.g. piqa:5")
        out[name] = int(shots) if shots else (num_fewshot if num_fewshot is not None else PAPER_TASKS.get(name, 0))
    return out


def task_manager(include_path: str | None, names: list[str]):
    """A TaskManager that knows ``names``. Indexing lm-eval's ~200 built-in task folders takes seconds,
    so a task set found entirely under ``include_path`` is loaded without the built-ins."""
    from lm_eval.tasks import TaskManager

    if include_path:
        if not Path(include_path).is_dir():
            raise ConfigError(f"expected --include-path to be a directory of task YAMLs, found none at {include_path}")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(n in local.all_tasks for n in names):
            return local
    tm = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [n for n in names if n not in tm.all_tasks]
    if unknown:
        raise ConfigError(f"expected lm-eval task names, found unknown {unknown}; "
                          "see 'lm_eval --tasks list' or add task YAMLs with --include-path")
    return tm


def headline_metric(task_results: dict) -> tuple[str | None, float | None, float | None]:
    """(metric, value, stderr) of one task's lm-eval results (keys like ``acc_norm,none``); stderr None
    when lm-eval gives none (e.g. corpus perplexities)."""
    for metric in METRIC_PREFERENCE:
        for key, value in task_results.items():
            name, _, filt = key.partition(",")
            if name == metric and isinstance(value, (int, float)):
                se = task_results.get(f"{metric}_stderr,{filt}")
                se = float(se) if isinstance(se, (int, float)) and not math.isnan(se) else None
                return metric, float(value), se
    return None, None, None


def _plain(x):
    """JSON-safe copy of lm-eval's result values (numpy scalars, NaN -> None)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    return x if isinstance(x, (str, int, float, bool, type(None))) else str(x)


def evaluate(model, tokenizer, tasks: dict[str, int], *, limit: int | float | None = None, batch_size: int = 16,
             include_path: str | None = None, bootstrap_iters: int = 1000, seed: int = 0,
             progress: bool = False) -> dict:
    """Run lm-eval tasks (name -> shots) on our model. Returns {task: {num_fewshot, metric, value, stderr,
    n_samples, metrics}} with every metric of the task in ``metrics``."""
    tm = task_manager(include_path, list(tasks))
    lm = lm_class()(model=model, tokenizer=tokenizer, batch_size=batch_size, progress=progress)
    by_shots: dict[int, list[str]] = {}
    for name, k in tasks.items():
        by_shots.setdefault(k, []).append(name)
    out: dict[str, dict] = {}
    for shots, names in sorted(by_shots.items()):  # one harness call per shot count
        try:
            res = _run_harness(lm, tm, names, shots, limit=limit, bootstrap_iters=bootstrap_iters, seed=seed)
        except Exception as e:
            if any(w in f"{type(e).__name__}: {e}".lower() for w in ("offline", "connection", "couldn't reach", "hub",
                                                                      "resolve")):
                raise DataError(f"expected the datasets of {names} to be reachable or cached, found them "
                                f"unavailable ({type(e).__name__}); run once online or set HF_DATASETS_CACHE to a "
                                "cache holding them") from None
            raise
        for name, metrics in res["results"].items():
            metric, value, se = headline_metric(metrics)
            out[name] = {"num_fewshot": int(res.get("n-shot", {}).get(name, shots)), "metric": metric,
                         "version": _plain(res.get("versions", {}).get(name)),
                         "task_config": _plain(res.get("configs", {}).get(name)),
                         "value": value, "stderr": se,
                         "n_samples": _plain(res.get("n-samples", {}).get(name, {}).get("effective")),
                         "metrics": _plain({k: v for k, v in metrics.items() if k != "alias"})}
    return {name: out[name] for name in tasks if name in out} | out  # the order asked for; groups last


def _run_harness(lm, tm, names: list[str], shots: int, *, limit, bootstrap_iters: int, seed: int) -> dict:
    """lm-eval's results dict for ``names`` at ``shots``, through ``evaluator.evaluate`` with the seeding and
    few-shot settings ``simple_evaluate`` applies, except that the shot count asked for always wins
    (``simple_evaluate`` would also run ``pip list`` in a subprocess on every call)."""
    from lm_eval import evaluator

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    loaded = tm.load(names)
    for task in loaded["tasks"].values():
        task.set_config(key="num_fewshot", value=shots)
        task.set_fewshot_seed(seed=seed)
    return evaluator.evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=bootstrap_iters,
                              log_samples=False)
