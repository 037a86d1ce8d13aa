"""CrossEntropy (eslm.objectives.base): the training step on every head route against the naive loss path, and
the FLOPs accounting's head rows following the route that ran."""

import pytest
import torch

from eslm.errors import ConfigError
from eslm.objectives.base import CrossEntropy
from eslm.ops.head_route import route_work
from eslm.ops.token_stats import HeadWork


def _step(name, alpha, overrides):
    from eslm.config import build_config, method_context
    from eslm.data.batch import Batch
    from eslm.methods import build_method
    from eslm.model.gpt import GPT, preset
    from eslm.train.step import StepOptions, forward_backward

    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=131))
    g = torch.Generator().manual_seed(1)
    batches = [Batch(x=torch.randint(0, 131, (3, 24), generator=g), y=torch.randint(0, 131, (3, 24), generator=g),
                     domain=torch.zeros(3, dtype=torch.long)) for _ in range(2)]
    cfg = build_config(overrides=[f"method.name={name}", f"method.alpha={alpha}", "train.loss_chunk_size=17",
                                  *overrides])
    method = build_method(method_context(cfg, device=torch.device("cpu"), n_domains=1))
    res = forward_backward(model, model, method, batches, StepOptions(accum_steps=2), step=1, lr=1e-3)
    return res, {n: p.grad.clone() for n, p in model.named_parameters()}, method


@pytest.mark.parametrize("name,alpha", [("eslm-entropy", 0.1), ("eslm-entropy", 0.5), ("eslm-loss", 0.2),
                                        ("random", 0.5)])
@pytest.mark.parametrize("route", ["auto", "kept_cached", "all_rows", "grads_in_pass", "kept_recompute"])
def test_every_route_gives_the_naive_steps_gradients(name, alpha, route):
    """The whole step (two micro-batches, tied embedding) with the route forced: the naive path's loss, kept
    tokens and every parameter's gradient; head_work reports the rows of the route that ran."""
    rn, gn, _ = _step(name, alpha, ["train.loss_impl=naive"])
    rf, gf, method = _step(name, alpha, ["train.loss_impl=fused", f"train.loss_route={route}"])
    torch.testing.assert_close(rf.loss, rn.loss, rtol=1e-5, atol=1e-6)
    assert rf.tokens_kept == rn.tokens_kept
    for n in gn:
        torch.testing.assert_close(gf[n], gn[n], rtol=1e-4, atol=1e-6, msg=n)
    ce, n_tok, k = method.objective, rf.tokens_seen // 2, rf.tokens_kept // 2
    scored = bool(method.tokens.score)
    ran = ce.last_route
    if route != "auto" and scored:
        assert ran == route
    if not scored:  # the random control has no scores: no softmax to cache; by cost, the kept rows only
        assert ran == (route if route in ("grads_in_pass", "kept_recompute") else "kept_recompute")
    if route == "auto" and scored:  # the tiny preset's head at the built-in CPU coefficients: the cached
        # softmax; its kept rows only where they save more than the compaction costs (at alpha 0.1 with entropy
        # scores the model calls the two a tie, 1-2%, and all_rows may win)
        assert ran == ("kept_cached" if alpha >= 0.2 else ran if ran in ("kept_cached", "all_rows") else None)
    assert ce.head_work(n_tok, k, scored=scored) == route_work(ran, n_tok, k, scored=scored)


def _registered():
    from eslm.ops import head_backend as hb

    return [s.name if hb.available(s.name) else
            pytest.param(s.name, marks=pytest.mark.skip(reason=f"needs the {s.extra} extra")) for s in hb.BACKENDS]


