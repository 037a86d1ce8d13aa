"""The work of ``eslm eval`` (its command: eslm/cli/eval.py). See docs/evaluation.md."""

from __future__ import annotations

import importlib.util
import math
import sys
from importlib.metadata import version
from pathlib import Path

import torch

from eslm import metrics as M
from eslm.data.tokenizers import resolve_tokenizer
from eslm.errors import CheckpointError, ConfigError
from eslm.eval.results import EVAL_FORMAT, check_output, output_paths, write_results, write_summary
from eslm.eval.tables import checkpoint_table
from eslm.eval.tasks import evaluate
from eslm.model.loading import check_device, list_evaluable, load_model


def evaluate_checkpoints(paths: list[str], tasks: dict[str, int], *, all_checkpoints: bool = False,
                         limit: int | float | None = None, batch_size: int = 16, device: str | None = None,
                         include_path: str | None = None, tokenizer: str | None = None, bootstrap_iters: int = 1000,
                         seed: int = 0, out: str | None = None) -> list[Path]:
    """Evaluate ``tasks`` (task -> shots) on each checkpoint of ``paths`` (``eslm eval``): per checkpoint, print
    its table and write its results JSON + markdown (``out``, or <run>/eval/step_XXXXXXX.json), then one
    summary per eval directory. ``limit``: documents per task (int) or a fraction < 1. Returns the JSON paths."""
    check_eval_options(limit, batch_size, bootstrap_iters, seed)
    device = check_device(device or ("cuda" if torch.cuda.is_available() else "cpu"), "--device")
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("eslm eval needs lm-evaluation-harness, which is not installed; fix: pip install "
                          "'eslm[eval]'")
    targets = [f for p in paths  # --all-checkpoints: every saved step of a run directory
               for f in [str(c) for c in (list_evaluable(p) if all_checkpoints and Path(p).is_dir() else [])] or [p]]
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
        tok = resolve_tokenizer(tokenizer or info.get("tokenizer"), model.config.vocab_size, path)
        results = evaluate(model, tok, tasks, limit=limit, batch_size=batch_size, include_path=include_path,
                           bootstrap_iters=bootstrap_iters, seed=seed, progress=True)
        record = {"format": EVAL_FORMAT, "source": info["source"], "step": info.get("step"),
                  "tokenizer": tok.name, M.FLOPS_PAPER: info.get(M.FLOPS_PAPER),
                  M.FLOPS_EXECUTED: info.get(M.FLOPS_EXECUTED), "limit": limit, "seed": seed,
                  "lm_eval_version": version("lm_eval"), "tasks": results}
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
    if limit is not None and (not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit <= 0):
        raise ConfigError(f"--limit: expected a positive number of documents per task or a fraction in (0, 1), "
                          f"found {limit!r}; fix: e.g. --limit 100 or --limit 0.1, or drop it to run every document")
    if batch_size < 1:
        raise ConfigError(f"--batch-size: expected a positive number of sequences, found {batch_size}")
    if bootstrap_iters < 0:
        raise ConfigError(f"--bootstrap-iters: expected 0 (off) or a positive count, found {bootstrap_iters}")
    if not 0 <= seed < 2**32:
        raise ConfigError(f"--seed: expected an integer in [0, 2**32), found {seed}")
