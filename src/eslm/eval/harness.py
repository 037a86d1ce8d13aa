"""lm-evaluation-harness bridge: the work of ``eslm eval`` (its command: eslm/cli/eval.py) and an lm-eval ``LM``
adapter for our model.

Why an adapter and not "export to transformers, then the harness's HF model": the adapter evaluates
exactly the module we trained (no conversion step, no vocabulary trimming, the padded rows stay in the
softmax just as in training and validation loss), uses our own tokenizers (the byte tokenizer has no
transformers equivalent), and needs no transformers at all. The price is three request types written here;
they follow the harness's HF model (same context/continuation split, same rolling windows) so numbers are
comparable. See docs/evaluation.md.

Requests, on token ids (our model has no KV cache and absolute positions):

* ``loglikelihood(context, continuation)``: one forward over ``context + continuation`` (left-truncated to
  ``block_size + 1`` tokens), sum of the continuation's log-probabilities and whether greedy decoding
  would produce it. Batched with right padding: under causal attention a real position never sees the
  padding that follows it.
* ``loglikelihood_rolling(text)``: the harness's disjoint rolling windows of ``block_size`` tokens, the
  first conditioned on end-of-text; the sum over windows.
* ``generate_until(context, gen_kwargs)``: greedy decoding (sampling options are ignored), batched with
  right padding too: each step reads each row's logits at its own last real position.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from eslm import metrics as M
from eslm.errors import CheckpointError, ConfigError, DataError, OwnershipError
from eslm.files import atomic_write, ensure_dir
from eslm.data.tokenizers import get_tokenizer
from eslm.model.loading import list_evaluable, load_model

# The paper's downstream suite: task -> number of few-shot examples.
PAPER_TASKS: dict[str, int] = {
    "arc_easy": 0, "lambada_openai": 5, "sciq": 5, "hellaswag": 5, "triviaqa": 1,
    "copa": 5, "multirc": 5, "openbookqa": 5, "piqa": 5,
}
# The headline metric of a task: normalised accuracy where the task provides it, else accuracy, else exact
# match; perplexity-only tasks (rolling loglikelihood) report word perplexity, then bits per byte.
METRIC_PREFERENCE = ("acc_norm", "acc", "exact_match", "word_perplexity", "bits_per_byte", "byte_perplexity",
                     "perplexity")
FRACTION_METRICS = ("acc_norm", "acc", "exact_match")  # higher is better, in [0, 1]; 4 decimals as in the paper
EVAL_FORMAT = "eslm-eval-v1"


# ------------------------------------------------------------------------------ scoring on token ids


def _pad_right(seqs: list[list[int]], device) -> torch.Tensor:
    """(B, max_len) int64, zeros after each row's tokens."""
    out = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out.to(device)


@torch.no_grad()
def score_continuations(model, pairs: list[tuple[list[int], list[int]]], batch_size: int = 16,
                        progress: bool = False) -> list[tuple[float, bool]]:
    """Log-likelihood of each continuation given its context, and whether it is the greedy one.

    ``pairs``: (context ids, continuation ids), context non-empty. Returns (sum of log-probs in nats,
    is_greedy) per pair, in input order. Logits are computed only at continuation positions.
    """
    from tqdm import tqdm

    block = model.config.block_size
    device = next(model.parameters()).device
    # Longest first: the batch shape is set by its first row, and out-of-memory shows up at once.
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    results: list[tuple[float, bool] | None] = [None] * len(pairs)
    for start in tqdm(range(0, len(order), batch_size), disable=not progress, desc="loglikelihood"):
        idxs = order[start : start + batch_size]
        inputs, targets = [], []
        for i in idxs:
            ctx, cont = pairs[i]
            full = (ctx + cont)[-(block + 1):]
            inputs.append(full[:-1])
            targets.append(cont[-(len(full) - 1):])  # a continuation longer than the window is cut too
        hidden = model(_pad_right(inputs, device))
        for row, i in enumerate(idxs):
            n_in, tgt = len(inputs[row]), targets[row]
            h = hidden[row, n_in - len(tgt) : n_in]  # positions predicting the continuation
            logp = model.logits(h).float().log_softmax(-1)
            t = torch.tensor(tgt, device=device)
            ll = logp.gather(1, t[:, None]).sum().item()
            results[i] = (ll, bool((logp.argmax(-1) == t).all()))
    return results  # type: ignore[return-value]


