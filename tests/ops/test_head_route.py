"""The head route chooser (eslm.ops.head_route) and its coefficients (eslm.ops.head_costs)."""

import json

import pytest

from eslm.errors import ConfigError
from eslm.ops.head_costs import ENV, FILE_KIND, HeadCosts, costs_for
from eslm.ops.head_route import (ROUTES, Geometry, allowed_routes, choose_route, moved_rows, route_seconds,
                                 route_work)
from eslm.ops.token_stats import HeadWork

SMALL = Geometry(128, 50304)  # the `small` preset's head on CPU, fp32
GPT2 = Geometry(768, 50304)


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


def test_the_cost_model_in_head_matmul_units():
    """With the FLOPs term alone, each route costs what the docs say, in u = one N-row head matmul:
    all_rows 3u, kept_cached 1 + 2k, grads_in_pass 3 + 2(1-k), kept_recompute 1 + 3k (3k without scores)."""
    costs, g, n = HeadCosts(1.0, 0.0, 0.0, 0.0), Geometry(1, 1), 1000
    u = 2.0 * n
    for k in (1, 100, 500, 800, 1000):
        kf = k / n
        assert route_seconds("all_rows", n, k, g, costs, scored=True) == pytest.approx(3 * u)
        assert route_seconds("kept_cached", n, k, g, costs, scored=True) == pytest.approx((1 + 2 * kf) * u)
        assert route_seconds("grads_in_pass", n, k, g, costs, scored=True) == pytest.approx((3 + 2 * (1 - kf)) * u)
        assert route_seconds("kept_recompute", n, k, g, costs, scored=True) == pytest.approx((1 + 3 * kf) * u)
        assert route_seconds("kept_recompute", n, k, g, costs, scored=False) == pytest.approx(3 * kf * u)
    assert moved_rows(10, 3) == 3 and moved_rows(10, 7) == 3 and moved_rows(10, 10) == 0


@pytest.mark.parametrize("costs", [HeadCosts(1e-11, 1e-10, 1e-8, 1e-9), HeadCosts(1e-11, 3e-9, 1e-8, 5e-9),
                                   HeadCosts(1e-15, 3e-13, 8e-12, 5e-12), HeadCosts(1.0, 0.0, 0.0, 0.0)])
