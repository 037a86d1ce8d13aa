"""Drop-in selective loss for your own training loop (ESLM without the eslm trainer).

    loss, stats = selective_loss(targets, logits=logits, score="entropy", alpha=0.1)
    loss.backward()

The rule is the paper's VaR selection (``eslm.selection.risk``): of the N scored tokens keep the
K = N - floor(alpha * N) with the highest risk score (predictive entropy or loss, detached fp32), and return
the mean cross-entropy over those K tokens. Tokens whose target is ``ignore_index`` (padding, prompt tokens)
are neither scored, kept nor counted in N.

No shifting happens inside: ``targets[i]`` must be the token that ``logits[i]`` / ``hidden[i]`` predicts.
For Hugging Face style labels (labels == input_ids) use ``shift_for_causal_lm`` first.

Everything stays on the device: K for the ignored-token case is a 0-dim tensor, the top-k has the static
size K_max = num_kept(rows, alpha), and nothing calls ``.item()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eslm.errors import ConfigError
from eslm.objectives.cross_entropy import selected_ce, token_stats
from eslm.ops import default_impl
from eslm.selection import risk

SCORES = ("entropy", "loss")
IMPLS = ("auto", "naive", "fused")


@dataclass
class SelectionStats:
    """What the selection did, as 0-dim tensors on the input's device (no host sync; call .item() yourself).

    num_tokens:         () int64, scored tokens N (targets != ignore_index)
    num_kept:           () int64, K = N - floor(alpha * N) (>= 1 when N >= 1)
    kept_frac:          () fp32, K / N
    threshold:          () fp32, VaR_alpha: the smallest kept score (0 when N = 0)
    cvar:               () fp32, CVaR_alpha: mean score of the kept tokens (the tail at or above VaR)
    score_kept_mean:    () fp32, the same mean, named as in the trainer's metrics
    score_dropped_mean: () fp32, mean score of the scored but dropped tokens (0 when none)
    """

    num_tokens: torch.Tensor
    num_kept: torch.Tensor
    kept_frac: torch.Tensor
    threshold: torch.Tensor
    cvar: torch.Tensor
    score_kept_mean: torch.Tensor
    score_dropped_mean: torch.Tensor


def shift_for_causal_lm(logits_or_hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100):
    """Align HF-style labels (labels == input_ids) with next-token predictions.

    logits_or_hidden (B, T, X), labels (B, T) -> (logits_or_hidden unchanged, targets (B, T)) with
    targets[:, t] = labels[:, t + 1] and the last position set to ignore_index. Shifting the labels rather than
    slicing off the last position of the (large) logits avoids a copy; the last position is simply not scored.
    """
    if labels.shape != logits_or_hidden.shape[:-1]:
        raise ConfigError(f"labels must have shape {tuple(logits_or_hidden.shape[:-1])} (the logits/hidden "
                          f"without the last dim); found {tuple(labels.shape)}; fix: pass the unshifted labels")
    targets = F.pad(labels[..., 1:], (0, 1), value=ignore_index)
    return logits_or_hidden, targets


def _resolve_impl(impl: str, have_logits: bool) -> str:
    if impl not in IMPLS:
        raise ConfigError(f"impl must be one of {' | '.join(IMPLS)}; found {impl!r}; fix: use impl='auto'")
    if have_logits:
        if impl == "fused":
            raise ConfigError("impl='fused' needs hidden= and weight= (it never builds logits); found logits=; "
                              "fix: pass hidden states and the LM-head weight, or use impl='auto'")
        return "naive"
    if impl == "auto":
        return default_impl()
    return impl


def _flatten_inputs(targets, logits, hidden, weight):
    """Validate shapes; return (targets (N,), logits (N, V) | None, hidden (N, C) | None)."""
    if (logits is None) == (hidden is None):
        raise ConfigError("expected exactly one of logits= or hidden= (with weight=); "
                          f"found logits={'set' if logits is not None else 'None'}, "
                          f"hidden={'set' if hidden is not None else 'None'}; fix: pass one of them")
    x = logits if logits is not None else hidden
    if hidden is not None and (weight is None or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]):
        raise ConfigError(f"weight must be the (V, {hidden.shape[-1]}) LM-head weight for hidden of shape "
                          f"{tuple(hidden.shape)}; found {None if weight is None else tuple(weight.shape)}; "
                          "fix: pass model.lm_head.weight")
    if targets.shape != x.shape[:-1] or targets.dtype not in (torch.int64, torch.int32):
        raise ConfigError(f"targets must be integer with shape {tuple(x.shape[:-1])}; found {targets.dtype} "
                          f"{tuple(targets.shape)}; fix: align targets with the logits (see shift_for_causal_lm)")
    if targets.numel() == 0:
        raise ConfigError("expected at least one token; found an empty targets tensor")
    t = targets.reshape(-1).long()
    return t, (logits.reshape(t.numel(), -1) if logits is not None else None), \
        (hidden.reshape(t.numel(), -1) if hidden is not None else None)


def _scores_from_logits(logits: torch.Tensor, targets: torch.Tensor, score: str, chunk_size: int) -> torch.Tensor:
    """Detached fp32 scores (N,) from logits (N, V), chunked so only a (chunk, V) fp32 copy is alive.

    loss = -log p(target);  entropy H = -sum_v p_v log p_v.
    """
    out = []
    with torch.no_grad():
        for s in range(0, logits.shape[0], chunk_size):
            logp = torch.log_softmax(logits[s:s + chunk_size].float(), dim=-1)
            if score == "loss":
                out.append(-logp.gather(1, targets[s:s + chunk_size, None]).squeeze(1))
            else:
                out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out)


def _stats(scores, valid, index, vals, keep, k, n_valid) -> SelectionStats:
    kf, nf = k.float(), n_valid.float()
    kept_mean = vals.masked_fill(~keep, 0.0).sum() / kf.clamp(min=1)
    # dropped = valid and not kept; summed directly (all - kept would cancel catastrophically)
    kept_rows = torch.zeros_like(valid).index_put((index,), keep)
    dropped_sum = scores.masked_fill(~valid | kept_rows, 0.0).sum()
    threshold = vals[(k - 1).clamp(min=0)].masked_fill(k == 0, 0.0)
    return SelectionStats(num_tokens=n_valid, num_kept=k, kept_frac=kf / nf.clamp(min=1), threshold=threshold,
                          cvar=kept_mean, score_kept_mean=kept_mean,
                          score_dropped_mean=dropped_sum / (nf - kf).clamp(min=1))


def selective_loss(targets: torch.Tensor, *, logits: torch.Tensor | None = None,
                   hidden: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                   score: str = "entropy", alpha: float = 0.1, ignore_index: int = -100, impl: str = "auto",
                   chunk_size: int = 1024) -> tuple[torch.Tensor, SelectionStats]:
    """ESLM's selective cross-entropy: mean CE over the highest-risk 1 - alpha of the tokens.

    targets: (N,) or (B, T) int64, already aligned with the predictions (no shift inside).
    logits:  (..., V) with targets.shape == logits.shape[:-1]; or
    hidden:  (..., C) final hidden states and weight (V, C) the LM-head weight (the loss never builds the
             full logits with impl="fused": the path for long sequences and large vocabularies).
    score:   "entropy" (ESLM VaR-entropy) or "loss" (ESLM CVaR-loss); detached fp32, never differentiated.
    alpha:   fraction of the scored tokens dropped, in [0, 1); alpha = 0 is plain CE.
    impl:    "auto" (logits: naive; hidden: fused if eslm.ops.fused_head is available), "naive", "fused".

    Returns (loss () fp32 with gradient = sum of kept tokens' CE / K, SelectionStats). Dropped and ignored
    tokens get exactly zero gradient. The loss is a per-call mean: with gradient accumulation, divide by the
    accumulation steps, or rescale by stats.num_kept / (kept tokens of the whole step) for a global mean.
    """
    alpha = risk.check_alpha(alpha)
    if score not in SCORES:
        raise ConfigError(f"score must be one of {' | '.join(SCORES)}; found {score!r}; fix: score='entropy'")
    t, logits2d, hidden2d = _flatten_inputs(targets, logits, hidden, weight)
    impl = _resolve_impl(impl, logits is not None)
    valid = t != ignore_index
    safe_t = torch.where(valid, t, torch.zeros_like(t))  # ignored rows get a dummy in-range target

    if logits2d is not None:
        scores = _scores_from_logits(logits2d, safe_t, score, chunk_size)
        lse = None
    else:
        ts = token_stats(hidden2d, weight, safe_t, need_entropy=score == "entropy", impl=impl,
                         chunk_size=chunk_size)
        scores, lse = (ts.entropy if score == "entropy" else ts.loss), ts.lse
    index, vals, keep, k, n_valid = risk.select_valid(scores.float(), valid, alpha)

    if logits2d is not None:
        ce = F.cross_entropy(logits2d[index].float(), safe_t[index], reduction="none")
    else:
        ce = selected_ce(hidden2d, weight, safe_t, index, impl=impl, chunk_size=chunk_size, lse=lse)
    # torch.where, not a product: a -inf/nan in an unkept row must not leak into the sum or its gradient
    loss = torch.where(keep, ce, torch.zeros_like(ce)).sum() / k.clamp(min=1)
    return loss, _stats(scores.float(), valid, index, vals, keep, k, n_valid)