def rolling_windows(tokens: list[int], eot_id: int, block_size: int) -> list[tuple[list[int], list[int]]]:
    """The harness's disjoint rolling windows: every token predicted once, with up to block_size context."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    return [make_disjoint_window(w) for w in get_rolling_token_windows(
        token_list=tokens, prefix_token=eot_id, max_seq_len=block_size, context_len=1)]


@torch.no_grad()
def greedy_generate(model, contexts: list[list[int]], max_new_tokens: list[int], stop_ids: set[int],
                    batch_size: int = 16) -> list[list[int]]:
    """Greedy continuation ids per context (without the context); a row stops at a stop id (not
    included) or after its max_new_tokens. Contexts longer than block_size use their last tokens."""
    block = model.config.block_size
    device = next(model.parameters()).device
    out: list[list[int]] = [[] for _ in contexts]
    for start in range(0, len(contexts), batch_size):
        active = list(range(start, min(start + batch_size, len(contexts))))
        while active:
            windows = [(contexts[i] + out[i])[-block:] for i in active]
            hidden = model(_pad_right(windows, device))
            last = torch.stack([hidden[r, len(w) - 1] for r, w in enumerate(windows)])
            nxt = model.logits(last).argmax(-1).tolist()
            still = []
            for i, tok in zip(active, nxt):
                if tok in stop_ids:
                    continue
                out[i].append(tok)
                if len(out[i]) < max_new_tokens[i]:
                    still.append(i)
            active = still
    return out


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of (context, continuation) as the harness's HF model splits them: trailing spaces of the
    context move to the continuation, the pair is encoded whole and split at the context's length, and an
    empty context becomes end-of-text."""
    if context == "":
        return [tokenizer.eot_id], tokenizer.encode(continuation)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return ctx, whole[len(ctx):]


def cut_at_stop(text: str, until: list[str]) -> str:
    """``text`` up to the first occurrence of any stop string."""
    cut = len(text)
    for s in until:
        if s and (k := text.find(s)) != -1:
            cut = min(cut, k)
    return text[:cut]


# ------------------------------------------------------------------------------ the lm-eval adapter

_LM_CLASS = None


