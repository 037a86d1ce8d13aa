"""Loading a state dict into a ``GPT`` with an error that names the first tensor that does not fit (shared by
``eslm.model.loading`` for checkpoints and ``eslm.model.hf`` for transformers models)."""

from __future__ import annotations

import re

import torch

from eslm.errors import CheckpointError
from eslm.model.gpt import GPT


def load_state_checked(model: GPT, state: dict, source: str) -> None:
    """Load ``state`` into ``model``, naming the first missing, unexpected or mis-shaped tensor on failure."""
    expected, state = check_state_fits(model, state, source)
    model.load_state_dict({k: state[k].float() for k in expected})


def check_state_fits(model: GPT, state: dict, source: str) -> tuple[dict, dict]:
    """(the model's state dict, ``state`` with the tied head filled in) when every tensor of ``model`` is in
    ``state`` with its shape and nothing else is; else a one-line CheckpointError. ``model`` may live on the
    meta device (nothing allocated)."""
    expected = model.state_dict()
    # lm_head.weight is tied to wte; checkpoints may or may not carry it.
    state = dict(state)
    state.setdefault("lm_head.weight", state.get("transformer.wte.weight"))
    for name, t in expected.items():
        if name not in state or state[name] is None:
            raise CheckpointError(
                f"expected tensor {name} {tuple(t.shape)} in {source}, found it missing; "
                "the checkpoint does not match its model_config"
            )
        if tuple(state[name].shape) != tuple(t.shape):
            raise CheckpointError(
                f"expected tensor {name} of shape {tuple(t.shape)} (from model_config) in {source}, "
                f"found {tuple(state[name].shape)}; the checkpoint does not match its model_config"
            )
    extra = sorted(set(state) - set(expected))
    if extra:
        raise CheckpointError(
            f"expected only the tensors of model_config in {source}, found unexpected {extra[0]} "
            f"({len(extra)} in all); the checkpoint does not match its model_config"
        )
    return expected, state


MAX_DECLARED_RATIO = 1.5  # a declared model may hold at most this many times the parameters the file holds


def build_checked(cfg, state: dict, source: str) -> GPT:
    """A ``GPT(cfg)`` holding ``state``, checked before anything large is allocated: ``cfg``'s values are sane
    (positive sizes, n_embd a multiple of n_head), the model it declares is not larger than the tensors in the
    file (a header that declares a huge model is refused before the model is built), and every tensor's shape
    fits (checked on a model on the meta device). Each problem is one CheckpointError line."""
    fix = "the file's model_config does not describe its tensors: point at a file written by 'eslm train'"
    bad = [f"{k}={getattr(cfg, k)!r}" for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")
           if not isinstance(getattr(cfg, k), int) or isinstance(getattr(cfg, k), bool) or getattr(cfg, k) < 1]
    if not isinstance(cfg.bias, bool):
        bad.append(f"bias={cfg.bias!r}")
    if not isinstance(cfg.dropout, (int, float)) or not 0 <= cfg.dropout < 1:
        bad.append(f"dropout={cfg.dropout!r}")
    if bad:
        raise CheckpointError(f"expected positive integer sizes and 0 <= dropout < 1 in the model_config of "
                              f"{source}, found {', '.join(bad)}; {fix}")
    if cfg.n_embd % cfg.n_head:
        raise CheckpointError(f"expected n_embd to be a multiple of n_head in the model_config of {source}, found "
                              f"n_embd={cfg.n_embd}, n_head={cfg.n_head}; {fix}")
    held = sum(t.numel() for t in state.values() if hasattr(t, "numel"))
    declared = 12 * cfg.n_layer * cfg.n_embd ** 2 + (cfg.vocab_size + cfg.block_size) * cfg.n_embd
    if declared > MAX_DECLARED_RATIO * held + 1_000_000:
        raise CheckpointError(f"the model_config of {source} declares a model of about {declared:,} parameters, "
                              f"the file holds {held:,}; {fix}")
    with torch.device("meta"):
        expected, state = check_state_fits(GPT(cfg), state, source)
    model = GPT(cfg)
    model.load_state_dict({k: state[k].float() for k in expected})
    return model


def clean_state_dict(state: dict) -> dict:
    """Strip ``_orig_mod.`` / ``module.`` prefixes (torch.compile, DDP) from parameter names."""
    return {re.sub(r"^(?:_orig_mod\.|module\.)+", "", k): v for k, v in state.items()}


def load_error_line(e: Exception, holder: str) -> str:
    """The first line of a loading error, never torch's advice to retry unsafely (``weights_only``)."""
    if "weights_only" in str(e) or "Weights only" in str(e):
        return f"{holder} holds objects other than tensors and plain values, which eslm never loads"
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def non_finite(tree, prefix: str = "") -> str | None:
    """The name of the first floating-point tensor in ``tree`` (a state dict, an optimizer state: nested dicts
    and lists) holding a NaN or inf, else None. One pass over every tensor."""
    if torch.is_tensor(tree):
        return (prefix or "tensor") if tree.is_floating_point() and not bool(torch.isfinite(tree).all()) else None
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for k, v in items:
        found = non_finite(v, f"{prefix}.{k}" if prefix else str(k))
        if found is not None:
            return found
    return None
