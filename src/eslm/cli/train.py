"""``eslm train [CONFIG.yaml ...] [section.key=value ...] [--resume]``: build the config, train (docs/training.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from eslm.cli import split_config_items
from eslm.config import build_config, describe_keys, to_yaml
from eslm.methods import describe_methods
from eslm.study import watch_parent
from eslm.train import trainer
from eslm.train.resume import resume_base


def add_arguments(p: argparse.ArgumentParser) -> None:

    p.add_argument("items", nargs="*", metavar="CONFIG.yaml|key=value",
                   help="YAML files of config deltas (applied in order), then dotted overrides like method.alpha=0.2")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="RUN_DIR",
                   help="continue the run from its latest checkpoint (run.resume=true); with RUN_DIR and no other "
                        "arguments, with the run's own config. Only the keys listed in docs/training.md may differ "
                        "from the run's config (others: run.allow_change=KEY,...)")
    p.add_argument("--resume-from", type=int, metavar="STEP", default=None,
                   help="like --resume, from the kept checkpoint of STEP (e.g. before a divergence)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.epilog = ("With no arguments: the `small` model on the built-in stdlib corpus (prepared on first use).\n\n"
                "methods (method.name):\n" + describe_methods() + "\n\nconfig keys (default, meaning):\n" + describe_keys())


def run(args: argparse.Namespace) -> int:
    base, items, resume = _resume_args(args)
    files, overrides = split_config_items(items)
    overrides += ["run.resume=true"] if resume else []
    cfg = build_config(files, overrides, base=base)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    watch_parent()  # a run started by eslm study stops (with a checkpoint) when the study's process is gone
    result = trainer.train(cfg)
    return 0 if result.stopped_by in ("max_steps", "max_flops", "preempted") else 1


def _resume_args(args):
    """(base config, items, resume): ``--resume RUN_DIR`` starts from the run's own config; ``--resume`` followed
    by a YAML file or key=value (argparse took it as RUN_DIR) gives it back to the items."""
    items, base = list(args.items), None
    r = args.resume
    looks_like_item = "=" in str(r) or str(r).endswith((".yaml", ".yml"))
    if isinstance(r, str) and looks_like_item and not (Path(r) / "config.yaml").is_file():
        items.insert(0, r)
        r = True
    if isinstance(r, str):
        base, where = resume_base(r)
        items = where + items
    if args.resume_from is not None:
        items.append(f"run.resume_from={args.resume_from}")
    return base, items, bool(r) or args.resume_from is not None