def lm_class():
    """The registered lm-eval ``LM`` subclass ``eslm`` (built on first use: lm_eval is optional)."""
    global _LM_CLASS
    if _LM_CLASS is not None:
        return _LM_CLASS
    from lm_eval.api.model import LM

    class ESLMLM(LM):
        """lm-eval adapter around an eslm ``GPT`` and tokenizer (``.encode``, ``.decode``, ``.eot_id``)."""

        def __init__(self, model=None, tokenizer=None, batch_size: int | str = 16, progress: bool = False,
                     pretrained: str | None = None, run_dir: str | None = None, checkpoint: str | None = None,
                     device: str | None = None, **_):
            super().__init__()
            if model is None:  # by name from lm-eval's CLI: --model eslm --model_args run_dir=PATH (eslm lm-eval)
                path = run_dir or checkpoint or pretrained
                if not path:
                    raise ConfigError("expected --model_args run_dir=PATH (a run directory, checkpoint, snapshot "
                                      "or HF GPT-2 directory), found no path")
                model, info = load_model(path, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
                tokenizer = resolve_tokenizer(tokenizer if isinstance(tokenizer, str) else info.get("tokenizer"))
            self.model, self.tok = model.eval(), tokenizer
            self.batch_size_ = int(batch_size) if str(batch_size).isdigit() else 16  # lm-eval may pass "auto"
            self.progress = progress

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            pairs = [encode_pair(self.tok, *r.args) for r in requests]
            res = score_continuations(self.model, pairs, self.batch_size_, self.progress and not disable_tqdm)
            for r, out in zip(requests, res):
                self.cache_hook.add_partial("loglikelihood", r.args, out)
            return res

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            block, lls = self.model.config.block_size, []
            for r in requests:
                windows = rolling_windows(self.tok.encode(r.args[0]), self.tok.eot_id, block)
                scores = score_continuations(self.model, windows, self.batch_size_) if windows else []
                lls.append(sum(s for s, _ in scores))
                self.cache_hook.add_partial("loglikelihood_rolling", r.args, lls[-1])
            return lls

        def generate_until(self, requests, disable_tqdm: bool = False):
            block, ctxs, maxes, untils = self.model.config.block_size, [], [], []
            for r in requests:
                context, kw = r.args[0], dict(r.args[1] or {})
                until = kw.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                max_new = int(kw.get("max_gen_toks", 256))
                ids = self.tok.encode(context) or [self.tok.eot_id]
                ctxs.append(ids[-max(1, block - max_new):])  # leave room to generate, as HF's model does
                maxes.append(max_new)
                untils.append(until)
            gens = greedy_generate(self.model, ctxs, maxes, {self.tok.eot_id}, self.batch_size_)
            outs = [cut_at_stop(self.tok.decode(g), u) for g, u in zip(gens, untils)]
            for r, o in zip(requests, outs):
                self.cache_hook.add_partial("generate_until", r.args, o)
            return outs

    try:
        from lm_eval.api.registry import register_model

        register_model("eslm")(ESLMLM)
    except Exception:  # already registered (module reloaded) or a registry API change: the class still works
        pass
    _LM_CLASS = ESLMLM
    return ESLMLM


def resolve_tokenizer(name: str | None):
    """Our tokenizer by name (from the checkpoint); a clear error when the checkpoint does not say."""
    if not name:
        raise ConfigError("expected the checkpoint to name its tokenizer, found none; pass --tokenizer gpt2|byte")

    return get_tokenizer(name)


# ------------------------------------------------------------------------------ tasks and metrics


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


def _task_manager(include_path: str | None, names: list[str]):
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
    tm = _task_manager(include_path, list(tasks))
    lm = lm_class()(model=model, tokenizer=tokenizer, batch_size=batch_size, progress=progress)
    by_shots: dict[int, list[str]] = {}
    for name, k in tasks.items():
        by_shots.setdefault(k, []).append(name)
    out: dict[str, dict] = {}
    for shots, names in sorted(by_shots.items()):  # one harness call per shot count
        try:
            res = _run_harness(lm, tm, names, shots, limit=limit, bootstrap_iters=bootstrap_iters, seed=seed)
        except Exception as e:
            _reraise_offline(e, names)
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
    """lm-eval's results dict for ``names`` at ``shots``.

    Where the TaskManager can load tasks itself (lm-eval >= 0.4.12) this calls ``evaluator.evaluate``
    directly: ``simple_evaluate`` would add an environment report that runs ``pip list`` in a subprocess
    on every call (seconds each; we record our own environment in the run directory). The seeding and
    few-shot settings are those ``simple_evaluate`` applies, except that the shot count asked for always
    wins (``simple_evaluate`` keeps a task's own ``num_fewshot: 0``).
    """
    from lm_eval import evaluator

    if not hasattr(tm, "load"):
        return evaluator.simple_evaluate(
            model=lm, tasks=names, num_fewshot=shots, limit=limit, task_manager=tm, log_samples=False,
            bootstrap_iters=bootstrap_iters, random_seed=seed, numpy_random_seed=seed,
            torch_random_seed=seed, fewshot_random_seed=seed)
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    loaded = tm.load(names)
    for task in loaded["tasks"].values():
        task.set_config(key="num_fewshot", value=shots)
        task.set_fewshot_seed(seed=seed)
    return evaluator.evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=bootstrap_iters,
                              log_samples=False)


def _reraise_offline(e: Exception, names: list[str]) -> None:
    text = f"{type(e).__name__}: {e}".lower()
    if any(w in text for w in ("offline", "connection", "couldn't reach", "hub", "resolve")):
        raise DataError(f"expected the datasets of {names} to be reachable or cached, found them unavailable "
                        f"({type(e).__name__}); run once online or set HF_DATASETS_CACHE to a cache holding them") from None


# ------------------------------------------------------------------------------ output files


def _fmt(metric: str | None, value: float | None, se: float | None) -> str:
    """The paper's cell: ``0.3682 (0.0099)``, value and one standard error as fractions."""
    if value is None:
        return "n/a"
    digits = 4 if metric in FRACTION_METRICS else 2
    return f"{value:.{digits}f} ({se:.{digits}f})" if se is not None else f"{value:.{digits}f}"


_NOTE = "Value (one standard error, from lm-eval); accuracy and exact match as fractions, as in the paper."


def checkpoint_table(record: dict) -> str:
    """Markdown table of one checkpoint's results: one row per task."""
    lines = [f"# lm-eval: {record['source']} (step {record['step']})", "",
             "| task | shots | metric | value (stderr) | n |", "|---|---:|---|---:|---:|"]
    for name, r in record["tasks"].items():
        lines.append(f"| {name} | {r['num_fewshot']} | {r['metric']} | {_fmt(r['metric'], r['value'], r['stderr'])}"
                     f" | {r['n_samples'] if r['n_samples'] is not None else ''} |")
    return "\n".join(lines + ["", _NOTE]) + "\n"


