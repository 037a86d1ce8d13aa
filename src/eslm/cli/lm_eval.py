"""``eslm lm-eval ARGS...``: lm-evaluation-harness's own command line with our adapter registered as ``eslm``
(lm-eval has no plugin mechanism for models); ARGS go to lm-eval unchanged (docs/evaluation.md)."""

from __future__ import annotations

import argparse
import sys

from eslm.eval.adapter import lm_class

PASSTHROUGH = True  # the dispatcher (eslm/cli/__init__.py) hands the arguments over unparsed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "Every argument goes to lm-eval unchanged; run 'eslm lm-eval --help' for lm-eval's own help."


def run(args: list[str]) -> int:
    from lm_eval.__main__ import cli_evaluate  # missing: the dispatcher names the extra that installs it

    lm_class()  # registers "eslm" in lm-eval's model registry
    saved = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    except SystemExit as e:  # argparse errors and --help exit through here
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0
