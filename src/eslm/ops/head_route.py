"""Which route the LM-head loss takes, chosen by a cost model with per-device coefficients (the one chooser).

Every caller of the fused head asks here: the training step (through ``CrossEntropy``), the drop-in
``eslm.api.selective_loss(hidden=, weight=)`` and GREATS' per-sample losses (both through
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

Per-token losses (any upstream gradient; the drop-in API and GREATS) take ``kept_recompute`` (logits of the
kept rows formed again in the backward), or ``grads_in_pass`` when the head weight needs no gradient and no
scoring pass ran (GREATS: the one pass forms each row's hidden-state gradient, which the backward only scales).

Cost (seconds) = FLOPs x ``matmul_s_per_flop`` + moved bytes x ``copy_s_per_byte`` + softmax elements x
``softmax_s_per_elem`` (+ the fp32 -> compute-dtype conversion of the gradient rows, as bytes, in bf16) + with
entropy scores, on the routes that do not get the entropy from a P W they form anyway (``all_rows`` and
``grads_in_pass`` with fp32 matmuls do), entropy elements x ``entropy_s_per_elem``. The coefficients are
measured per device and dtype by ``eslm calibrate`` (``eslm.ops.head_costs``).
The cheapest route among those allowed wins; ties go to the route listed first above that is allowed. The
cached routes are allowed only when the caller allows the (N, V) buffer (``train.loss_cache_probs``).

Memory: ``kept_cached`` holds what ``all_rows`` holds (the buffer), and at any moment no more beside it than
one (V, C)-sized fp32 block, which ``all_rows`` also holds (its weight-gradient accumulator).
"""

from __future__ import annotations

from dataclasses import dataclass

from eslm.ops.token_stats import HeadWork
from eslm.ops.head_costs import FLOPS_ONLY, costs_for

ROUTES = ("all_rows", "kept_cached", "grads_in_pass", "kept_recompute")
CACHED_ROUTES = ("all_rows", "kept_cached")
PER_TOKEN_ROUTES = ("kept_recompute", "grads_in_pass")
ROUTE_CHOICES = ("auto",) + ROUTES


@dataclass(frozen=True)
class Geometry:
    """What a route's cost depends on beyond the row counts: the head's width C, vocabulary V, where it runs."""

    n_embd: int
    vocab: int
    device: str = "cpu"  # device type: cpu | cuda
    dtype: str = "float32"  # the matmuls' compute dtype (autocast's when it is on)

    @property
    def lowp(self) -> bool:
        return self.dtype != "float32"


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


def moved_rows(n: int, k: int) -> int:
    """Rows the compaction of ``kept_cached`` copies: at most min(K, N-K) (the kept rows behind the first K)."""
    return min(k, n - k)


def entropy_from_pw(route: str, geom: Geometry) -> bool:
    """Whether the route's pass gets the entropy as h . (P W) from a P W over every row it forms anyway (fp32
    matmuls, ``all_rows`` or ``grads_in_pass``); otherwise the entropy is an elementwise sum over the logits."""
    return not geom.lowp and route in ("all_rows", "grads_in_pass")


