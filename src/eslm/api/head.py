"""LM heads whose logits are not a plain ``hidden @ weight.T``: a bias, a logit scale, a final logit softcap.

    z = hidden @ weight.T + bias            (bias: Falcon/Phi-style heads; usually absent)
    z = logit_scale * z                     (Cohere: config.logit_scale; Granite: 1 / config.logits_scaling)
    z = softcap * tanh(z / softcap)         (Gemma 2/3: config.final_logit_softcapping)

applied in this order, as those models do. Chunked, with activation checkpointing (docs/dropin.md). Cost at
the head: 1u for the scores plus 4ku for the kept rows (u one N x C x V matmul, k the kept fraction), against
3u for plain training with full logits; memory: one (chunk, V) fp32 block, not the (N, V) logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eslm.errors import ConfigError
from eslm.ops.token_stats import loss_entropy


@dataclass(frozen=True)
class Head:
    """The LM head's logit transform: bias (V,) or None, logit_scale, softcap (None: no cap)."""

    bias: torch.Tensor | None = None
    logit_scale: float | None = None
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        return self.bias is None and self.logit_scale in (None, 1.0) and self.softcap is None

    def check(self, vocab: int) -> Head:
        if self.bias is not None and tuple(self.bias.shape) != (vocab,):
            raise ConfigError(f"bias must be the LM head's ({vocab},) bias; found {tuple(self.bias.shape)}; "
                              "fix: pass model.lm_head.bias")
        if self.softcap is not None and not float(self.softcap) > 0:
            raise ConfigError(f"softcap must be > 0 (Gemma: config.final_logit_softcapping); found {self.softcap}")
        if self.logit_scale is not None and not float(self.logit_scale) > 0:
            raise ConfigError(f"logit_scale must be > 0; found {self.logit_scale}; fix: Cohere's "
                              "config.logit_scale, or 1 / config.logits_scaling for Granite")
        return self

    def logits(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """(c, C) hidden rows -> (c, V) fp32 transformed logits (the matmul in the inputs' dtype)."""
        z = (h @ weight.t() if self.bias is None else F.linear(h, weight, self.bias)).float()
        if self.logit_scale is not None:
            z = z * self.logit_scale
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z


@torch.no_grad()
def chunked_scores(logits_of: Callable[[int, int], torch.Tensor], targets: torch.Tensor, *, need_entropy: bool,
                   chunk_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Detached fp32 per-token loss and entropy (None unless asked) of N tokens, chunk by chunk
    (``eslm.ops.token_stats.loss_entropy``): ``logits_of(s, e)`` gives rows s:e's fp32 logits, so only one
    (chunk, V) block is alive."""
    loss, ent = [], []
    for s in range(0, targets.shape[0], chunk_size):
        chunk_loss, chunk_ent = loss_entropy(logits_of(s, s + chunk_size), targets[s:s + chunk_size], need_entropy)
        loss.append(chunk_loss)
        if chunk_ent is not None:
            ent.append(chunk_ent)
    return torch.cat(loss), (torch.cat(ent) if need_entropy else None)


def row_loss(z: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0,
             z_loss: float = 0.0) -> torch.Tensor:
    """Per-row training loss of fp32 logits z (n, V): cross-entropy, with label smoothing as
    ``F.cross_entropy`` defines it ((1 - eps) CE + eps x mean over the vocabulary of -log p), plus
    z_loss x logsumexp(z)^2 (PaLM's z-loss; Liger's lse_square_scale)."""
    loss = F.cross_entropy(z, targets, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(z, dim=-1).square()
    return loss


def _chunk_ce(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, head: Head,
              label_smoothing: float, z_loss: float) -> torch.Tensor:
    return row_loss(Head(bias, head.logit_scale, head.softcap).logits(h, weight), targets, label_smoothing, z_loss)


def selected_ce(head: Head, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                index: torch.Tensor, *, chunk_size: int, label_smoothing: float = 0.0,
                z_loss: float = 0.0) -> torch.Tensor:
    """Per-token loss (K,) fp32 of the rows ``index`` (``row_loss``), with gradient to hidden, weight and bias;
    each chunk is checkpointed, so its (chunk, V) logits are rebuilt in the backward instead of kept."""
    h, t = hidden[index], targets[index]
    out = [checkpoint(_chunk_ce, h[s:s + chunk_size], weight, head.bias, t[s:s + chunk_size], head,
                      label_smoothing, z_loss, use_reentrant=False) for s in range(0, h.shape[0], chunk_size)]
    return torch.cat(out) if out else h.new_zeros(0, dtype=torch.float32)


# The logit transforms a causal LM's forward applies after its LM head, read from its (text) config as TRL's
# fused head reads them (``trl.trainer.utils.add_fused_lm_head``): a multiplier under one of four names, a
# divisor, a final softcap. Names that transform the logits in a way eslm does not apply are refused; a
# model whose head matches none of these is caught by ``check_head_logits`` (``patch_causal_lm``, ``patch_model``).
SCALE_NAMES = ("logit_scale", "output_multiplier", "lm_head_multiplier")  # logits * x: Cohere, Muse, Falcon-H1
UNSUPPORTED_HEAD = {"logits_soft_cap": "RecurrentGemma", "output_logit_soft_cap": "xLSTM",
                    "logits_mup_width_multiplier": "Inkling"}


def head_transform(config: Any) -> dict:
    """``softcap`` and ``logit_scale`` for ``selective_loss`` from a causal LM's config, as the model applies
    them: softcap from ``final_logit_softcapping`` (Gemma 2/3); the scale from ``logit_scale`` (Cohere),
    ``output_multiplier`` (Muse Glimmer), ``lm_head_multiplier`` (Falcon-H1), else ``logits_scaling`` (HyperCLOVA X
    multiplies by it; Granite and MiniCPM3 divide). An unsupported transform is a ConfigError."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name, model in UNSUPPORTED_HEAD.items():
        if getattr(cfg, name, None) is not None:
            raise ConfigError(f"expected an LM head eslm can reproduce; found config.{name} = "
                              f"{getattr(cfg, name)!r} ({model}'s logit transform, not supported); "
                              "fix: train this model with its own loss")
    out = {}
    if getattr(cfg, "final_logit_softcapping", None) is not None:
        out["softcap"] = float(cfg.final_logit_softcapping)
    scale = next((getattr(cfg, n) for n in SCALE_NAMES if getattr(cfg, n, None) is not None), None)
    if scale is None and getattr(cfg, "logits_scaling", None) is not None:
        scaling = float(cfg.logits_scaling)
        scale = scaling if getattr(cfg, "model_type", None) == "hyperclovax" else 1.0 / scaling
    if scale is not None and float(scale) != 1.0:
        out["logit_scale"] = float(scale)
    return out



def check_head_logits(own: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      transform: dict, config: Any, name: str) -> None:
    """The model's own logits ``own`` must be ``Head(bias, **transform).logits`` of the hidden states its LM head
    (weight, bias) received (any shapes (..., C) / (..., V)); otherwise a ConfigError naming the config keys that
    may transform them (a multiplier under a name eslm does not know is refused, not trained on)."""
    mine = Head(bias, **transform).logits(hidden.reshape(-1, hidden.shape[-1]).to(weight.device), weight)
    own = own.float().reshape(mine.shape).to(mine.device)
    tol = (1e-4 if weight.dtype == torch.float32 else 2e-2) * (1.0 + float(own.abs().max()))
    err = float((own - mine).abs().max())
    if not err <= tol:
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        keys = cfg.to_dict() if hasattr(cfg, "to_dict") else vars(cfg)
        names = sorted(k for k in keys if any(w in k for w in ("logit", "multiplier", "scal", "cap")))
        raise ConfigError(f"expected {name}'s logits to be its LM head with the transform eslm reads from its "
                          f"config {transform or '(none)'}; found them {err:.3g} apart (config keys "
                          f"that may transform them: {', '.join(names) or 'none'}); fix: train this model with its "
                          "own loss, or report the model")
