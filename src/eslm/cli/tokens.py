"""``eslm tokens CHECKPOINT (--data DIR | --text FILE) --out DIR``: which tokens ESLM keeps."""

from __future__ import annotations

import argparse
from pathlib import Path

from eslm.analysis.tokens import build_token_view


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="run directory, checkpoint .pt, snapshot .safetensors or local HF GPT-2 directory")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="prepared data directory: passages from each domain's validation split")
    src.add_argument("--text", help="a UTF-8 text file: passages are its paragraphs (blank-line separated)")
    parser.add_argument("--out", required=True, help="output directory (index.html, PNGs, tokens.json)")
    parser.add_argument("--alpha", type=float, default=0.1, help="VaR confidence level: drop the lowest alpha")
    parser.add_argument("--num-passages", type=int, default=4,
                        help="passages per domain with --data; passages in all with --text")
    parser.add_argument("--max-tokens", type=int, default=256, help="scored tokens per passage at most")
    parser.add_argument("--scope", choices=("batch", "passage"), default="batch",
                        help="one VaR threshold over all passages (batch, as in training) or one per passage")
    parser.add_argument("--top", type=int, default=20,
                        help="tokens listed per domain and variant in the most often kept / dropped tables")
    parser.add_argument("--tokenizer", default=None, help="override the checkpoint's tokenizer (gpt2 | byte)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")


def run(args: argparse.Namespace) -> int:
    view = build_token_view(args.checkpoint, args.out, data=args.data, text=args.text, alpha=args.alpha,
                            num_passages=args.num_passages, max_tokens=args.max_tokens, scope=args.scope,
                            tokenizer=args.tokenizer, device=args.device, top=args.top)
    print(f"wrote {Path(args.out) / 'index.html'} ({len(view['passages'])} passages, alpha={args.alpha})")
    return 0
