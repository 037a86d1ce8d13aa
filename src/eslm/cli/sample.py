"""``eslm sample CHECKPOINT|RUN_DIR --prompt TEXT``: what a model writes (``eslm.eval.generate.sample_texts``)."""

from __future__ import annotations

import argparse

from eslm.eval.generate import sample_texts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT|RUN_DIR",
                        help="run directory, checkpoint .pt, snapshot .safetensors or HF GPT-2 directory")
    parser.add_argument("--prompt", default=None, help="the text to continue (default: start from end-of-text)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per sample")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy")
    parser.add_argument("--top-k", type=int, default=200, help="sample among the k most likely tokens (0 = all)")
    parser.add_argument("--num-samples", type=int, default=1, help="samples to draw")
    parser.add_argument("--seed", type=int, default=1337, help="random seed (sample i uses seed + i)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--tokenizer", default=None, help="override the checkpoint's tokenizer (gpt2 | byte)")
    parser.add_argument("--no-kv-cache", action="store_true", help="recompute the whole context every token")


def run(args: argparse.Namespace) -> int:
    texts = sample_texts(args.checkpoint, args.prompt, num_samples=args.num_samples,
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         seed=args.seed, device=args.device, tokenizer=args.tokenizer, use_cache=not args.no_kv_cache)
    for i, text in enumerate(texts):
        if i:
            print("-" * 40)
        print(text)
    return 0
