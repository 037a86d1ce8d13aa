"""ESLM without the eslm trainer: the selective loss for your own loop (``loss``), Ada-ESLM's controller
(``ada``), ``patch_model`` (the loss inside any model's own forward, so DDP and torch.compile see it), the
pieces they rest on (``select``: the scopes; ``head``: biased, scaled and softcapped heads).
docs/dropin.md is the guide; ``eslm.integrations`` wires them into Hugging Face, TRL, Lightning and
torchtitan-style loops."""

from eslm.api.ada import AdaAlpha
from eslm.api.loss import (
                           SelectionStats,
                           TokenOutputs,
                           TokenScores,
                           kept_tokens,
                           select_tokens,
                           selective_loss,
                           shift_for_causal_lm,
                           token_losses,
)
from eslm.api.patch import PatchedModel, patch_model

__all__ = ["AdaAlpha", "PatchedModel", "SelectionStats", "TokenOutputs", "TokenScores", "kept_tokens",
           "patch_model", "select_tokens", "selective_loss", "shift_for_causal_lm", "token_losses"]
