"""``eslm train [CONFIG.yaml ...] [section.key=value ...] [--resume]``"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from eslm.config import describe_keys
    from eslm.methods import describe_methods

    p.add_argument("items", nargs="*", metavar="CONFIG.yaml|key=value",
                   help="YAML files of config deltas (applied in order), then dotted overrides like method.alpha=0.2")
    p.add_argument("--resume", action="store_true", help="continue the run from its latest checkpoint (run.resume=true)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.epilog = ("With no arguments: the `small` model on the built-in stdlib corpus (prepared on first use).\n\n"
                "methods (method.name):\n" + describe_methods() + "\n\nconfig keys (default, meaning):\n" + describe_keys())


def run(args: argparse.Namespace) -> int:
    from eslm.config import build_config, to_yaml
    from eslm.train.trainer import train

    files = [i for i in args.items if "=" not in i]
    overrides = [i for i in args.items if "=" in i] + (["run.resume=true"] if args.resume else [])
    cfg = build_config(files, overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    result = train(cfg)
    return 0 if result.stopped_by in ("max_steps", "max_flops", "preempted") else 1
