"""The one generation loop: ``eslm sample``'s text and lm-eval's ``generate_until`` (``eslm.eval.adapter``),
through the model's KV cache; past ``block_size`` tokens the context is cropped to the last ``block_size`` (as
nanoGPT; the cache is then rebuilt from the cropped window each step)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from eslm.data.tokenizers import resolve_tokenizer
from eslm.errors import ConfigError
from eslm.model.gpt import KVCache
from eslm.model.loading import check_device, load_model


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
             vocab_limit: int | None = None, stop_ids: frozenset | set = frozenset(), seed: int | None = None,
             use_cache: bool = True) -> list[int]:
    """The new token ids after ``prompt`` (at most ``max_new_tokens``; stops after a ``stop_ids`` token);
    ``temperature=0`` is greedy, ``vocab_limit`` keeps the vocabulary rows added by padding from being drawn."""
    if not prompt:
        raise ConfigError("expected a non-empty prompt (at least one token), found none")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    if seed is not None:
        gen.manual_seed(seed)
    block = model.config.block_size
    ids, cache = list(prompt), None
    for _ in range(max_new_tokens):
        if use_cache and cache is not None and cache.length < block:
            hidden = model(torch.tensor([ids[-1:]], device=device), cache=cache)
        else:  # first step, no cache wanted, or the window is full: run the (cropped) context from scratch
            cache = KVCache(model.config.n_layer) if use_cache else None
            hidden = model(torch.tensor([ids[-block:]], device=device), cache=cache)
        logits = model.logits(hidden[:, -1]).float()[0]
        if vocab_limit is not None:
            logits = logits[:vocab_limit]
        nxt = _pick(logits, temperature, top_k, gen)
        ids.append(nxt)
        if nxt in stop_ids:
            break
    return ids[len(prompt):]


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> int:
    """One token id from logits (V,): argmax at temperature 0, else a draw from softmax(logits / T) over top-k.
    Where logits / T overflows (T of 1e-40 and below in float32) the draw is the argmax: T's limit 0."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    scaled = logits / temperature
    if bool(torch.isfinite(logits).all()) and not bool(torch.isfinite(scaled).all()):
        return int(torch.argmax(logits))
    if top_k is not None and top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def sample_texts(checkpoint: str, prompt: str | None = None, *, num_samples: int = 1, max_new_tokens: int = 200,
                 temperature: float = 0.8, top_k: int = 200, seed: int = 1337, device: str = "cpu",
                 tokenizer: str | None = None, use_cache: bool = True) -> Iterator[str]:
    """Each sample as text (``prompt`` + what the model wrote, end-of-text removed), one at a time, from a run
    directory, checkpoint, snapshot or HF GPT-2 directory. ``top_k=0``: all tokens; sample i uses ``seed + i``;
    no prompt: start from end-of-text."""
    if max_new_tokens < 1 or num_samples < 1 or not math.isfinite(temperature) or temperature < 0 or top_k < 0:
        raise ConfigError("expected --max-new-tokens >= 1, --num-samples >= 1, a finite --temperature >= 0 and "
                          f"--top-k >= 0, found {max_new_tokens}, {num_samples}, {temperature}, {top_k}")
    if not 0 <= seed or seed + num_samples > 2**63:
        raise ConfigError(f"--seed: expected an integer in [0, 2**63 - --num-samples], found {seed}")
    device = check_device(device, "--device")
    if tokenizer is not None:
        resolve_tokenizer(tokenizer)  # an unknown name: one line before the model is loaded
    model, info = load_model(checkpoint, device=device)
    tok = resolve_tokenizer(tokenizer or info.get("tokenizer"), model.config.vocab_size, checkpoint)
    ids = tok.encode(prompt) if prompt else [tok.eot_id]
    for i in range(num_samples):
        new = generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k or None,
                       vocab_limit=min(tok.vocab_size, model.config.vocab_size), stop_ids={tok.eot_id},
                       seed=seed + i, use_cache=use_cache)
        yield (prompt or "") + tok.decode([t for t in new if t != tok.eot_id])