def _task_order(records: list[dict]) -> list[str]:
    tasks: list[str] = []
    for r in records:
        tasks += [t for t in r["tasks"] if t not in tasks]
    return tasks


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
    tasks = _task_order(records)
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
    for t, b in best_per_task(records).items():
        lines.append(f"| {t} | {b['num_fewshot']} | {b['metric']} | {_fmt(b['metric'], b['value'], b['stderr'])}"
                     f" | {b['step']} |")
    return "\n".join(lines + ["", _NOTE]) + "\n"


def _sci(x) -> str:
    return f"{x:.3e}" if isinstance(x, (int, float)) else ""


def output_paths(info: dict, out: str | None) -> tuple[Path, Path]:
    """(results JSON, its markdown table): ``--out`` if given, else ``<run>/eval/step_XXXXXXX.json``
    (a checkpoint outside a run: an ``eval/`` folder next to it)."""
    if out:
        j = Path(out)
        return j, j.with_suffix(".md")
    src = Path(info["source"])
    base = Path(info["run_dir"]) if info.get("run_dir") else (src if src.is_dir() else src.parent)
    stem = f"step_{info['step']:07d}" if isinstance(info.get("step"), int) else src.stem
    return base / "eval" / f"{stem}.json", base / "eval" / f"{stem}.md"


def is_eval_record(path: Path) -> bool:
    """``path`` holds results ``eslm eval`` wrote (a JSON object of ``EVAL_FORMAT``; not a link)."""
    try:
        r = json.loads(Path(path).read_text()) if not Path(path).is_symlink() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(r, dict) and r.get("format") == EVAL_FORMAT


def check_output(json_path: Path, md_path: Path) -> None:
    """Refuse (one line), before any evaluation, to replace a results JSON or its markdown that eslm eval did not
    write: the pair may be replaced only when the JSON is an earlier eslm eval result (the markdown beside it
    is then its table)."""
    if json_path.suffix != ".json":
        raise ConfigError(f"expected --out to name a .json file, found {str(json_path)!r}; the table is written "
                          f"beside it as .md: e.g. --out {json_path.with_suffix('.json')}")
    ours = is_eval_record(json_path)
    for p in (json_path, md_path):
        if (p.exists() or p.is_symlink()) and not ours:
            raise OwnershipError(f"{str(p)!r} exists and is not a result eslm eval wrote ({json_path.name} is not "
                                 f"one); eslm replaces only its own results: choose another --out, or move it away")


def write_results(record: dict, json_path: Path, md_path: Path) -> None:
    """The results JSON and its markdown table, each written whole (``atomic_write``: a link there is replaced,
    never followed); the directory is created, never through a link."""
    ensure_dir(json_path.parent)
    atomic_write(json_path, (json.dumps(record, indent=2) + "\n").encode())
    atomic_write(md_path, checkpoint_table(record).encode())


def write_summary(eval_dir: Path) -> Path | None:
    """``eval/summary.md``: every ``eval/*.json`` of a run in one table (accuracy against FLOPs)."""
    records = []
    for f in sorted(eval_dir.glob("*.json")):
        if f.is_symlink():  # only files eslm wrote there
            continue
        try:
            r = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(r, dict) and r.get("format") == EVAL_FORMAT:
            records.append(r)
    if not records:
        return None
    path = eval_dir / "summary.md"
    atomic_write(path, summary_table(records).encode())
    return path


# ------------------------------------------------------------------------------ the eval command's work


def _checkpoints(paths: list[str], all_checkpoints: bool) -> list[str]:
    out: list[str] = []
    for p in paths:
        found = list_evaluable(p) if all_checkpoints and Path(p).is_dir() else []
        out += [str(f) for f in found] or [p]
    return out


