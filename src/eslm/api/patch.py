"""The selective loss inside any model's own forward: ``patch_model``, the way in that survives wrappers.

    handle = patch_model(model, head=model.lm_head, alpha=0.1)
    model = DDP(model)                                    # or torch.compile(model), FSDP, nothing
    loss, stats = model(X, eslm_targets=Y)                # the model's own forward, its head's input captured

It changes two forwards of the unwrapped model, so the wrapper's own ``__call__`` runs as usual. docs/dropin.md
("Any model, through DDP and torch.compile") gives the whole contract; ``handle.remove()`` restores both forwards.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, cast

import torch

from eslm.api.ada import AdaAlpha, AlphaHandle
from eslm.api.head import check_head_logits, head_transform
from eslm.api.loss import selective_loss, shift_for_causal_lm
from eslm.errors import ConfigError
from eslm.selection.stats import SelectionStats


class _HeadReached(Exception):
    """Raised by the patched head once the loss is computed: ends the model's forward there."""


class PatchedModel(AlphaHandle):
    """The handle ``patch_model`` returns: the options, the Ada controller, ``remove()``."""

    _targets: torch.Tensor | None = None  # set for one patched forward
    _num_items: torch.Tensor | int | None = None
    _result: tuple[torch.Tensor, SelectionStats] | None = None

    def __init__(self, model: torch.nn.Module, head: torch.nn.Module, *, alpha: float, score: str,
                 ada: AdaAlpha | None, loss_options: dict):
        super().__init__(alpha, ada, cast(torch.Tensor, head.weight).device)  # checked by patch_model
        self.model, self.head, self.score, self.loss_options = model, head, score, loss_options
        self._shift = False  # eslm_labels=: shift the targets inside the head's forward
        self._inputs_checked = False
        model_forward, head_forward = model.forward, head.forward
        model.forward = types.MethodType(functools.wraps(type(model).forward)(
            lambda _self, *a, **kw: self._model_forward(model_forward, *a, **kw)), model)
        head.forward = types.MethodType(functools.wraps(type(head).forward)(
            lambda _self, x, *a, **kw: self._head_forward(head_forward, x, *a, **kw)), head)

    def remove(self) -> None:
        """Restore the model's and the head's own forwards."""
        self.model.__dict__.pop("forward", None)
        self.head.__dict__.pop("forward", None)

    def _model_forward(self, original: Callable[..., Any], *args: Any, eslm_targets: torch.Tensor | None = None,
                       eslm_labels: torch.Tensor | None = None, eslm_num_items: torch.Tensor | int | None = None,
                       **kwargs: Any) -> Any:
        if eslm_targets is not None and eslm_labels is not None:
            raise ConfigError("patch_model: expected eslm_targets= (the next tokens) or eslm_labels= (unshifted "
                              "labels, shifted by eslm), found both; fix: pass one")
        if eslm_labels is not None:
            eslm_targets, self._shift = eslm_labels, True
        else:
            self._shift = False
        if eslm_targets is None:
            return original(*args, **kwargs)
        if kwargs.get("output_router_logits"):
            raise ConfigError(_ROUTER_REFUSAL)
        if not torch.compiler.is_compiling() and not self._shift and not self._inputs_checked:
            self._check_not_inputs(args[0] if args else kwargs.get("input_ids", kwargs.get("idx")), eslm_targets)
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

    def _check_not_inputs(self, ids: Any, targets: torch.Tensor) -> None:
        """Once: targets equal to the input ids wherever they are scored are unshifted labels (HF's ``labels``)."""
        self._inputs_checked = True
        if not isinstance(ids, torch.Tensor) or ids.shape != targets.shape or ids.shape[-1] < 2:
            return
        ignore = self.loss_options.get("ignore_index", -100)
        scored = targets != ignore
        if bool(scored.any()) and bool((targets == ids)[scored].all()):
            raise ConfigError("patch_model: expected eslm_targets to be the next tokens (targets[:, t] = "
                              "input_ids[:, t + 1]); found them equal to the input ids (Hugging Face's unshifted "
                              "labels: the model would learn to copy its input); fix: eslm_labels=labels (eslm "
                              "shifts them) or eslm_targets=<the shifted targets>")

    def _head_forward(self, original: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        targets = self._targets
        if targets is None:
            return original(x, *args, **kwargs)
        if self._shift:
            if tuple(x.shape[:-1]) != tuple(targets.shape):
                raise ConfigError(f"patch_model: the head received hidden states of shape {tuple(x.shape)} for "
                                  f"eslm_labels of shape {tuple(targets.shape)}; fix: pass the labels of every "
                                  "position the head sees")
            x, targets = shift_for_causal_lm(x, targets, self.loss_options.get("ignore_index", -100))
        if tuple(x.shape[:-1]) != tuple(targets.shape):
            raise ConfigError(f"patch_model: the head received hidden states of shape {tuple(x.shape)} for "
                              f"eslm_targets of shape {tuple(targets.shape)}; fix: pass targets aligned with "
                              "every position the head sees (a forward that slices before its head without "
                              "targets, like nanoGPT's, also needs its own: model(X, Y, eslm_targets=Y))")
        opts = dict(self.loss_options)
        if self.ada is not None:
            opts.setdefault("alpha_min", self.ada.alpha_min)
        loss, stats = selective_loss(targets, hidden=x, lm_weight=self.head.weight,
                                     bias=getattr(self.head, "bias", None), score=self.score, alpha=self.loss_alpha(),
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
    config = getattr(model, "config", None) if hasattr(model, "get_output_embeddings") else None
    if config is not None:  # a Hugging Face model
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(cfg, "output_router_logits", False):
            raise ConfigError(_ROUTER_REFUSAL)
        transform = head_transform(config)  # an LM head eslm cannot reproduce is refused here
        for key, value in transform.items():
            if key in loss_options and loss_options[key] != value:
                raise ConfigError(f"patch_model: {key}={loss_options[key]} differs from the model's config "
                                  f"({key} {value}); fix: drop {key}= (it is read from the config)")
        loss_options = {**transform, **loss_options}
    handle = PatchedModel(model, head, alpha=alpha, score=score, ada=ada, loss_options=loss_options)
    if config is not None and weight.device.type != "meta":
        try:
            _probe_head(handle, model, head, weight, config)
        except BaseException:
            handle.remove()
            raise
    return handle


_ROUTER_REFUSAL = ("patch_model: the model returns router logits (output_router_logits): its load-balancing loss "
                   "is added after the LM head, where the patched forward stops, so it would be dropped; fix: "
                   "eslm.integrations.hf.patch_causal_lm(model) (it adds it), or config.output_router_logits = False "
                   "to train without it")


@torch.no_grad()
def _probe_head(handle: PatchedModel, model: torch.nn.Module, head: torch.nn.Module, weight: torch.Tensor,
                config: Any) -> None:
    """A Hugging Face model's own logits on a few tokens must be eslm's head (with its config's transform) of
    the hidden states its head received; a model that needs more than token ids to run is not probed."""
    seen: list[torch.Tensor] = []
    hook = head.register_forward_pre_hook(lambda _m, inputs: seen.append(inputs[0]))
    ids = torch.arange(3, 3 + min(8, weight.shape[0] - 3), device=weight.device)[None]
    was_training = model.training
    model.eval()
    try:
        out = model(input_ids=ids, use_cache=False)
    except Exception:  # noqa: BLE001 - a model that needs more than token ids (the config transform still applies)
        return
    finally:
        hook.remove()
        model.train(was_training)
    own = getattr(out, "logits", None)
    if own is None or len(seen) != 1 or seen[0].shape[:-1] != own.shape[:-1]:
        return
    opts, bias = handle.loss_options, getattr(head, "bias", None)
    transform = {k: opts[k] for k in ("softcap", "logit_scale") if k in opts}
    try:
        check_head_logits(own, seen[0], weight, bias, transform, config, type(model).__name__)
    except ConfigError:
        # a model that scales the hidden states before its head (MiniCPM3 divides them by its logits_scaling):
        # the head's input is already scaled, so the config's scale must not be applied again
        if "logit_scale" not in transform:
            raise
        check_head_logits(own, seen[0], weight, bias, {k: v for k, v in transform.items() if k != "logit_scale"}, config,
                          type(model).__name__)
        opts.pop("logit_scale")
