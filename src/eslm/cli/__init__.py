"""The ``eslm`` command line: a thin dispatcher. Each command is a module of this package named after it, with
``add_arguments(parser)`` and ``run(args) -> int``, imported only when its command runs (``eslm --help`` stays
instant; optional dependencies load where used). Nothing outside this package imports argparse."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import re
import sys
import warnings
from pathlib import Path

import eslm
from eslm.errors import ConfigError, ESLMError, extra_of, os_error_line

# Large CPU tensors on transparent huge pages (PyTorch's allocator madvises them when this is set before its
# first allocation). The fused loss allocates tokens x vocab blocks each step; with 4 KiB pages their page
# faults can cost about as much as the softmax over them. No effect on CUDA; set THP_MEM_ALLOC_ENABLE=0 to
# turn it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("eslm.cli.train", "train a model (CLM, ESLM or a baseline) from a config"),
    "prepare": ("eslm.cli.prepare", "tokenize a text source into shards + manifest.json"),
    "export-hf": ("eslm.cli.export_hf", "export a checkpoint to a transformers GPT2LMHeadModel directory"),
    "eval": ("eslm.cli.eval", "run lm-evaluation-harness tasks on a run or checkpoint"),
    "lm-eval": ("eslm.cli.lm_eval", "lm-eval's own command line with our model: --model eslm --model_args run_dir=PATH"),
    "report": ("eslm.cli.report", "HTML report with figures from run directories"),
    "tokens": ("eslm.cli.tokens", "token-selection view: which tokens ESLM keeps"),
    "study": ("eslm.cli.study", "run a grid of methods x seeds at equal FLOPs, then the report"),
    "sample": ("eslm.cli.sample", "generate text from a run, checkpoint or snapshot (KV cache)"),
}


def command_parser(name: str):
    """(module, argparse parser) of the command ``name``."""
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"eslm {name}", description=help_text,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    return module, parser


def parse_command(name: str, rest: list[str]):
    """(module, parsed arguments) of ``eslm NAME REST...``; exits 2 with a usage line on a bad argument.

    Options may sit anywhere among the positional arguments (``eslm study demo --out X key=value``). A module
    with ``PASSTHROUGH = True`` gets REST unparsed (``eslm lm-eval`` hands it to lm-eval's own command line).
    """
    module, parser = command_parser(name)
    if getattr(module, "PASSTHROUGH", False):
        return module, rest
    return module, parser.parse_intermixed_args(rest)


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+:?")


def _is_item(text: str) -> bool:
    """Whether ``text`` reads as a positional item of its own: key=value, a YAML file or a config key."""
    return "=" in text or text.endswith((".yaml", ".yml")) or bool(_KEY.fullmatch(text)) or Path(text).is_file()


def split_config_items(items: list[str]) -> tuple[list[str], list[str]]:
    """(YAML files, key=value overrides) of the positional items of ``eslm train``.

    A config key written without its '=' (``method.alpha 0.2``, ``method.alpha: 0.2``, ``method.alpha = 0.2``)
    would otherwise be read as the name of a YAML file that does not exist; it raises a ConfigError that
    shows the override as it should be written."""
    files, overrides = [], []
    for i, item in enumerate(items):
        nxt = items[i + 1] if i + 1 < len(items) else None
        if "=" in item and not item.startswith("="):
            if item.endswith("=") and nxt is not None and not _is_item(nxt):
                raise ConfigError(f"expected key=value as one argument; found {item!r} {nxt!r}; fix: write {item}{nxt}")
            overrides.append(item)
        elif _KEY.fullmatch(item) and not item.endswith((".yaml", ".yml")) and not Path(item).is_file():
            key, parts = item.rstrip(":"), [item]
            if nxt == "=" and i + 2 < len(items):
                parts += ["=", items[i + 2]]
            elif nxt is not None and (nxt.startswith("=") or not _is_item(nxt)):
                parts.append(nxt)
            if len(parts) == 1:
                raise ConfigError(f"expected a YAML file or key=value; found {item!r}, a config key without a value; "
                                  f"fix: write {key}=VALUE")
            raise ConfigError(f"expected key=value as one argument; found {' '.join(map(repr, parts))}; "
                              f"fix: write {key}={parts[-1].lstrip('=')}")
        else:
            files.append(item)
    return files, overrides


@contextlib.contextmanager
def one_line_warnings(prefix: str):
    """Within the block, a warning raised by eslm's own code prints as one line, ``PREFIX: warning: MESSAGE``
    (Python's default adds the category and the source line that raised it). Other packages' warnings keep
    Python's format, which says where they come from."""
    package = str(Path(__file__).resolve().parents[1]) + os.sep
    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if str(filename).startswith(package):
            print(f"{prefix}: warning: {message}", file=file or sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = default


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        top = argparse.ArgumentParser(
            prog="eslm",
            description="Risk-averse selective language modeling (ESLM): pretrain GPT models on high-risk tokens.",
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog="commands:\n" + "\n".join(f"  {n:<10} {h}" for n, (_, h) in COMMANDS.items())
            + "\n\nRun 'eslm COMMAND --help' for the options of a command.")
        top.add_argument("command", nargs="?", help="one of: " + ", ".join(COMMANDS))
        top.add_argument("--version", action="store_true", help="print the version and exit")
        ns, _ = top.parse_known_args(argv)
        if ns.version:
            print(eslm.__version__)
            return 0
        if ns.command is None:
            top.print_help()
            return 0
        close = difflib.get_close_matches(ns.command, list(COMMANDS), n=1, cutoff=0.6)
        hint = f"did you mean 'eslm {close[0]}'? " if close else ""
        top.error(f"unknown command {ns.command!r}; {hint}expected one of: {', '.join(COMMANDS)}")
    name, rest = argv[0], argv[1:]
    try:
        module, args = parse_command(name, rest)  # imports the command's module: an extra may be missing
        with one_line_warnings(f"eslm {name}"):
            return int(module.run(args) or 0)
    except ESLMError as e:
        print(f"eslm {name}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # permissions, full disk, missing paths: one line, never a traceback
        print(f"eslm {name}: error: {os_error_line(e)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # an optional dependency: one line naming the extra that installs it
        extra = extra_of(e.name)
        if extra is None:
            raise
        print(f"eslm {name}: error: this needs {str(e.name).split('.')[0]}, which is not installed; fix: pip install "
              f"'eslm[{extra}]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eslm {name}: interrupted", file=sys.stderr)
        return 130
