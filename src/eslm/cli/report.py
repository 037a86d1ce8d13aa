"""``eslm report RUN_DIR ... [--out DIR]``: the HTML report of run directories (``eslm.analysis.report``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from eslm.analysis.report import FLOPS_KEYS, build_report, print_summary

DEFAULT_OUT = "report"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (runs/<name>)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="output directory for index.html, PNGs and summary.json (default: ./report); it must "
                             "be new, empty or an earlier eslm report, which is replaced")
    parser.add_argument("--target", "--target-loss", dest="target_loss", type=_target_arg, default=None,
                        metavar="LOSS|baseline",
                        help="validation loss target of the to-target costs: a number, or 'baseline' (the loss "
                             "every seed of the baseline group reaches); default: the best loss every run reaches")
    parser.add_argument("--baseline", default=None, metavar="NAME",
                        help="group (label or method name) every other group is compared with (default: clm)")
    parser.add_argument("--primary", nargs=2, default=None, metavar=("GROUP", "OTHER"),
                        help="the comparison named in advance (e.g. eslm-entropy random): shown first and not "
                             "adjusted for multiplicity; every other verdict is Holm-adjusted")
    parser.add_argument("--flops", choices=sorted(FLOPS_KEYS), default="paper",
                        help="FLOPs convention: paper (backward scaled by kept fraction) or executed")


def run(args: argparse.Namespace) -> int:
    summary = build_report(args.run_dirs, args.out, target_loss=args.target_loss, flops=args.flops,
                           baseline=args.baseline, primary=args.primary)
    print_summary(summary, Path(args.out))
    return 0


def _target_arg(text: str):
    if text == "baseline":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a loss (e.g. 4.3) or 'baseline', got {text!r}") from None
