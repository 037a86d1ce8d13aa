"""The selective loss inside any model's own forward: ``patch_model``, the way in that survives wrappers.

    handle = patch_model(model, head=model.lm_head, alpha=0.1)
    model = DDP(model)                                    # or torch.compile(model), FSDP, nothing
    loss, stats = model(X, eslm_targets=Y)                # the model's own forward, its head's input captured

Calling a method that stops before the head (``model.hidden(X)``) bypasses the wrappers: under
``DDP(model)`` the wrapper has no such method, ``model.module.hidden(X)`` runs outside DDP's forward so the
gradients are not all-reduced, and ``torch.compile(model).hidden(X)`` runs eagerly. ``patch_model`` instead
changes two forwards of the unwrapped model, so the wrapper's own ``__call__`` runs as usual:

* the model's forward takes ``eslm_targets=`` (and ``eslm_num_items=``, the divisor of an accumulated step);
  without them it is the model's original forward (evaluation, generation);
* with them, the head's forward receives the final hidden states, computes ``selective_loss`` from them and the
  head's own weight and bias (inside the head's forward, where FSDP has gathered them), and stops the rest of
  the model's forward (no logits, no loss of the model's own); the model's forward returns (loss, stats).

The head must be applied to every position whose target is given (a forward that slices before its head
without targets, like nanoGPT's inference branch, needs its own targets argument too: ``model(X, Y,
eslm_targets=Y)``); a mismatch is a one-line error. ``handle.remove()`` restores both forwards.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from eslm.api.ada import AdaAlpha
from eslm.api.loss import selective_loss
from eslm.errors import ConfigError
from eslm.selection.stats import SelectionStats


class _HeadReached(Exception):
    """Raised by the patched head once the loss is computed: ends the model's forward there."""


class PatchedModel:
    """The handle ``patch_model`` returns: the options, the Ada controller, ``remove()``."""

    _targets: torch.Tensor | None  # set for one patched forward
    _num_items: torch.Tensor | int | None
    _result: tuple[torch.Tensor, SelectionStats] | None

    def __init__(self, model: torch.nn.Module, head: torch.nn.Module, *, alpha: float, score: str,
                 ada: AdaAlpha | None, loss_options: dict):
        self.model, self.head, self.score, self.ada, self.loss_options = model, head, score, ada, loss_options
        self._alpha = alpha
        self._targets = self._num_items = self._result = None
        model_forward, head_forward = model.forward, head.forward
        model.forward = types.MethodType(functools.wraps(type(model).forward)(
            lambda _self, *a, **kw: self._model_forward(model_forward, *a, **kw)), model)
        head.forward = types.MethodType(functools.wraps(type(head).forward)(
            lambda _self, x, *a, **kw: self._head_forward(head_forward, x, *a, **kw)), head)

    @property
    def alpha(self) -> float:
        return self.ada.alpha if self.ada is not None else self._alpha

    def remove(self) -> None:
        """Restore the model's and the head's own forwards."""
        self.model.__dict__.pop("forward", None)
        self.head.__dict__.pop("forward", None)

    def _model_forward(self, original: Callable[..., Any], *args: Any, eslm_targets: torch.Tensor | None = None,
                       eslm_num_items: torch.Tensor | int | None = None, **kwargs: Any) -> Any:
        if eslm_targets is None:
            return original(*args, **kwargs)
        self._targets, self._num_items, self._result = eslm_targets, eslm_num_items, None
        try:
            original(*args, **kwargs)
        except _HeadReached:
            pass
        finally:
            self._targets = self._num_items = None
        result, self._result = self._result, None
        if result is None:
            raise ConfigError(f"patch_model: the model's forward never called the head "
                              f"({type(self.head).__name__}) given as head=; fix: pass the module that turns "
                              "the final hidden states into logits (e.g. head=model.lm_head)")
        return result

    def _head_forward(self, original: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        targets = self._targets
        if targets is None:
            return original(x, *args, **kwargs)
        if tuple(x.shape[:-1]) != tuple(targets.shape):
            raise ConfigError(f"patch_model: the head received hidden states of shape {tuple(x.shape)} for "
                              f"eslm_targets of shape {tuple(targets.shape)}; fix: pass targets aligned with "
                              "every position the head sees (a forward that slices before its head without "
                              "targets, like nanoGPT's, also needs its own: model(X, Y, eslm_targets=Y))")
        opts = dict(self.loss_options)
        if self.ada is not None:
            opts.setdefault("alpha_min", self.ada.alpha_min)
        loss, stats = selective_loss(targets, hidden=x, lm_weight=self.head.weight,
                                     bias=getattr(self.head, "bias", None), score=self.score, alpha=self.alpha,
                                     num_items_in_batch=self._num_items, **opts)
        if self.ada is not None:
            self.ada.observe(stats)
        self._result = (loss, stats)
        raise _HeadReached


def patch_model(model: torch.nn.Module, *, head: torch.nn.Module, alpha: float = 0.1, score: str = "entropy",
                ada: AdaAlpha | None = None, **loss_options: Any) -> PatchedModel:
    """Make ``model(..., eslm_targets=targets)`` return ``(loss, stats)``, the selective loss of the hidden states
    the model's own forward hands to ``head`` (see the module docstring). ``head``: the output projection (an
    ``nn.Linear``-like module with ``weight`` (V, C) and optional ``bias``), called inside the model's forward.
    ``loss_options``: any other keyword of ``selective_loss`` (scope, reduction, ignore_index, label_smoothing,
    z_loss, chunk_size, impl, ...). Patch the unwrapped model, before wrapping it in DDP, FSDP or compile."""
    if not isinstance(model, torch.nn.Module) or not isinstance(head, torch.nn.Module):
        raise ConfigError(f"patch_model expects nn.Modules (the model and its head); found "
                          f"{type(model).__name__}, {type(head).__name__}")
    if not any(m is head for m in model.modules()):
        raise ConfigError(f"patch_model: head= must be a submodule of the model; found a {type(head).__name__} "
                          "outside it; fix: head=model.lm_head (patch the unwrapped model, before DDP/compile)")
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ConfigError(f"patch_model: head= must have a (V, C) weight (an nn.Linear LM head); found "
                          f"{type(head).__name__} with weight {getattr(weight, 'shape', None)}")
    for key in ("hidden", "logits", "lm_weight", "bias", "targets", "num_items_in_batch"):
        if key in loss_options:
            raise ConfigError(f"patch_model: {key}= is set by the patched forward; found it among the options; "
                              "fix: drop it")
    return PatchedModel(model, head, alpha=alpha if ada is None else ada.alpha, score=score, ada=ada,
                        loss_options=loss_options)
