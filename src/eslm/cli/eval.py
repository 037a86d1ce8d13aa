"""``eslm eval RUN_DIR|CHECKPOINT ... [--tasks ...]``: lm-evaluation-harness tasks (docs/evaluation.md)."""

from __future__ import annotations

import argparse

from eslm.eval.command import evaluate_checkpoints
from eslm.eval.tasks import PAPER_TASKS, parse_tasks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="RUN_DIR|CHECKPOINT",
                        help="run directory (its latest checkpoint), checkpoint .pt, snapshot .safetensors, or HF GPT-2 directory")
    parser.add_argument("--all-checkpoints", action="store_true",
                        help="evaluate every saved step of each run directory: its snapshot "
                        "(snapshots/*.safetensors) or else its checkpoint (accuracy against FLOPs)")
    parser.add_argument("--tasks", nargs="*", default=None,
                        help="TASK or TASK:SHOTS, comma or space separated; default: the paper's suite "
                        + ", ".join(f"{t}:{k}" for t, k in PAPER_TASKS.items()))
    parser.add_argument("--num-fewshot", type=int, default=None,
                        help="shots for tasks given without :SHOTS (default: the paper's count, else 0)")
    parser.add_argument("--limit", type=float, default=None,
                        help="documents per task (an int), or a fraction < 1; for quick checks only")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument("--include-path", default=None, help="directory of extra lm-eval task YAMLs")
    parser.add_argument("--tokenizer", default=None, help="override the checkpoint's tokenizer (gpt2|byte)")
    parser.add_argument("--bootstrap-iters", type=int, default=1000,
                        help="bootstrap draws for stderr of non-mean metrics (perplexity); 0 disables")
    parser.add_argument("--seed", type=int, default=0, help="seed of few-shot sampling and the harness")
    parser.add_argument("--out", default=None,
                        help="results JSON path (one checkpoint only); default <run>/eval/step_XXXXXXX.json")


def run(args: argparse.Namespace) -> int:
    tasks = parse_tasks(args.tasks, args.num_fewshot)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    evaluate_checkpoints(args.paths, tasks, all_checkpoints=args.all_checkpoints, limit=limit,
                         batch_size=args.batch_size, device=args.device, include_path=args.include_path,
                         tokenizer=args.tokenizer, bootstrap_iters=args.bootstrap_iters, seed=args.seed,
                         out=args.out)
    return 0
