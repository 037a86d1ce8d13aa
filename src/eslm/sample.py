"""``eslm sample CHECKPOINT|RUN_DIR --prompt TEXT``: what a model writes (nanoGPT's sample.py).

Generation runs the prompt once, then one token per step through the model's KV cache
(``eslm.model.gpt.KVCache``). Past ``block_size`` tokens the context is cropped to the last ``block_size``
tokens, as nanoGPT does (absolute positions: the cache is rebuilt from the cropped window each step then).
Only ids the tokenizer can decode are sampled (the vocabulary rows added by padding are excluded).
``temperature=0`` is greedy decoding; ``top_k`` keeps the k most likely tokens before sampling.
"""

from __future__ import annotations

import argparse

import torch

from eslm.errors import ConfigError


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
             vocab_limit: int | None = None, stop_ids: frozenset | set = frozenset(), seed: int | None = None,
             use_cache: bool = True) -> list[int]:
    """The new token ids after ``prompt`` (at most ``max_new_tokens``; stops after a ``stop_ids`` token)."""
    if not prompt:
        raise ConfigError("expected a non-empty prompt (at least one token), found none")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    if seed is not None:
        gen.manual_seed(seed)
    block = model.config.block_size
    ids, out, cache, feed = list(prompt), [], None, []
    for _ in range(max_new_tokens):
        if use_cache and cache is not None and cache.length < block:
            hidden = model(torch.tensor([feed], device=device), cache=cache)
        else:  # first step, no cache wanted, or the window is full: run the (cropped) context from scratch
            cache = _new_cache(model) if use_cache else None
            hidden = model(torch.tensor([ids[-block:]], device=device), cache=cache)
        logits = model.logits(hidden[:, -1]).float()[0]
        if vocab_limit is not None:
            logits = logits[:vocab_limit]
        nxt = _pick(logits, temperature, top_k, gen)
        ids.append(nxt)
        out.append(nxt)
        feed = [nxt]
        if nxt in stop_ids:
            break
    return out


def _new_cache(model):
    from eslm.model.gpt import KVCache

    return KVCache(model.config.n_layer)


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> int:
    """One token id from logits (V,): argmax at temperature 0, else a draw from softmax(logits / T) over top-k."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


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
    from eslm.eval.harness import resolve_tokenizer
    from eslm.model.loading import load_model

    if args.max_new_tokens < 1 or args.num_samples < 1 or args.temperature < 0 or args.top_k < 0:
        raise ConfigError("expected --max-new-tokens >= 1, --num-samples >= 1, --temperature >= 0 and --top-k >= 0, "
                          f"found {args.max_new_tokens}, {args.num_samples}, {args.temperature}, {args.top_k}")
    model, info = load_model(args.checkpoint, device=args.device)
    tok = resolve_tokenizer(args.tokenizer or info.get("tokenizer"))
    prompt = tok.encode(args.prompt) if args.prompt else [tok.eot_id]
    for i in range(args.num_samples):
        new = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                       vocab_limit=min(tok.vocab_size, model.config.vocab_size), stop_ids={tok.eot_id},
                       seed=args.seed + i, use_cache=not args.no_kv_cache)
        text = tok.decode([t for t in new if t != tok.eot_id])
        print((args.prompt or "") + text)
        if i + 1 < args.num_samples:
            print("-" * 40)
    return 0