@pytest.mark.parametrize("geom", [SMALL, GPT2, Geometry(8, 1031), Geometry(4, 50304, "cuda", "bfloat16")])
@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("scored,entropy", [(True, False), (True, True), (False, False)])
def test_the_chooser_picks_the_cheapest_allowed_route(costs, geom, cache, scored, entropy):
    """For every (N, K) of a grid the chooser's route is the cheapest of the allowed routes by the model, it
    picks kept_cached exactly where that is the cheapest, and it never picks a cached route it may not use."""
    for n in (1, 7, 512, 4096):
        for k in sorted({1, max(1, n // 5), n // 2 or 1, (4 * n) // 5 or 1, n - 1 or 1, n}):
            allowed = allowed_routes(n, k, scored=scored, cache=cache)
            cost = {r: route_seconds(r, n, k, geom, costs, scored=scored, entropy=entropy) for r in allowed}
            got = choose_route(n, k, geom, scored=scored, cache=cache, costs=costs, entropy=entropy)
            assert got in allowed and cost[got] == min(cost.values()), (n, k, cost)
            if "kept_cached" in allowed and cost["kept_cached"] < min(c for r, c in cost.items() if r != "kept_cached"):
                assert got == "kept_cached"
            if not (cache and scored):
                assert got not in ("all_rows", "kept_cached")


def test_the_chooser_at_the_presets_with_the_built_in_cpu_costs():
    """The built-in CPU coefficients: the kept rows route at every alpha of the benchmarks (small and 124M),
    recompute-or-subtract without the cache (at the old 0.8 keep crossover, within the traffic terms), the
    kept rows only without scores, and the one pass for CLM."""
    for geom, n in ((SMALL, 512), (SMALL, 2048), (GPT2, 1024), (GPT2, 12288)):
        for alpha in (0.1, 0.2, 0.5):
            k = n - int(alpha * n)
            assert choose_route(n, k, geom, scored=True) == "kept_cached"
            assert choose_route(n, k, geom, scored=False) == "kept_recompute"
        assert choose_route(n, n, geom, scored=False) == "grads_in_pass"
        assert choose_route(n, n // 2, geom, scored=True, cache=False) == "kept_recompute"
        assert choose_route(n, n - n // 20, geom, scored=True, cache=False) == "grads_in_pass"


def test_a_tiny_head_on_slow_copies_keeps_all_rows():
    """Where moving rows costs more than the matmuls it saves (a narrow head, copies at 1 GB/s against 100
    GFLOP/s matmuls), the model prefers all_rows, and the chooser follows it; a wide head still saves."""
    costs = HeadCosts(1e-11, 1e-9, 1e-9, 1e-10)
    assert choose_route(512, 256, Geometry(8, 50304), scored=True, costs=costs) == "all_rows"
    assert choose_route(512, 256, GPT2, scored=True, costs=costs) == "kept_cached"
    # the H100 data-sheet defaults: tensor-core FLOPs are cheap against moving rows, so the same holds for the
    # small preset's C = 128 in bf16, not for 124M's C = 768
    assert choose_route(512, 256, Geometry(128, 50304, "cuda", "bfloat16"), scored=True) == "all_rows"
    assert choose_route(12288, 6144, Geometry(768, 50304, "cuda", "bfloat16"), scored=True) == "kept_cached"


def test_the_entropy_is_priced_where_the_route_pays_it():
    """With fp32 matmuls all_rows gets the entropy from the P W it forms anyway; kept_cached pays an elementwise
    pass for it. Where that pass costs more than the dropped rows' matmuls, entropy scores keep all_rows while
    loss scores take kept_cached; in bf16 (P W too coarse, both pay) the entropy changes nothing."""
    costs, n, k = HeadCosts(1e-11, 1e-11, 1e-9, 5e-9), 1000, 900
    ent = {r: route_seconds(r, n, k, SMALL, costs, scored=True, entropy=True) -
           route_seconds(r, n, k, SMALL, costs, scored=True) for r in ROUTES}
    assert ent["all_rows"] == ent["grads_in_pass"] == 0.0
    assert ent["kept_cached"] == pytest.approx(n * 50304 * 5e-9) == ent["kept_recompute"]
    assert choose_route(n, k, SMALL, scored=True, costs=costs) == "kept_cached"
    assert choose_route(n, k, SMALL, scored=True, costs=costs, entropy=True) == "all_rows"
    bf16 = Geometry(128, 50304, "cpu", "bfloat16")
    assert choose_route(n, k, bf16, scored=True, costs=costs, entropy=True) == choose_route(
        n, k, bf16, scored=True, costs=costs)


def test_forced_and_per_token_routes():
    assert choose_route(100, 50, SMALL, scored=True, forced="all_rows") == "all_rows"
    assert choose_route(100, 50, SMALL, scored=True, forced="grads_in_pass") == "grads_in_pass"
    # a forced cached route cannot run without scores or without the cache: the chooser's pick instead
    assert choose_route(100, 100, SMALL, scored=False, forced="kept_cached") == "grads_in_pass"
    assert choose_route(100, 50, SMALL, scored=True, cache=False, forced="all_rows") in ("grads_in_pass",
                                                                                         "kept_recompute")
    with pytest.raises(ValueError):
        choose_route(100, 50, SMALL, scored=True, forced="fast")
    with pytest.raises(ValueError):
        choose_route(100, 0, SMALL, scored=True)
    # per-token (drop-in API, GREATS): the one pass forms row gradients when the weight needs none and no
    # scores were given; otherwise the kept rows are recomputed
    assert choose_route(100, 100, SMALL, scored=False, per_token=True, weight_grad=False) == "grads_in_pass"
    assert choose_route(100, 60, SMALL, scored=True, per_token=True, weight_grad=False) == "kept_recompute"
    assert choose_route(100, 60, SMALL, scored=False, per_token=True, weight_grad=True) == "kept_recompute"
    assert choose_route(100, 60, None, scored=True) == "kept_cached"  # no geometry yet: FLOPs alone
    assert set(ROUTES) == {"all_rows", "kept_cached", "grads_in_pass", "kept_recompute"}


def test_costs_table_and_the_env_file(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    cpu = costs_for("cpu", "float32")
    assert "measured" in cpu.source and cpu.matmul_s_per_flop > 0
    assert "NOT measured" in costs_for("cuda", "bfloat16").source  # the H100 data-sheet default, labelled
    assert costs_for("mps", "float16") == costs_for("cpu", "float16") or costs_for("mps", "float16") == cpu
    f = tmp_path / "costs.json"
    f.write_text(json.dumps({"kind": FILE_KIND, "costs": {"cuda/bfloat16": {
        "matmul_s_per_flop": 2e-15, "copy_s_per_byte": 4e-13, "softmax_s_per_elem": 1e-11, "entropy_s_per_elem": 5e-12,
        "source": "mine"}}}))
    monkeypatch.setenv(ENV, str(f))
    assert costs_for("cuda", "bfloat16") == HeadCosts(2e-15, 4e-13, 1e-11, 5e-12, "mine")
    assert costs_for("cpu", "float32") == cpu  # entries the file lacks stay built in
    for bad, says in (("{", "expected JSON"), ('{"kind": "other"}', "head-costs file"),
                      (json.dumps({"kind": FILE_KIND, "costs": {"cuda": {}}}), "device/dtype")):
        f.write_text(bad)
        with pytest.raises(ConfigError, match=says) as e:
            costs_for("cuda", "bfloat16")
        assert "\n" not in str(e.value) and "fix:" in str(e.value)
    monkeypatch.setenv(ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="cannot read"):
        costs_for("cpu", "float32")


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


def test_the_chooser_switches_routes_when_this_machines_table_says_so(tmp_path, monkeypatch):
    """The chooser reads the table measured on this machine (the cache), not one shipped table: with copies
    cheap against the matmuls it compacts the kept rows (kept_cached); on a machine where moving a row costs
    more than the matmuls it saves (a narrow head), it keeps every row (all_rows)."""
    from eslm.ops import calibrate as cal
    from eslm.ops import head_costs as hc

    monkeypatch.delenv(ENV, raising=False)
    narrow = Geometry(8, 50304)
    picks = {}
    for name, costs in (("cheap copies", HeadCosts(1e-11, 1e-12, 1e-9, 1e-10)),
                        ("dear copies", HeadCosts(1e-11, 1e-9, 1e-9, 1e-10))):
        monkeypatch.setenv(hc.CACHE_ENV, str(tmp_path / name))
        monkeypatch.setattr(hc, "_MEMO", {})  # a new process on another machine
        cal.store(hc.machine_key("cpu"), {"float32": costs})
        assert hc.lookup("cpu", "float32")[1]["table"] == "measured"
        picks[name] = choose_route(512, 256, narrow, scored=True)
    assert picks == {"cheap copies": "kept_cached", "dear copies": "all_rows"}
