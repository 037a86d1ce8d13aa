"""The head route rule (eslm.ops.head_route)."""

import pytest

from eslm.ops.head_route import ROUTES, choose_route, route_work
from eslm.ops.token_stats import HeadWork


def test_route_work_counts_what_each_route_runs():
    """(rows whose logits the forward formed, rows with the two gradient matmuls, rows whose logits matmul ran
    once more), for eslm.flops; never negative. head_tokens gives flops.step_flops' two row counts."""
    assert route_work("all_rows", 100, 90, scored=True) == HeadWork(100.0, 100.0, 0.0)      # softmax kept, every row
    assert route_work("kept_cached", 100, 90, scored=True) == HeadWork(100.0, 90.0, 0.0)     # softmax kept, kept rows only
    assert route_work("grads_in_pass", 100, 90, scored=True) == HeadWork(100.0, 100.0, 20.0)  # dropped rows subtracted
    assert route_work("grads_in_pass", 100, 100, scored=False) == HeadWork(100.0, 100.0, 0.0)  # CLM: one pass
    assert route_work("kept_recompute", 100, 50, scored=True) == HeadWork(100.0, 50.0, 50.0)   # after a scoring pass
    assert route_work("kept_recompute", 100, 50, scored=False) == HeadWork(50.0, 50.0, 0.0)  # random control: no scores, the dropped rows' head forward never runs
    assert route_work("kept_recompute", 100, 50, scored=False).head_tokens(100) == (50.0, -50.0)
    assert route_work("grads_in_pass", 100, 90, scored=True).head_tokens(100) == (100.0, 20.0)
    with pytest.raises(ValueError):
        route_work("masked", 100, 50, scored=True)


def test_the_rule_by_scores_and_kept_rows():
    """The route is a fixed rule of (scores needed?, rows dropped?), the cache and the per-token case; it does not
    depend on the shapes or the machine. Changing the rule fails here (and docs/fused_loss.md says it)."""
    for n in (1, 7, 128, 512, 4096, 12288):
        for k in sorted({1, max(1, n // 5), n // 2 or 1, (3 * n + 3) // 4, n - 1 or 1, n}):
            dropped = k < n
            assert choose_route(n, k, scored=True) == ("kept_cached" if dropped else "all_rows")
            assert choose_route(n, k, scored=False) == ("kept_recompute" if dropped else "grads_in_pass")
            assert choose_route(n, k, scored=True, cache=False) == (
                "grads_in_pass" if 4 * k >= 3 * n else "kept_recompute")
    # the presets' alphas (small: 512 and 2048 rows, 124M: 1024 and 12288): the kept rows route, the random
    # control's kept rows only, CLM's one pass; without the cache, subtract at keep 0.75 and above
    for n in (512, 1024, 2048, 12288):
        for alpha in (0.05, 0.1, 0.2, 0.5, 0.8):
            k = n - int(alpha * n)
            assert choose_route(n, k, scored=True) == "kept_cached"
            assert choose_route(n, k, scored=False) == "kept_recompute"
        assert choose_route(n, n, scored=False) == "grads_in_pass"
        assert choose_route(n, n // 2, scored=True, cache=False) == "kept_recompute"
        assert choose_route(n, 3 * n // 4, scored=True, cache=False) == "grads_in_pass"
        assert choose_route(n, 3 * n // 4 - 1, scored=True, cache=False) == "kept_recompute"


def test_forced_and_per_token_routes():
    assert choose_route(100, 50, scored=True, forced="all_rows") == "all_rows"
    assert choose_route(100, 50, scored=True, forced="grads_in_pass") == "grads_in_pass"
    assert choose_route(100, 50, scored=True, forced="auto") == "kept_cached"
    # a forced cached route cannot run without scores or without the cache: the rule's pick instead
    assert choose_route(100, 100, scored=False, forced="kept_cached") == "grads_in_pass"
    assert choose_route(100, 50, scored=True, cache=False, forced="all_rows") == "kept_recompute"
    # without scores: either uncached route where rows are dropped; every row kept is the one pass
    assert choose_route(100, 50, scored=False, forced="grads_in_pass") == "grads_in_pass"
    assert choose_route(100, 100, scored=False, forced="kept_recompute") == "grads_in_pass"
    with pytest.raises(ValueError):
        choose_route(100, 50, scored=True, forced="fast")
    with pytest.raises(ValueError):
        choose_route(100, 0, scored=True)
    # per-token (drop-in API, GREATS): the one pass forms row gradients when the weight needs none and no
    # scores were given; otherwise the kept rows are recomputed
    assert choose_route(100, 100, scored=False, per_token=True, weight_grad=False) == "grads_in_pass"
    assert choose_route(100, 60, scored=False, per_token=True, weight_grad=False) == "grads_in_pass"
    assert choose_route(100, 60, scored=True, per_token=True, weight_grad=False) == "kept_recompute"
    assert choose_route(100, 60, scored=False, per_token=True, weight_grad=True) == "kept_recompute"
    assert choose_route(100, 60, scored=False, per_token=True, forced="kept_cached") == "kept_recompute"
    assert set(ROUTES) == {"all_rows", "kept_cached", "grads_in_pass", "kept_recompute"}


def test_the_drop_in_api_and_greats_ask_the_chooser(monkeypatch):
    """eslm.api.selective_loss(hidden=, lm_weight=) and GREATS' per-sample losses reach the one chooser: the API
    with its scores (per-token route), GREATS without scores and with a detached head weight (grads_in_pass)."""
    import torch

    import eslm.ops.head_route as hr
    from eslm.api import selective_loss
    from eslm.baselines.greats import _per_sample_loss
    from eslm.model.gpt import GPT, preset

    calls, real = [], hr.choose_route

    def spy(*args, **kw):
        calls.append((kw, real(*args, **kw)))
        return calls[-1][1]

    monkeypatch.setattr(hr, "choose_route", spy)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 16, 8, generator=g, requires_grad=True)
    w = torch.randn(50, 8, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (2, 16), generator=g)
    selective_loss(y, hidden=h, lm_weight=w, alpha=0.5, impl="fused")[0].backward()
    assert [(kw["per_token"], kw["scored"], route) for kw, route in calls] == [(True, True, "kept_recompute")]
    calls.clear()
    model = GPT(preset("tiny", vocab_size=50))
    x = torch.randint(0, 50, (3, 12), generator=g)
    _per_sample_loss(model, model(x), x.roll(-1, 1), exclude_head=True, impl="fused").sum().backward()
    assert [(kw["per_token"], kw["weight_grad"], route) for kw, route in calls] == [(True, False, "grads_in_pass")]
    calls.clear()
    with torch.no_grad():  # no backward will run: the forward alone, no gradient formed in it
        _per_sample_loss(model, model(x), x.roll(-1, 1), exclude_head=True, impl="fused")
    assert calls == []