def route_seconds(route: str, n: int, k: int, geom: Geometry, costs, *, scored: bool, per_token: bool = False,
                  weight_grad: bool = True, entropy: bool = False) -> float:
    """Predicted seconds of a route for one micro-batch (the scoring pass included when it runs; ``entropy``:
    the scores include the entropy).

    One row of one head matmul is 2CV FLOPs; the softmax chain (max, exp, sum, normalise) is V elements per
    row; a moved fp32 row is read and written (8V bytes); in bf16 the gradient rows' fp32 softmax is converted
    to the compute dtype (6V bytes: read 4, write 2); the entropy's elementwise work is V elements per scored
    row, unless the route gets it from P W (``entropy_from_pw``)."""
    f = 2.0 * geom.n_embd * geom.vocab * costs.matmul_s_per_flop  # one row of one head matmul
    sm = geom.vocab * costs.softmax_s_per_elem  # one row's softmax chain
    conv = 6.0 * geom.vocab * costs.copy_s_per_byte if geom.lowp else 0.0

    def passes(rows):  # logits + softmax of ``rows`` rows
        return rows * (f + sm)

    def grads(rows, matmuls=2):  # the gradient matmuls of ``rows`` rows (and their conversion in bf16)
        return rows * (matmuls * f + conv)

    ent = (n * geom.vocab * costs.entropy_s_per_elem  # the entropy's elementwise work, where the route pays it
           if scored and entropy and not per_token and not entropy_from_pw(route, geom) else 0.0)
    score = passes(n) + ent if scored else 0.0
    if per_token:
        if route == "kept_recompute":
            first = score if scored else passes(k)  # the forward's lse (given by the scoring pass when it ran)
            return first + passes(k) + grads(k, 2 if weight_grad else 1)
        if route == "grads_in_pass":
            return score + passes(k) + grads(k, 1)
        raise ValueError(f"expected a per-token head route in {PER_TOKEN_ROUTES}; found {route!r}")
    if route == "all_rows":
        return passes(n) + ent + grads(n)
    if route == "kept_cached":
        return passes(n) + ent + grads(k) + moved_rows(n, k) * 8.0 * geom.vocab * costs.copy_s_per_byte
    if route == "grads_in_pass":
        return passes(n) + ent + grads(n) + (n - k) * (f + sm + f)
    if route == "kept_recompute":
        return score + passes(k) + grads(k)
    raise ValueError(f"expected a head route in {ROUTES}; found {route!r}")


def allowed_routes(n: int, k: int, *, scored: bool, cache: bool, per_token: bool = False,
                   weight_grad: bool = True) -> tuple[str, ...]:
    """The routes that can run this micro-batch, in tie-break order."""
    if per_token:
        return ("kept_recompute",) if weight_grad or scored else ("grads_in_pass", "kept_recompute")
    if not scored:  # no scores: no pass to cache; every row kept is plain training's one pass
        return ("grads_in_pass",) if k == n else ("kept_recompute", "grads_in_pass")
    return (CACHED_ROUTES if cache else ()) + ("grads_in_pass", "kept_recompute")


def choose_route(n: int, k: int, geom: Geometry | None, *, scored: bool, cache: bool = True,
                 per_token: bool = False, weight_grad: bool = True, forced: str = "auto", costs=None,
                 entropy: bool = False) -> str:
    """The route for a micro-batch of ``n`` rows with ``k`` kept: ``forced`` when it is not "auto" and can run
    here (a cached route needs scores and ``cache``), else the cheapest allowed route by ``route_seconds``
    with ``costs`` (default: ``eslm.ops.head_costs.costs_for`` the geometry's device and dtype). Without a
    geometry (nothing ran yet) the FLOPs alone decide (C = V = 1, no traffic)."""
    if not 1 <= k <= n:
        raise ValueError(f"expected 1 <= kept <= rows; found kept={k}, rows={n}")
    options = allowed_routes(n, k, scored=scored, cache=cache, per_token=per_token, weight_grad=weight_grad)
    if forced != "auto":
        if forced not in ROUTE_CHOICES:
            raise ValueError(f"expected a head route in {ROUTE_CHOICES}; found {forced!r}")
        if forced in options:
            return forced
    if len(options) == 1:
        return options[0]
    if geom is None:
        geom, costs = Geometry(1, 1), FLOPS_ONLY
    elif costs is None:
        costs = costs_for(geom.device, geom.dtype)
    cost = {r: route_seconds(r, n, k, geom, costs, scored=scored, per_token=per_token, weight_grad=weight_grad,
                             entropy=entropy) for r in options}
    return min(options, key=lambda r: (cost[r], options.index(r)))
