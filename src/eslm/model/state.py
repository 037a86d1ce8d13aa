"""Loading a state dict into a ``GPT`` with an error that names the first tensor that does not fit (shared by
``eslm.model.loading`` for checkpoints and ``eslm.model.hf`` for transformers models)."""

from __future__ import annotations

from eslm.errors import CheckpointError
from eslm.model.gpt import GPT


def load_state_checked(model: GPT, state: dict, source: str) -> None:
    """Load ``state`` into ``model``, naming the first missing, unexpected or mis-shaped tensor on failure."""
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
    model.load_state_dict({k: state[k].float() for k in expected})


_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def clean_state_dict(state: dict) -> dict:
    """Strip ``_orig_mod.`` / ``module.`` prefixes (torch.compile, DDP) from parameter names."""
    out = {}
    for k, v in state.items():
        changed = True
        while changed:
            changed = False
            for pre in _WRAPPER_PREFIXES:
                if k.startswith(pre):
                    k, changed = k[len(pre):], True
        out[k] = v
    return out


def non_finite(tree, prefix: str = "") -> str | None:
    """The name of the first floating-point tensor in ``tree`` (a state dict, an optimizer state: nested dicts
    and lists) holding a NaN or inf, else None. One pass over every tensor."""
    import torch

    if torch.is_tensor(tree):
        return (prefix or "tensor") if tree.is_floating_point() and not bool(torch.isfinite(tree).all()) else None
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for k, v in items:
        found = non_finite(v, f"{prefix}.{k}" if prefix else str(k))
        if found is not None:
            return found
    return None
