"""``eslm lm-eval ARGS...``: lm-evaluation-harness's own command line, with our model registered as ``eslm``.

lm-eval has no plugin mechanism for external models, so its ``lm-eval`` command cannot name ours. This
command registers the adapter (``eslm.eval.adapter``) and then runs lm-eval's CLI on ARGS unchanged, so every
lm-eval option works as documented there (task groups, ``--include_path``, ``--output_path``,
``--log_samples``, ...). Select our model with ``--model eslm --model_args run_dir=PATH`` (PATH: a run
directory, a checkpoint .pt, a snapshot .safetensors or an HF GPT-2 directory; ``checkpoint=`` and
``pretrained=`` are the same key; ``tokenizer=gpt2|byte`` overrides the checkpoint's). lm-eval's results
JSON records the task versions, n-shot, task configs and the lm-eval version itself.
"""

from __future__ import annotations

import argparse
import sys

from eslm.errors import ConfigError
from eslm.eval.adapter import lm_class

PASSTHROUGH = True  # the dispatcher (eslm/cli/__init__.py) hands the arguments over unparsed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "Every argument goes to lm-eval unchanged; run 'eslm lm-eval --help' for lm-eval's own help."


def run(args: list[str]) -> int:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        raise ConfigError("expected lm-eval to be installed, found it missing; pip install 'eslm[eval]'") from None

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
