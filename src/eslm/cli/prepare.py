"""``eslm prepare SOURCE [PATHS ...] --out DIR``: text -> token shards + manifest.json (``eslm.data.prepare``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from eslm.data.prepare import default_data_root, format_summary, prepare
from eslm.data.sources import SOURCE_NAMES
from eslm.data.tokenizers import TOKENIZER_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help=f"one of: {', '.join(SOURCE_NAMES)}")
    parser.add_argument("paths", nargs="*", metavar="[NAME=]PATH",
                        help="text: files, directories or globs, NAME = domain (default 'text'); "
                             "openwebtext / slimpajama-6b: local data files, NAME = split (instead of the Hub)")
    parser.add_argument("--out", default=None,
                        help="output directory (default: $ESLM_DATA_DIR or ./data, then SOURCE-TOKENIZER)")
    parser.add_argument("--tokenizer", default="gpt2", help=f"one of: {', '.join(TOKENIZER_NAMES)} (default gpt2)")
    parser.add_argument("--val-fraction", type=float, default=None,
                        help="share of documents in val for stdlib/text (default 0.05); hub sources have fixed splits")
    parser.add_argument("--domains", default=None, help="comma-separated subset of the source's domains")
    parser.add_argument("--workers", type=int, default=None, help="tokenisation processes (default min(2, CPUs))")
    parser.add_argument("--force", action="store_true", help="overwrite an existing prepared directory")
    parser.add_argument("--hf-cache-dir", default=None, help="HF datasets cache directory (hub sources)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else default_data_root() / f"{args.source}-{args.tokenizer}"
    domains = [d.strip() for d in args.domains.split(",") if d.strip()] if args.domains else None
    m = prepare(args.source, out, tokenizer=args.tokenizer, paths=args.paths or None, domains=domains,
                val_fraction=args.val_fraction, workers=args.workers, progress=not args.no_progress,
                overwrite=args.force, hf_cache_dir=args.hf_cache_dir)
    print(format_summary(m, out))
    return 0
