"""The drop-in selective loss: ESLM's token selection inside your own training loop.

    loss, stats = selective_loss(targets, logits=logits, score="entropy", alpha=0.1)

The rule is the paper's VaR selection (``eslm.selection.risk``): of the N scored tokens keep the
K = N - floor(alpha * N) with the highest risk score; ``selective_loss`` documents every option. With
``group=None`` nothing reads a tensor on the host (static K_max, K a 0-dim tensor): one ``torch.compile`` graph.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast, overload

import torch
import torch.nn.functional as F

from eslm.api import select
from eslm.api.head import Head, chunked_scores, row_loss
from eslm.api.head import selected_ce as head_selected_ce
from eslm.errors import ConfigError
from eslm.ops.head_backend import IMPL_CHOICES, backend
from eslm.ops.token_stats import HeadOptions
from eslm.selection import risk
from eslm.selection.stats import SelectionStats, selection_stats

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

SCORES = ("entropy", "loss")
LOSS_SCOPES = ("batch", "sequence")  # the drop-in loss's scope (the trainer's method.scope: selectors.SCOPES)
REDUCTIONS = ("mean", "sum")
IMPLS = IMPL_CHOICES  # the head backends of eslm.ops.head_backend


@dataclass
class TokenOutputs:
    """Per-token outputs (``return_tokens=True``), detached, each of the targets' shape; ignored positions hold
    kept False, score 0 and loss 0 (mask them with ``targets != ignore_index``).

    kept:  bool, the tokens that count in the loss
    score: fp32, the risk score the selection ranked
    loss:  fp32, every scored token's cross-entropy (kept or not)
    """

    kept: torch.Tensor
    score: torch.Tensor
    loss: torch.Tensor


@dataclass
class TokenScores:
    """What a ``scores=`` callable receives: the model's own per-token loss and entropy, detached fp32, each
    of the targets' shape (ignored positions hold the loss and entropy of a dummy target 0)."""

    loss: torch.Tensor
    entropy: torch.Tensor


