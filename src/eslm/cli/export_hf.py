"""``eslm export-hf SOURCE --out DIR``: a run directory or checkpoint to a transformers GPT-2 directory."""

from __future__ import annotations

import argparse

from eslm.model.export_hf import export


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="run directory (uses checkpoints/latest), a checkpoint .pt or a snapshot .safetensors")
    parser.add_argument("--out", required=True, help="output directory (transformers save_pretrained layout)")
    parser.add_argument("--keep-padded-vocab", action="store_true",
                        help="keep the padded vocabulary (e.g. 50304) instead of trimming to the tokenizer's")
    parser.add_argument("--force", action="store_true",
                        help="replace an earlier eslm export in --out (never another program's files or a run directory)")
    parser.add_argument("--no-tokenizer", action="store_true",
                        help="do not write the GPT-2 tokenizer files next to the weights")


def run(args: argparse.Namespace) -> int:
    meta = export(args.source, args.out, keep_padded_vocab=args.keep_padded_vocab,
                  with_tokenizer=not args.no_tokenizer, force=args.force)
    print(f"exported step {meta['step']} ({meta['source']}) to {args.out}: vocab "
          f"{meta['vocab_size_trained']} -> {meta['vocab_size_exported']}, tokenizer "
          f"{meta['tokenizer']}{' (files written)' if meta['tokenizer_files'] else ''}")
    return 0
