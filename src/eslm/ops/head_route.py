"""Which route the LM-head loss takes: a fixed rule (the one chooser), ``train.loss_route`` the override.

Every caller of the fused head asks here: the training step (through ``CrossEntropy``), the drop-in
``eslm.api.selective_loss(hidden=, lm_weight=)`` and GREATS' per-sample losses (both through
``eslm.ops.fused_head.fused_selected_ce``). The routes, for N rows of width C, vocabulary V and K kept rows
(u = one (N x C) x (C x V) matmul, k = K/N; the scoring pass, when selection needs scores, is 1u):

* ``all_rows``        the scoring pass keeps its softmax P (one (N, V) fp32 buffer); the two gradient
                      matmuls run over all N rows with the dropped rows zeroed: 1u + 2u.
* ``kept_cached``     the same buffer; after the selection the kept rows' softmax is compacted to the
                      buffer's first K rows, in place, and the two gradient matmuls run over those K rows:
                      1u + 2ku, plus moving at most min(K, N-K) rows of V floats.
* ``grads_in_pass``   no (N, V) buffer: the pass forms every row's gradients while the logits are at hand;
                      the dropped rows' share is recomputed and subtracted: 3u + 2(1-k)u. With every row
                      kept (CLM) it is plain training's one pass, 3u.
* ``kept_recompute``  no (N, V) buffer: logits, softmax and both gradient matmuls for the K kept rows only,
                      after the scoring pass if there is one: 1u + 3ku (3ku without scores).

The rule (``choose_route``), by whether selection needs scores and whether rows are dropped:

* scores, rows dropped: ``kept_cached``; every row kept: ``all_rows`` (nothing to compact);
* scores, the (N, V) buffer forbidden (``train.loss_cache_probs=false``): ``grads_in_pass`` when at least
  three quarters of the rows are kept, else ``kept_recompute`` (where their costs cross on CPU: between keep
  0.7 and 0.8, the softmax's share of a row's work moving it);
* no scores, rows dropped (the random control): ``kept_recompute``; every row kept (CLM): the one pass,
  ``grads_in_pass``;
* per-token losses (any upstream gradient): ``kept_recompute`` (the kept rows' logits formed again in the
  backward), or ``grads_in_pass`` when the head weight needs no gradient and no scoring pass ran (GREATS: the
  one pass forms each row's hidden-state gradient, which the backward only scales).

This is what a per-device cost model picked at every preset's shapes on CPU (docs/fused_loss.md); on CUDA the
default backend is Triton's, which has one route. ``benchmarks/loss_path.py`` measures every route forced.

Memory: ``kept_cached`` holds what ``all_rows`` holds (the buffer), and at any moment no more beside it than
one (V, C)-sized fp32 block, which ``all_rows`` also holds (its weight-gradient accumulator).
"""

from __future__ import annotations

from eslm.ops.token_stats import HeadWork

ROUTES = ("all_rows", "kept_cached", "grads_in_pass", "kept_recompute")
CACHED_ROUTES = ("all_rows", "kept_cached")
ROUTE_CHOICES = ("auto",) + ROUTES


def route_work(route: str, n: int, k: int, *, scored: bool) -> HeadWork:
    """What a route runs at the head for n rows with k kept, as rows of head matmuls (``HeadWork``).

    Every route forms the logits of all N rows once, but ``kept_recompute`` without a scoring pass (the
    random-drop control), which forms only the K kept rows' logits. ``grads_in_pass`` recomputes the N-K dropped
    rows' logits and forms their weight gradient again to subtract it (two matmuls each); ``kept_recompute``
    after a scoring pass forms the kept rows' logits again."""
    if route == "all_rows":
        return HeadWork(float(n), float(n), 0.0)
    if route == "kept_cached":
        return HeadWork(float(n), float(k), 0.0)
    if route == "grads_in_pass":
        return HeadWork(float(n), float(n), 2.0 * (n - k))
    if route == "kept_recompute":
        return HeadWork(float(n), float(k), float(k)) if scored else HeadWork(float(k), float(k), 0.0)
    raise ValueError(f"expected a head route in {ROUTES}; found {route!r}")


def choose_route(n: int, k: int, *, scored: bool, cache: bool = True, per_token: bool = False,
                 weight_grad: bool = True, forced: str = "auto") -> str:
    """The route for a micro-batch of ``n`` rows with ``k`` kept: ``forced`` when it is not "auto" and can run
    here (a cached route needs scores and ``cache``; every row kept without scores is the one pass), else the
    rule's (the module's docstring). Per-token losses take the rule's route."""
    if not 1 <= k <= n:
        raise ValueError(f"expected 1 <= kept <= rows; found kept={k}, rows={n}")
    if forced != "auto" and not per_token:
        if forced not in ROUTES:
            raise ValueError(f"expected a head route in {ROUTE_CHOICES}; found {forced!r}")
        if (scored and cache) if forced in CACHED_ROUTES else (scored or k < n or forced == "grads_in_pass"):
            return forced
    if per_token:
        return "grads_in_pass" if not (weight_grad or scored) else "kept_recompute"
    if not scored:
        return "grads_in_pass" if k == n else "kept_recompute"
    if cache:
        return "all_rows" if k == n else "kept_cached"
    return "grads_in_pass" if 4 * k >= 3 * n else "kept_recompute"