def shift_for_causal_lm(logits_or_hidden: torch.Tensor, labels: torch.Tensor,
                        ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
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


def _resolve_impl(impl: str, have_logits: bool, head: Head, extras: bool = False) -> str:
    if impl not in IMPLS:
        raise ConfigError(f"impl must be one of {' | '.join(IMPLS)}; found {impl!r}; fix: use impl='auto'")
    if have_logits:
        if impl not in ("auto", "naive"):
            raise ConfigError(f"impl={impl!r} needs hidden= and lm_weight= (it never builds logits); found logits=; "
                              "fix: pass hidden states and the LM-head weight, or use impl='auto'")
        if not head.plain:
            raise ConfigError("bias=, logit_scale= and softcap= apply to hidden= (they transform the logits "
                              "eslm builds); found logits=; fix: apply them to your logits, or pass hidden=")
        return "naive"
    if not head.plain or extras:
        if impl not in ("auto", "naive"):
            raise ConfigError(f"impl={impl!r} has no bias, logit scale, softcap, label smoothing or z-loss; found "
                              "one; fix: impl='auto'")
        return "transformed"
    return impl  # "auto": the device's default backend (eslm.ops.head_backend.resolve)


def _logit_chunks(logits: torch.Tensor | Sequence[torch.Tensor] | None,
                  targets: torch.Tensor) -> list[torch.Tensor] | None:
    """A list of logit chunks (litgpt's chunked output: (..., t_i, V) pieces of the (..., T, V) logits along the
    sequence): validated against the targets; None when ``logits`` is a tensor."""
    if not isinstance(logits, (list, tuple)):
        return None
    ok = (len(logits) > 0 and all(isinstance(c, torch.Tensor) and c.dim() == targets.dim() + 1
                                  and c.shape[:-2] == targets.shape[:-1] and c.shape[-1] == logits[0].shape[-1]
                                  for c in logits)
          and sum(c.shape[-2] for c in logits) == targets.shape[-1])
    if not ok:
        shapes = [tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__ for c in logits]
        raise ConfigError(f"a list of logits must be chunks of the (..., {targets.shape[-1]}, V) logits along the "
                          f"sequence, for targets of shape {tuple(targets.shape)}; found {shapes}; fix: pass the "
                          "chunks in order (litgpt: model(x, lm_head_chunk_size=...))")
    return list(logits)


def _flatten_inputs(targets: torch.Tensor, logits: torch.Tensor | None, hidden: torch.Tensor | None,
                    weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Validate shapes; return (targets (N,), logits (N, V) | None, hidden (N, C) | None)."""
    if (logits is None) == (hidden is None):
        raise ConfigError("expected exactly one of logits= or hidden= (with lm_weight=); "
                          f"found logits={'set' if logits is not None else 'None'}, "
                          f"hidden={'set' if hidden is not None else 'None'}; fix: pass one of them")
    x = cast(torch.Tensor, logits if logits is not None else hidden)  # one of them, checked above
    if hidden is not None and (weight is None or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]):
        raise ConfigError(f"lm_weight must be the (V, {hidden.shape[-1]}) LM-head weight for hidden of shape "
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


def _check_loss_terms(label_smoothing: float, z_loss: float) -> None:
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ConfigError(f"label_smoothing must be in [0, 1] (F.cross_entropy's); found {label_smoothing}")
    if not 0.0 <= float(z_loss) < float("inf"):
        raise ConfigError(f"z_loss must be a finite value >= 0 (PaLM used 1e-4); found {z_loss}")


def _check_targets(t: torch.Tensor, valid: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Targets outside [0, V) that are not ignore_index: one line (nanoGPT marks ignored targets -1, not
    -100). One host read per call; skipped while torch.compile traces (a graph has no host read)."""
    if torch.compiler.is_compiling():
        return
    bad = valid & ((t < 0) | (t >= vocab))
    if bool(bad.any()):
        value = int(t[bad][0])
        fix = (f"pass ignore_index={value} (the value your stack marks ignored targets with)" if value < 0 else
               f"check the targets: the model's vocabulary has {vocab} entries")
        raise ConfigError(f"targets must be in [0, {vocab}) or ignore_index={ignore_index}; found {value} "
                          f"({int(bad.sum())} of {t.numel()} targets); fix: {fix}")


def _check_num_items(n: torch.Tensor | float) -> None:
    """``num_items_in_batch`` is a count of tokens: a positive finite number (0 gave inf, -3 a negative loss). A
    tensor must hold one value; its value is checked when it is on the CPU and not being compiled (on a GPU the
    check would cost a host sync every step; under torch.compile it would break the graph)."""
    fix = "pass the number of kept (or valid) tokens of the whole optimizer step, or None for this batch's own"
    if isinstance(n, torch.Tensor):
        if n.numel() != 1 or n.dtype == torch.bool or n.is_complex():
            raise ConfigError(f"num_items_in_batch: expected one number, found a {n.dtype} tensor of shape "
                              f"{tuple(n.shape)}; {fix}")
        if n.device.type != "cpu" or torch.compiler.is_compiling():
            return  # reading the value would be a host sync on a GPU, a graph break under torch.compile
        n = n.item()
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n <= 0:
        raise ConfigError(f"num_items_in_batch: expected a positive count of tokens, found {n!r}; {fix}")


def _check_options(score: str, scores: object, scope: str, reduction: str,
                   num_items_in_batch: torch.Tensor | float | None, group: ProcessGroup | None,
                   position_ids: torch.Tensor | None) -> None:
    if scores is None and score not in SCORES:
        raise ConfigError(f"score must be one of {' | '.join(SCORES)}; found {score!r}; fix: score='entropy'")
    if scope not in LOSS_SCOPES:
        raise ConfigError(f"scope must be one of {' | '.join(LOSS_SCOPES)}; found {scope!r}; fix: scope='batch'")
    if reduction not in REDUCTIONS:
        raise ConfigError(f"reduction must be one of {' | '.join(REDUCTIONS)}; found {reduction!r}; "
                          "fix: reduction='mean' (or 'sum' and divide by your own count)")
    if reduction == "sum" and num_items_in_batch is not None:
        raise ConfigError("num_items_in_batch divides the sum: it needs reduction='mean'; found reduction='sum'; "
                          "fix: drop one of them")
    if num_items_in_batch is not None:
        _check_num_items(num_items_in_batch)
    if group is not None and scope != "batch":
        raise ConfigError("group= shares one threshold over the ranks' whole batches: it needs scope='batch'; "
                          f"found scope={scope!r}")
    if position_ids is not None and scope != "sequence":
        raise ConfigError("position_ids= marks the sequences of a packed batch for scope='sequence'; found "
                          f"scope={scope!r}; fix: drop position_ids= or set scope='sequence'")


def _token_scores(t: torch.Tensor, logits2d: torch.Tensor | None, hidden2d: torch.Tensor | None,
                  weight: torch.Tensor | None, head: Head, impl: str, need_entropy: bool,
                  chunk_size: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss (N,), entropy (N,) | None, lse (N,) | None) of every row, detached fp32."""
    if logits2d is not None:  # only a (chunk, V) fp32 copy of the logits alive at a time
        return (*chunked_scores(lambda s, e: logits2d[s:e].float(), t, need_entropy=need_entropy,
                                chunk_size=chunk_size), None)
    hidden2d, weight = cast(torch.Tensor, hidden2d), cast(torch.Tensor, weight)  # hidden= came with lm_weight=
    if impl == "transformed":
        return (*chunked_scores(lambda s, e: head.logits(hidden2d[s:e], weight), t, need_entropy=need_entropy,
                                chunk_size=chunk_size), None)
    ts = backend(impl, hidden2d.device.type, HeadOptions(chunk_size)).token_stats(hidden2d, weight, t,
                                                                                 need_entropy=need_entropy)
    return ts.loss, ts.entropy, ts.lse


def _risk_scores(score: str, scores: torch.Tensor | Callable[[TokenScores], torch.Tensor] | None,
                 targets: torch.Tensor, own_loss: torch.Tensor, own_entropy: torch.Tensor | None) -> torch.Tensor:
    """The (N,) fp32 detached scores the selection ranks."""
    if scores is None:
        return cast(torch.Tensor, own_entropy) if score == "entropy" else own_loss  # scored with entropy
    if callable(scores):
        entropy = cast(torch.Tensor, own_entropy)  # a callable receives both: scored with entropy
        scores = scores(TokenScores(loss=own_loss.view(targets.shape), entropy=entropy.view(targets.shape)))
    if not isinstance(scores, torch.Tensor) or scores.shape != targets.shape:
        raise ConfigError(f"scores must be a tensor of the targets' shape {tuple(targets.shape)} (or a callable "
                          f"returning one); found {type(scores).__name__} "
                          f"{tuple(scores.shape) if isinstance(scores, torch.Tensor) else ''}; "
                          "fix: one score per target position")
    return scores.detach().reshape(-1).float()


def _select(scores: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor, alpha: float | torch.Tensor,
            scope: str, position_ids: torch.Tensor | None, group: ProcessGroup | None,
            bound: float) -> select.Kept:
    """``bound``: the float alpha fixing the static number of rows (``select.check_alpha``'s; alpha itself
    when it is a float)."""
    if group is not None:
        return select.across_ranks(scores, valid, alpha, group, bound)
    if scope == "sequence":
        seg, rows = select.segments(targets.shape, position_ids, scores.device)
        k_bound = targets.shape[0] * risk.num_kept(targets.shape[1], bound) if rows else scores.numel()
        return select.by_sequence(scores, valid, alpha, seg, k_bound)
    return select.over_batch(scores, valid, alpha, bound)


def _stats(kept: select.Kept) -> SelectionStats:
    """The statistics of the whole selection (of the group with ``group=``)."""
    kept_rows = torch.zeros_like(kept.all_valid).index_put((kept.all_index,), kept.all_keep)
    return selection_stats(kept.all_scores, kept_rows, valid=kept.all_valid)


def _chunk_scores(chunks: list[torch.Tensor], t_shaped: torch.Tensor, need_entropy: bool,
                  chunk_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss (N,), entropy (N,) | None) of a list of logit chunks, in the targets' order."""
    loss, ent = [], []
    for c, tc in zip(chunks, t_shaped.split([c.shape[-2] for c in chunks], dim=-1)):
        lo, en, _ = _token_scores(tc.reshape(-1), c.reshape(-1, c.shape[-1]), None, None, Head(), "naive",
                                  need_entropy, chunk_size)
        loss.append(lo.view(tc.shape))
        if need_entropy:
            ent.append(cast(torch.Tensor, en).view(tc.shape))
    return torch.cat(loss, -1).reshape(-1), (torch.cat(ent, -1).reshape(-1) if need_entropy else None)


def _kept_ce(t: torch.Tensor, logits2d: torch.Tensor | None, hidden2d: torch.Tensor | None,
            weight: torch.Tensor | None, head: Head, impl: str, index: torch.Tensor, lse: torch.Tensor | None,
            chunk_size: int, label_smoothing: float = 0.0, z_loss: float = 0.0) -> torch.Tensor:
    if logits2d is not None:
        return row_loss(logits2d[index].float(), t[index], label_smoothing, z_loss)
    hidden2d, weight = cast(torch.Tensor, hidden2d), cast(torch.Tensor, weight)  # hidden= came with lm_weight=
    if impl == "transformed":
        return head_selected_ce(head, hidden2d, weight, t, index, chunk_size=chunk_size,
                                label_smoothing=label_smoothing, z_loss=z_loss)
    return backend(impl, hidden2d.device.type, HeadOptions(chunk_size)).per_token_ce(hidden2d, weight, t, index,
                                                                                    lse=lse)


@overload
def selective_loss(targets: torch.Tensor, *, return_tokens: Literal[False] = False,
                   **options: Any) -> tuple[torch.Tensor, SelectionStats]: ...


@overload
def selective_loss(targets: torch.Tensor, *, return_tokens: Literal[True],
                   **options: Any) -> tuple[torch.Tensor, SelectionStats, TokenOutputs]: ...


@overload
def selective_loss(targets: torch.Tensor, *, return_tokens: bool,
                   **options: Any) -> tuple[torch.Tensor, SelectionStats] | \
        tuple[torch.Tensor, SelectionStats, TokenOutputs]: ...


def selective_loss(targets: torch.Tensor, *, logits: torch.Tensor | Sequence[torch.Tensor] | None = None,
                   hidden: torch.Tensor | None = None, lm_weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, logit_scale: float | None = None,
                   softcap: float | None = None, score: str = "entropy",
                   scores: torch.Tensor | Callable[[TokenScores], torch.Tensor] | None = None,
                   alpha: float | torch.Tensor = 0.1, scope: str = "batch", position_ids: torch.Tensor | None = None,
                   group: ProcessGroup | None = None, reduction: str = "mean",
                   num_items_in_batch: torch.Tensor | int | None = None,
                   alpha_min: float = 0.0, return_tokens: bool = False, ignore_index: int = -100,
                   label_smoothing: float = 0.0,
                   z_loss: float = 0.0, impl: str = "auto", chunk_size: int = 1024,
                   **unsupported: object) -> tuple[torch.Tensor, SelectionStats] | \
        tuple[torch.Tensor, SelectionStats, TokenOutputs]:
    """ESLM's selective cross-entropy: the CE of the highest-risk 1 - alpha of the tokens.

    targets:   (N,) or (B, T) integers, already aligned with the predictions (no shift inside).
    logits:    (..., V) with targets.shape == logits.shape[:-1], or a list of its chunks along the sequence
               (litgpt's chunked logits: (..., t_i, V) with sum t_i = T); or
    hidden:    (..., C) final hidden states with lm_weight (V, C), the LM-head weight: the full logits are never
               built (the path for long sequences and large vocabularies); bias (V,), logit_scale and softcap
               describe heads whose logits are softcap * tanh(scale * (h W^T + b) / softcap) (Gemma, Cohere,
               Granite).
    score:     "entropy" (ESLM VaR-entropy) or "loss" (ESLM CVaR-loss); or
    scores:    your own risk score: a tensor of the targets' shape, or a callable receiving ``TokenScores`` (the
               model's own per-token loss and entropy) and returning one; e.g. Rho-1's excess loss
               ``scores=lambda own: own.loss - reference_loss``. Detached, never differentiated.
    alpha:     fraction of the scored tokens dropped, in [0, 1); alpha = 0 is plain CE. A Python float, or a
               0-dim tensor (a new value needs no recompile: docs/dropin.md); the CE is then computed for
               num_kept(N, alpha_min) rows (every row with the default alpha_min=0; pass Ada's to compute fewer).
    scope:     "batch" (the VaR over this call's tokens) or "sequence" (per sequence: per row of (B, T) targets,
               or per packed sequence with ``position_ids`` (B, T), a new sequence wherever it is 0).
    group:     a torch.distributed process group: one VaR threshold over the tokens of all its ranks (each rank
               keeps its share of the global top K; every rank must pass the same number of tokens). Default
               None: the VaR is per rank and per call.
    reduction: "mean": kept CE sum / K (K of the whole group with group=), or / ``num_items_in_batch`` when
               given (the kept tokens of the whole optimizer step: ``kept_tokens`` counts them before the
               forward); "sum": the kept CE sum.
    return_tokens: also return ``TokenOutputs`` (per-token kept mask, score, loss).
    ignore_index: the target value that marks an unscored position (-100: Hugging Face, PyTorch; nanoGPT
               uses -1). Any other target outside [0, V) is a one-line ConfigError.
    label_smoothing, z_loss: the kept tokens' loss is (1 - eps) CE + eps x mean_v(-log p_v) (F.cross_entropy's
               label smoothing) plus z_loss x logsumexp(logits)^2 (PaLM's z-loss, Liger's lse_square_scale).
               The risk scores stay the model's own loss or entropy. On the hidden path they take the chunked,
               checkpointed route of the transformed heads (not impl="fused").
    impl:      "auto" (logits: naive; hidden: the device's default head backend: fused on CPU, triton on CUDA
               when installed), or a head backend of ``eslm.ops.head_backend.BACKENDS`` ("fused", "naive", ...).

    Returns (loss () fp32, SelectionStats), or (loss, SelectionStats, TokenOutputs) with return_tokens. The
    statistics (``eslm.selection.stats.SelectionStats``, the trainer's type; no per-domain counts here) are over
    the whole group with ``group=``, the same on every rank; with scope "sequence" num_kept is the sum of the K_s.
    Dropped and ignored tokens get exactly zero gradient.
    """
    if unsupported:
        keywords = list(inspect.signature(selective_loss).parameters)[1:-1]  # targets and **unsupported aside
        raise ConfigError(f"selective_loss got unsupported keyword(s) {', '.join(sorted(unsupported))}; expected "
                          f"targets and any of {', '.join(keywords)}; fix: drop them (class weights and "
                          "reduction='none' are not supported; return_tokens=True gives per-token losses; the "
                          "LM-head weight is lm_weight=)")
    if logits is not None and lm_weight is not None:
        raise ConfigError("lm_weight= is the LM-head weight that goes with hidden= (not F.cross_entropy's class "
                          "weights, which selective_loss does not take); found it with logits=, where it would be "
                          "ignored; fix: drop lm_weight=, or pass hidden= instead of logits=")
    alpha, bound = select.check_alpha(alpha, alpha_min)
    _check_options(score, scores, scope, reduction, num_items_in_batch, group, position_ids)
    _check_loss_terms(label_smoothing, z_loss)
    weight: Any = lm_weight  # None with logits= (_flatten_inputs checks which was given)
    chunks = _logit_chunks(logits, targets)
    if chunks is not None:  # validated like one tensor: the first chunk stands for the logits' shape
        _flatten_inputs(targets[..., :chunks[0].shape[-2]], chunks[0], None, None)
        t, logits2d, hidden2d = targets.reshape(-1).long(), None, None
    else:
        t, logits2d, hidden2d = _flatten_inputs(targets, cast("torch.Tensor | None", logits), hidden, weight)
    head = Head(bias, logit_scale, softcap).check(weight.shape[0] if weight is not None else 0)
    impl = _resolve_impl(impl, logits is not None, head, extras=bool(label_smoothing or z_loss))
    valid = t != ignore_index
    vocab = chunks[0].shape[-1] if chunks is not None else \
        logits2d.shape[1] if logits2d is not None else weight.shape[0]
    _check_targets(t, valid, vocab, ignore_index)
    safe_t = torch.where(valid, t, torch.zeros_like(t))  # ignored rows get a dummy in-range target

    need_entropy = callable(scores) or (scores is None and score == "entropy")
    if chunks is not None:
        own_loss, own_entropy = _chunk_scores(chunks, safe_t.view(targets.shape), need_entropy, chunk_size)
        lse = None
    else:
        own_loss, own_entropy, lse = _token_scores(safe_t, logits2d, hidden2d, weight, head, impl, need_entropy,
                                                   chunk_size)
    risk_scores = _risk_scores(score, scores, targets, own_loss, own_entropy)
    kept = _select(risk_scores, valid, targets, alpha, scope, position_ids, group, bound)
    if chunks is not None:  # every row's loss, chunk by chunk, then the kept rows (no full-logits copy)
        every = [row_loss(c.reshape(-1, c.shape[-1]).float(), tc.reshape(-1), label_smoothing, z_loss).view(tc.shape)
                 for c, tc in zip(chunks, safe_t.view(targets.shape).split([c.shape[-2] for c in chunks], dim=-1))]
        ce = torch.cat(every, -1).reshape(-1)[kept.index]
    else:
        ce = _kept_ce(safe_t, logits2d, hidden2d, weight, head, impl, kept.index, lse, chunk_size,
                      label_smoothing, z_loss)
    # torch.where, not a product: a -inf/nan in an unkept row must not leak into the sum or its gradient
    loss = torch.where(kept.keep, ce, torch.zeros_like(ce)).sum()
    if reduction == "mean":
        loss = loss / (num_items_in_batch if num_items_in_batch is not None else kept.k.clamp(min=1))
    stats = _stats(kept)
    if not return_tokens:
        return loss, stats
    zero = torch.zeros_like(risk_scores)
    tokens = TokenOutputs(kept=kept.mask(t.numel()).view(targets.shape),
                          score=torch.where(valid, risk_scores, zero).view(targets.shape),
                          loss=torch.where(valid, own_loss, zero).view(targets.shape))
    return loss, stats, tokens


def token_losses(targets: torch.Tensor, *, logits: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                 lm_weight: torch.Tensor | None = None, ignore_index: int = -100,
                 chunk_size: int = 1024) -> torch.Tensor:
    """Per-token cross-entropy of the targets' shape, detached fp32, 0 where ignored: e.g. a frozen reference
    model's losses for Rho-1's excess-loss score (chunked: never more than a (chunk, V) fp32 block)."""
    t, logits2d, hidden2d = _flatten_inputs(targets, logits, hidden, lm_weight)
    valid = t != ignore_index
    safe_t = torch.where(valid, t, torch.zeros_like(t))
    impl = "naive" if logits2d is not None else "auto"
    loss, _, _ = _token_scores(safe_t, logits2d, hidden2d, lm_weight, Head(), impl, False, chunk_size)
    return torch.where(valid, loss, torch.zeros_like(loss)).view(targets.shape)


def kept_tokens(targets: torch.Tensor, *, alpha: float | torch.Tensor, ignore_index: int = -100, scope: str = "batch",
                position_ids: torch.Tensor | None = None, group: ProcessGroup | None = None) -> torch.Tensor:
    """K of one call, as a 0-dim int64 tensor, from its targets alone (known before the forward, no sync).

    Sum it over the micro-batches of an optimizer step (and all-reduce it over data-parallel ranks when each
    rank selects on its own) to get ``num_items_in_batch``: the loss is then exactly the mean CE of the step's
    kept tokens. With ``group=`` pass the same group as to ``selective_loss`` (the count is then the group's).
    """
    alpha, _ = select.check_alpha(alpha)
    _check_options("loss", None, scope, "mean", None, group, position_ids)
    valid = (targets != ignore_index).reshape(-1)
    if scope == "sequence":  # the sum of the K_s of every sequence s
        seg = select.segments(targets.shape, position_ids, targets.device)[0]
        n_seg = torch.zeros(valid.numel(), dtype=torch.long, device=valid.device).index_add_(0, seg, valid.long())
        return risk.num_kept_tensor(n_seg, alpha).sum()
    n = valid.sum()
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(n, group=group)
    return risk.num_kept_tensor(n, alpha)


def select_tokens(scores: torch.Tensor, valid: torch.Tensor, *, alpha: float | torch.Tensor, scope: str = "batch",
                  position_ids: torch.Tensor | None = None,
                  group: ProcessGroup | None = None) -> tuple[torch.Tensor, SelectionStats]:
    """The selection alone, for a loss you compute yourself (a trainer's own fused per-token loss, DFT, a
    distillation term): (kept mask of ``scores``' shape, SelectionStats). ``scores`` and ``valid`` (the scored
    tokens) have one shape, (N,) or (B, T); the selective loss is then ``(token_loss * kept).sum() / K``, K
    being ``stats.num_kept`` (or the step's kept count under accumulation)."""
    alpha, bound = select.check_alpha(alpha)
    _check_options("loss", None, scope, "mean", None, group, position_ids)
    if valid.shape != scores.shape:
        raise ConfigError(f"valid must have the scores' shape {tuple(scores.shape)}; found {tuple(valid.shape)}")
    kept = _select(scores.detach().reshape(-1).float(), valid.reshape(-1).bool(), valid, alpha, scope,
                   position_ids, group, bound)
    return kept.mask(scores.numel()).view(scores.shape), _stats(kept)
