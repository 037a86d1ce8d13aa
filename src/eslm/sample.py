"""``eslm sample CHECKPOINT|RUN_DIR --prompt TEXT``: what a model writes (nanoGPT's sample.py), through the one
generation loop ``eslm.eval.generate.generate`` (KV cache, temperature, top-k). Only ids the tokenizer can
decode are sampled (the vocabulary rows added by padding are excluded).
"""

from __future__ import annotations

import math
from typing import Iterator

from eslm.data.tokenizers import resolve_tokenizer
from eslm.errors import ConfigError
from eslm.eval.generate import generate
from eslm.model.loading import check_device, load_model


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
