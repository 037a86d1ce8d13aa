"""Which tokens one drop-in call keeps: the VaR rule (``eslm.selection.risk``) over the whole call (scope
"batch"), within each sequence (scope "sequence"), or over the tokens of every rank of a process group (``group``).

Every function returns a ``Kept`` of static shapes (no host sync, except ``across_ranks``' size check). Scores
are detached fp32 (N,); ``valid`` (N,) marks the scored tokens: the others are never kept and never counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from eslm.errors import ConfigError
from eslm.selection import risk

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass
class Kept:
    """index (K_max,) int64 rows; keep (K_max,) bool; k () int64 kept tokens; n () int64 scored tokens (both over
    the group with ``group``); scores, valid, index, keep of the whole selection for its statistics (the
    gathered ones with ``group``, else this call's)."""

    index: torch.Tensor
    keep: torch.Tensor
    k: torch.Tensor
    n: torch.Tensor
    all_scores: torch.Tensor
    all_valid: torch.Tensor
    all_index: torch.Tensor
    all_keep: torch.Tensor

    def mask(self, n_rows: int) -> torch.Tensor:
        """(n_rows,) bool: the kept rows of this call."""
        return torch.zeros(n_rows, dtype=torch.bool, device=self.index.device).index_put((self.index,), self.keep)


def check_alpha(alpha: float | torch.Tensor, alpha_min: float = 0.0) -> tuple[float | torch.Tensor, float]:
    """(alpha, bound). In eager code a Python float bounds itself (static K_max = num_kept(rows, alpha)); a 0-dim
    tensor, or a float while torch.compile traces, becomes a float64 tensor and K_max is num_kept(rows,
    alpha_min) (docs/dropin.md). An alpha below alpha_min is refused (in a compiled graph by a device assert)."""
    compiling = torch.compiler.is_compiling()
    if not isinstance(alpha, torch.Tensor) and not compiling:
        alpha = risk.check_alpha(alpha)
        return alpha, alpha
    bound = risk.check_alpha(alpha_min)
    if isinstance(alpha, torch.Tensor):
        if alpha.numel() != 1 or not alpha.dtype.is_floating_point:
            raise ConfigError(f"alpha as a tensor must be one float value; found {alpha.dtype} "
                              f"{tuple(alpha.shape)}; fix: pass a 0-dim float tensor or a Python float")
        t = alpha.detach().reshape(()).double()
    else:
        # a product, not torch.scalar_tensor / torch.full: AOT autograd turns a symbolic float into a graph input
        # only where it enters tensor arithmetic, and specialises it (a recompile per value) elsewhere
        t = torch.ones((), dtype=torch.float64) * alpha
    if compiling:
        torch._assert_async((t >= bound) & (t < 1.0), "alpha must be in [alpha_min, 1)")
    elif not bound <= float(t) < 1.0:
        raise ConfigError(f"alpha must be in [alpha_min, 1) = [{bound}, 1); found {float(t)}; fix: pass "
                          "alpha_min= no larger than the smallest alpha you use")
    return t, bound


def over_batch(scores: torch.Tensor, valid: torch.Tensor, alpha: float | torch.Tensor, bound: float) -> Kept:
    """Keep the top K = N - floor(alpha N) of the call's N scored tokens (alpha a float, or a tensor with the
    float ``bound`` <= alpha fixing the static number of rows: see ``check_alpha``)."""
    index, keep, k, n = risk.select_valid(scores, valid, alpha, bound)
    return Kept(index, keep, k, n, scores, valid, index, keep)


def segments(shape: torch.Size, position_ids: torch.Tensor | None,
             device: torch.device) -> tuple[torch.Tensor, bool]:
    """(segment id (N,) int64 of every token, whether segments are the rows). Without ``position_ids`` a
    sequence is a row of the (B, T) targets; with them (packed, padding-free batches) a sequence also starts
    wherever ``position_ids == 0``."""
    if len(shape) != 2:
        raise ConfigError(f"scope='sequence' needs (B, T) targets; found shape {tuple(shape)}; fix: pass the "
                          "unflattened (batch, time) targets, or use scope='batch'")
    B, T = shape
    row_start = torch.zeros(B, T, dtype=torch.bool, device=device)
    row_start[:, 0] = True
    if position_ids is None:
        return torch.arange(B, device=device).repeat_interleave(T), True
    if position_ids.shape != shape:
        raise ConfigError(f"position_ids must have the targets' shape {tuple(shape)}; found "
                          f"{tuple(position_ids.shape)}; fix: pass the batch's position_ids unchanged")
    starts = (row_start | (position_ids.to(device) == 0)).reshape(-1)
    return torch.cumsum(starts.long(), 0) - 1, False


def by_sequence(scores: torch.Tensor, valid: torch.Tensor, alpha: float | torch.Tensor, seg: torch.Tensor,
                k_bound: int) -> Kept:
    """Keep the top K_s = N_s - floor(alpha N_s) of every sequence s (N_s its scored tokens). One sort puts
    the tokens in (sequence, valid first, score descending) order; a token is kept when its rank within its
    sequence is below K_s. ``k_bound`` >= sum_s K_s is the static number of rows whose CE is computed."""
    n_rows = scores.numel()
    order = torch.argsort(scores, descending=True, stable=True)
    order = order[torch.argsort((~valid[order]).to(torch.int8), stable=True)]
    order = order[torch.argsort(seg[order], stable=True)]
    seg_sorted = seg[order]
    size = torch.zeros(n_rows, dtype=torch.long, device=scores.device).index_add_(0, seg, torch.ones_like(seg))
    n_seg = torch.zeros_like(size).index_add_(0, seg, valid.long())
    k_seg = risk.num_kept_tensor(n_seg, alpha)
    start = torch.cumsum(size, 0) - size
    rank = torch.arange(n_rows, device=scores.device) - start[seg_sorted]
    kept_rows = torch.zeros(n_rows, dtype=torch.bool, device=scores.device).index_put(
        (order,), rank < k_seg[seg_sorted])
    index = torch.argsort((~kept_rows).to(torch.int8), stable=True)[:k_bound]
    keep = kept_rows[index]
    return Kept(index, keep, k_seg.sum(), valid.sum(), scores, valid, index, keep)


def across_ranks(scores: torch.Tensor, valid: torch.Tensor, alpha: float | torch.Tensor, group: ProcessGroup,
                 bound: float) -> Kept:
    """One VaR threshold over the tokens of every rank of ``group``: each rank keeps its share of the global top
    K = num_kept(N_group, alpha). Every rank must pass the same number of rows."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n_rows = scores.numel()
    sizes = torch.empty(world, dtype=torch.long, device=scores.device)
    dist.all_gather_into_tensor(sizes, torch.tensor([n_rows], device=scores.device), group=group)
    if not bool((sizes == n_rows).all()):  # one sync: a size mismatch would otherwise hang or misalign
        raise ConfigError(f"group=: every rank must pass the same number of tokens; found {sizes.tolist()}; "
                          "fix: pad every rank's batch to the same (B, T) with ignore_index")
    all_scores = torch.empty(world * n_rows, dtype=scores.dtype, device=scores.device)
    all_valid = torch.empty(world * n_rows, dtype=torch.uint8, device=scores.device)
    dist.all_gather_into_tensor(all_scores, scores.contiguous(), group=group)
    dist.all_gather_into_tensor(all_valid, valid.to(torch.uint8), group=group)
    g = over_batch(all_scores, all_valid.bool(), alpha, bound)
    mine = torch.zeros(world * n_rows, dtype=torch.bool, device=scores.device).index_put(
        (g.index,), g.keep)[rank * n_rows:(rank + 1) * n_rows]
    index = torch.argsort((~mine).to(torch.int8), stable=True)[:min(n_rows, g.index.numel())]
    return Kept(index, mine[index], g.k, g.n, all_scores, g.all_valid, g.index, g.keep)
