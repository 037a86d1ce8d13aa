"""The lowest layer: the loss kernels on the LM head (``fused_head``) and the token statistics type."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def fused_available() -> bool:
    """Whether ``eslm.ops.fused_head`` imports (the fused loss; the naive full-logits oracle needs nothing)."""
    try:
        import eslm.ops.fused_head  # noqa: F401
    except ImportError:
        return False
    return True


def default_impl() -> str:
    """The loss implementation used when none is given: 'fused' when available, else 'naive'."""
    return "fused" if fused_available() else "naive"