@pytest.mark.parametrize("impl", _registered())
@pytest.mark.parametrize("name,alpha", [("clm", 0.0), ("eslm-entropy", 0.5), ("eslm-loss", 0.2), ("random", 0.5)])
def test_every_backend_gives_the_naive_steps_gradients(impl, name, alpha):
    """Every registered head backend through the whole step (two micro-batches, tied embedding): the naive path's
    loss, kept tokens and every parameter's gradient; the FLOPs booking is the backend's declared work."""
    from eslm.ops.head_backend import HeadState

    rn, gn, _ = _step(name, alpha, ["train.loss_impl=naive"])
    rb, gb, method = _step(name, alpha, [f"train.loss_impl={impl}"])
    torch.testing.assert_close(rb.loss, rn.loss, rtol=1e-5, atol=1e-6)
    assert rb.tokens_kept == rn.tokens_kept
    for n in gn:
        torch.testing.assert_close(gb[n], gn[n], rtol=1e-4, atol=1e-6, msg=n)
    ce, n_tok, k = method.objective, rb.tokens_seen // 2, rb.tokens_kept // 2
    scored = bool(method.tokens.score)
    assert ce.head().name == impl
    assert ce.head_work(n_tok, k, scored=scored) == ce.head().work(n_tok, k, scored=scored,
                                                                   state=HeadState(ce.last_route))


def test_clm_runs_the_one_pass_and_counts_every_row():
    res, _, method = _step("clm", 0.0, [])
    assert method.objective.last_route == "grads_in_pass"
    assert method.objective.head_work(res.tokens_seen // 2, res.tokens_seen // 2, scored=False) == HeadWork(72.0, 72.0, 0.0)


def test_a_route_that_cannot_run_is_a_config_error():
    from eslm.config import build_config

    with pytest.raises(ConfigError, match="loss_cache_probs=false forbids") as e:
        build_config(overrides=["train.loss_route=kept_cached", "train.loss_cache_probs=false"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="train.loss_route"):
        build_config(overrides=["train.loss_route=fastest"])
    with pytest.raises(ConfigError, match="fix:"):
        CrossEntropy(cache_probs=False, route="all_rows")
    assert CrossEntropy().head_work(100, 50, scored=True) == HeadWork(100.0, 50.0, 0.0)  # before any step: the chooser's pick


def test_the_random_controls_executed_flops_count_only_the_head_forwards_that_ran():
    """Without a scoring pass the random control forms the logits of its kept rows only (kept_recompute): its
    dropped rows' head forward and backward never run, so its executed FLOPs are CLM's less 6CV per dropped
    token (2CV forward + 4CV backward) and nothing else."""
    from eslm.flops import FlopsModel, micro_batch_flops
    from eslm.model.gpt import preset

    res, _, method = _step("random", 0.5, [])
    assert method.objective.last_route == "kept_recompute"
    n, k = res.tokens_seen // 2, res.tokens_kept // 2
    assert 0 < k < n
    fm = FlopsModel.from_config(preset("tiny", vocab_size=131), 24)
    got = micro_batch_flops(fm, method, tokens_seen=n, tokens_kept=k, step_work=res.work)
    head_matmul_per_row = 2 * fm.n_embd * fm.vocab_size
    assert got.executed == pytest.approx(got.dense - (n - k) * 3 * head_matmul_per_row)


def test_head_work_asks_the_backend_that_ran(monkeypatch):
    """On CUDA "auto" is the triton backend, while a prediction (no tensor at hand) asks the CPU's: the FLOPs
    booking after a step must ask the backend that ran, whose routes the CPU backend does not know (every
    `eslm train` on an H200 stopped at its first step on this). Modelled on the CPU by "auto" resolving to
    triton for a tensor's device and to fused without one."""
    pytest.importorskip("triton")
    from eslm.ops import head_backend as hb
    from eslm.ops.head_backend import HeadState

    real = hb.resolve
    monkeypatch.setattr(hb, "resolve", lambda name, device_type=None:
                        "triton" if name == "auto" and device_type else real(name, device_type))
    res, _, method = _step("eslm-entropy", 0.5, [])
    ce, n, k = method.objective, res.tokens_seen // 2, res.tokens_kept // 2
    assert ce.last_head is not None and ce.last_head.name == "triton" and ce.head().name == "fused"
    assert ce.head_work(n, k, scored=True) == ce.last_head.work(n, k, scored=True, state=HeadState(ce.last_route))
