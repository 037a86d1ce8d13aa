"""Which route the LM-head loss takes: a fixed rule (the one chooser), ``train.loss_route`` the override.

Every caller of the fused head asks here. The routes, their costs and memory, and the rule by (scores needed?,
rows dropped?): docs/fused_loss.md's tables; ``choose_route`` is the rule, ``route_work`` what each route runs.
"""

from __future__ import annotations

from eslm.ops.token_stats import HeadWork

ROUTES = ("all_rows", "kept_cached", "grads_in_pass", "kept_recompute")
CACHED_ROUTES = ("all_rows", "kept_cached")
ROUTE_CHOICES = ("auto",) + ROUTES


def route_work(route: str, n: int, k: int, *, scored: bool) -> HeadWork:
    """What a route runs at the head for n rows with k kept, as rows of head matmuls (``HeadWork``); each
    route's cost in docs/fused_loss.md's table."""
    rows = {"all_rows": (n, n, 0), "kept_cached": (n, k, 0), "grads_in_pass": (n, n, 2 * (n - k)),
            "kept_recompute": (n, k, k) if scored else (k, k, 0)}  # (forward, backward, recompute) rows
    if route not in rows:
        raise ValueError(f"expected a head route in {ROUTES}; found {route!r}")
    return HeadWork(*(float(r) for r in rows[route]))


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