def evaluate_checkpoints(paths: list[str], tasks: dict[str, int], *, all_checkpoints: bool = False,
                         limit: int | float | None = None, batch_size: int = 16, device: str | None = None,
                         include_path: str | None = None, tokenizer: str | None = None, bootstrap_iters: int = 1000,
                         seed: int = 0, out: str | None = None) -> list[Path]:
    """Evaluate ``tasks`` (task -> shots) on each checkpoint of ``paths`` (``eslm eval``): per checkpoint, print
    its table and write its results JSON + markdown (``out``, or <run>/eval/step_XXXXXXX.json), then one
    summary per eval directory. ``limit``: documents per task (int) or a fraction < 1. Returns the JSON paths."""
    check_eval_options(limit, batch_size, bootstrap_iters, seed)
    device = check_device(device or ("cuda" if torch.cuda.is_available() else "cpu"), "--device")
    _require_lm_eval()
    targets = _checkpoints(paths, all_checkpoints)
    if out and len(targets) > 1:
        raise ConfigError(f"expected one checkpoint with --out, found {len(targets)}; drop --out to write "
                          "one file per checkpoint into <run>/eval/")
    if out:
        check_output(Path(out), Path(out).with_suffix(".md"))
    written: list[Path] = []
    skipped = []
    for path in targets:
        try:
            model, info = load_model(path, device=device)
        except CheckpointError as e:  # --all-checkpoints: one damaged file does not stop the others
            if not (all_checkpoints and len(targets) > 1):
                raise
            print(f"eslm eval: warning: skipped {path}: {e}", file=sys.stderr, flush=True)
            skipped.append(path)
            continue
        tok = resolve_tokenizer(tokenizer or info.get("tokenizer"))
        if tok.vocab_size > model.config.vocab_size:
            raise ConfigError(f"expected a tokenizer with at most {model.config.vocab_size} ids for {path}, "
                              f"found {tok.name} with {tok.vocab_size}; pass the --tokenizer it was trained with")
        results = evaluate(model, tok, tasks, limit=limit, batch_size=batch_size, include_path=include_path,
                           bootstrap_iters=bootstrap_iters, seed=seed, progress=True)
        record = {"format": EVAL_FORMAT, "source": info["source"], "step": info.get("step"),
                  "tokenizer": tok.name, M.FLOPS_PAPER: info.get(M.FLOPS_PAPER),
                  M.FLOPS_EXECUTED: info.get(M.FLOPS_EXECUTED), "limit": limit, "seed": seed,
                  "lm_eval_version": _lm_eval_version(), "tasks": results}
        json_path, md_path = output_paths(info, out)
        write_results(record, json_path, md_path)
        written.append(json_path)
        print(checkpoint_table(record), end="")
        print(f"wrote {json_path} and {md_path}")
    for d in sorted({j.parent for j in written}):
        if not out and (s := write_summary(d)):
            print(f"wrote {s}")
    if skipped and not written:
        raise CheckpointError(f"no checkpoint could be evaluated: all {len(skipped)} are damaged (see the warnings "
                              "above)")
    return written


def check_eval_options(limit, batch_size: int, bootstrap_iters: int, seed: int) -> None:
    """Every eval option checked before any model is loaded (one line each)."""
    import math

    if limit is not None and (not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit <= 0):
        raise ConfigError(f"--limit: expected a positive number of documents per task or a fraction in (0, 1), "
                          f"found {limit!r}; fix: e.g. --limit 100 or --limit 0.1, or drop it to run every document")
    if batch_size < 1:
        raise ConfigError(f"--batch-size: expected a positive number of sequences, found {batch_size}")
    if bootstrap_iters < 0:
        raise ConfigError(f"--bootstrap-iters: expected 0 (off) or a positive count, found {bootstrap_iters}")
    if not 0 <= seed < 2**32:
        raise ConfigError(f"--seed: expected an integer in [0, 2**32), found {seed}")


def check_device(device: str, option: str) -> str:
    """``device`` when torch knows it and it is usable here, else one line (a typo, CUDA on a CPU-only build)."""
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{option}: expected cpu, cuda, cuda:N or mps, found {device!r}") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{option}: expected a device this machine has, found {device!r} but CUDA is not "
                          "available (a CPU-only torch, or no GPU visible); fix: --device cpu")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ConfigError(f"{option}: expected cuda:0 .. cuda:{torch.cuda.device_count() - 1}, found {device!r}")
    if d.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{option}: expected a device this machine has, found {device!r} (MPS not available)")
    if d.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{option}: expected cpu, cuda, cuda:N or mps, found {device!r}")
    return device


def _require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError("eslm eval needs lm-evaluation-harness, which is not installed; fix: pip install "
                          "'eslm[eval]'") from None


def _lm_eval_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("lm_eval")
    except Exception:
        return None

