"""Instance-level selection (``eslm.selection.instances``): the kept sequences against a hand computation of the
early exit's risk, no gradient for the dropped ones, the exit's FLOPs against FlopCounterMode, the settings."""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from eslm.config import build_config, method_context
from eslm.data.batch import Batch
from eslm.errors import ConfigError
from eslm.flops import FlopsModel, micro_batch_flops
from eslm.methods import build_method
from eslm.model.gpt import GPT, ModelConfig
from eslm.selection.instances import InstanceRows, exit_model
from eslm.train.step import StepOptions, forward_backward

CFG = ModelConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=64, block_size=16)
B, T = 4, 16


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _batches(n: int, seed: int = 1) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
        y = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
        out.append(Batch(x, y, torch.randint(0, 2, (B,), generator=g)))
    return out


def _hand_risk(model: GPT, x: torch.Tensor, y: torch.Tensor, k: int, score: str) -> list[float]:
    """The exit's per-row risk written out: embeddings, the first k blocks, ln_f, full logits, log-softmax."""
    t = model.transformer
    with torch.no_grad():
        h = t.wte(x) + t.wpe(torch.arange(x.shape[1]))
        for block in list(t.h)[:k]:
            h = block(h)
        logp = torch.log_softmax(t.ln_f(h) @ model.head_weight.T, dim=-1)
        loss = -logp.gather(2, y[..., None]).squeeze(2)
        entropy = -(logp.exp() * logp).sum(-1)
    return (loss if score == "loss" else entropy).mean(1).tolist()


def _rows(batches: list[Batch]) -> list[tuple[int, ...]]:
    return [tuple(r.tolist()) for b in batches for r in b.x]


@pytest.mark.parametrize("score,k,beta", [("loss", 1, 0.5), ("entropy", 2, 0.5), ("loss", 3, 0.75)])
def test_the_kept_sequences_are_the_top_by_the_exits_risk(score, k, beta):
    model, batches = _model(), _batches(4)
    rows = InstanceRows(beta=beta, exit_layers=k, score=score, model_config=CFG, seq_len=T, impl="fused")
    kept = rows.select_step(model, batches)
    x, y = torch.cat([b.x for b in batches]), torch.cat([b.y for b in batches])
    risk = _hand_risk(model, x, y, k, score)
    n_keep = len(risk) - math.floor(beta * len(risk))
    order = sorted(range(len(risk)), key=lambda i: -risk[i])
    assert risk[order[n_keep - 1]] > risk[order[n_keep]]  # no tie at the threshold in this draw
    expected = sorted(order[:n_keep])  # the top 1 - beta, in the loader's order
    assert _rows(kept) == [tuple(x[i].tolist()) for i in expected]
    assert [b.x.shape for b in kept] == [(B, T)] * (n_keep // B)  # re-packed into full micro-batches
    assert all(torch.equal(b.y, y[expected[j * B:(j + 1) * B]]) for j, b in enumerate(kept))
    assert rows.risk(model, x, y).tolist() == pytest.approx(risk, rel=1e-5, abs=1e-6)


def test_the_exit_is_the_trained_model_stopped_after_k_blocks():
    model, x = _model(), _batches(1)[0].x
    state = torch.get_rng_state()
    view = exit_model(model, 2)
    assert torch.equal(torch.get_rng_state(), state)  # built without a random draw
    assert view.config.n_layer == 2 and view.head_weight is model.head_weight
    own = {id(p) for p in model.parameters()}
    assert all(id(p) in own for p in view.parameters())  # no parameter of its own, no copy
    with torch.no_grad():
        t = model.transformer
        h = t.wte(x) + t.wpe(torch.arange(T))
        for block in list(t.h)[:2]:
            h = block(h)
        assert torch.equal(view(x), t.ln_f(h))
    with pytest.raises(ConfigError, match="exit_layers"):
        exit_model(model, 4)


def _method(name: str, **over):
    cfg = build_config(overrides=[f"method.name={name}", f"data.seq_len={T}", f"train.micro_batch_size_seqs={B}",
                                  *(f"{k}={v}" for k, v in over.items())])
    return build_method(method_context(cfg, device=torch.device("cpu"), n_domains=2, model_config=CFG))


def _grads(model: GPT) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_dropped_sequences_get_no_gradient():
    # an eslm-h step at alpha 0 has the gradient of a CLM step on the kept sequences alone: the dropped ones add
    # nothing
    batches = _batches(4)
    method = _method("eslm-h-loss", **{"method.alpha": 0.0, "train.loss_impl": "naive"})
    model = _model()
    kept = method.rows.select_step(model, batches)
    res = forward_backward(model, model, method, batches, StepOptions(accum_steps=2), step=1, lr=1e-3)
    assert res.tokens_seen == 2 * B * T and len(res.selections) == 2
    got = _grads(model)
    clm_model = _model()
    forward_backward(clm_model, clm_model, _method("clm", **{"train.loss_impl": "naive"}), kept,
                     StepOptions(accum_steps=2), step=1, lr=1e-3)
    want = _grads(clm_model)
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)
    dropped = set(_rows(batches)) - set(_rows(kept))
    assert len(dropped) == 2 * B  # half the candidates, none of which reached the trained model's forward


def _unpriced_flops(name: str, batches: list[Batch], impl: str) -> tuple[float, list[Batch]]:
    """(FLOPs that FlopCounterMode counts in one step of ``name`` beyond the executed count of eslm.flops, the
    micro-batches that trained). FlopCounterMode counts matmuls (SDPA's math kernel: over all T x T positions);
    the layernorm gains are in N but are no matmul (tests/test_flops.py), so they are taken out: 6 FLOPs per
    token and gain of the trained model's step, 2 of the exit's forward."""
    method = _method(name, **{"method.instance.exit_layers": 2, "method.alpha": 0.25, "train.loss_impl": impl})
    model = _model()
    trained = method.rows.select_step(model, batches)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        res = forward_backward(model, model, method, batches, StepOptions(accum_steps=2), step=1, lr=1e-3)
    n = len(res.selections)
    s = micro_batch_flops(FlopsModel.from_config(CFG, T), method, tokens_seen=res.tokens_seen // n,
                          tokens_kept=res.tokens_kept // n, step_work=res.work)
    ln = lambda layers: (2 * layers + 1) * CFG.n_embd  # noqa: E731
    exit_tokens = sum(p.tokens for w in method.extra_work(res.tokens_seen // n) for p in w.passes) * n
    return fc.get_total_flops() - (n * s.executed - 6 * ln(CFG.n_layer) * res.tokens_seen
                                   - 2 * ln(2) * exit_tokens), trained


TOKEN_LEVEL = {"eslm-h-entropy": "eslm-entropy", "eslm-h-loss": "eslm-loss", "random-instance": "clm",
               "random-h": "random"}  # each instance method's token-level counterpart


@pytest.mark.parametrize("impl", ["naive", "fused"])
@pytest.mark.parametrize("name", list(TOKEN_LEVEL))
def test_executed_flops_match_the_flop_counter(name, impl):
    # the step's executed FLOPs against FlopCounterMode: whatever the instance selection adds (the exit over every
    # candidate, the step over the kept rows) is priced exactly, i.e. an instance method's step differs from its
    # count by exactly what its token-level counterpart's step on the same kept micro-batches differs by (the
    # head's own accounting of the token-level methods, which this test does not judge: with the naive backend
    # random and clm match exactly, a scored naive step forms its logits twice and declares them once)
    gap, trained = _unpriced_flops(name, _batches(4), impl)
    token_gap, _ = _unpriced_flops(TOKEN_LEVEL[name], trained, impl)
    assert len(trained) == 2 and gap == pytest.approx(token_gap, abs=1e-6)
    if impl == "naive" and name.startswith("random"):
        assert gap == 0


def test_the_trainer_reads_more_and_trains_the_same_batch():
    rows = _method("eslm-h-entropy", **{"method.instance.beta": 0.75}).rows
    assert rows.candidate_batches(3) == 12 and rows.candidate_rows(B) == B and rows.num_rows(B) == B
    assert _method("clm").rows.candidate_batches(3) == 3
    with pytest.raises(ConfigError, match="whole number"):
        _method("random-instance", **{"method.instance.beta": 0.2}).rows.candidate_batches(1)
    with pytest.raises(ConfigError, match="beta"):
        _method("eslm-h-loss", **{"method.instance.beta": 1.0})
    with pytest.raises(ConfigError, match="exit_layers"):
        _method("eslm-h-loss", **{"method.instance.exit_layers": 0})


def test_the_random_controls_keep_the_same_count_and_run_no_exit():
    batches = _batches(4)
    rows = _method("random-instance").rows
    assert rows.extra_work(B * T).passes == ()
    called = []
    model = _model()
    model.register_forward_hook(lambda *a: called.append(1))
    kept = rows.select_step(model, batches)
    assert called == [] and len(_rows(kept)) == 2 * B and set(_rows(kept)) <= set(_rows(batches))
    again = _method("random-instance").rows  # the same seed: the same draw; its state resumes it
    assert _rows(again.select_step(model, batches)) == _rows(kept)
    again.load_state_dict(rows.state_dict())
    assert _rows(again.select_step(model, batches)) == _rows(rows.select_step(model, batches))


def test_a_kept_row_is_the_loaders_row_and_the_step_never_waits():
    from conftest import HostReads

    model, batches = _model(), _batches(2)
    rows = InstanceRows(beta=0.5, exit_layers=1, score="entropy", model_config=CFG, seq_len=T, impl="fused")
    rows.select_step(model, batches)  # lazy one-time work
    with HostReads():
        kept = rows.select_step(model, batches)
    assert set(_rows(kept)) <= set(_rows(batches)) and len(kept) == 1


@pytest.mark.parametrize("name", ["eslm-h-entropy", "random-h"])
def test_a_resumed_run_continues_bit_for_bit(name, tiny_data, tmp_path):
    # six steps straight against three, then a resume to six: the same records (the loader's position over the
    # candidates it read, the random controls' generators); the tiny run reads 4 micro-batches a step for 2
    from conftest import read_metrics, tiny_overrides
    from eslm import metrics as M
    from eslm.train.trainer import train

    common = {"method.name": name, "train.lr_decay_steps": 6, "checkpoint.interval": 3, "eval.interval": 3}
    straight = train(build_config(overrides=tiny_overrides(tiny_data, tmp_path / "a", **common,
                                                           **{"train.max_steps": 6})))
    train(build_config(overrides=tiny_overrides(tiny_data, tmp_path / "b", **common, **{"train.max_steps": 3})))
    resumed = train(build_config(overrides=tiny_overrides(tiny_data, tmp_path / "b", **common,
                                                          **{"train.max_steps": 6}) + ["run.resume=true"]))

    def records(run_dir):
        return [{k: v for k, v in r.items() if k not in M.TIMING_KEYS} for r in read_metrics(run_dir, "train")]

    assert records(resumed.run_dir) == records(straight.run_dir)
    assert len(records(straight.run_dir)) == 6 and resumed.val_loss == straight.val_loss
    assert records(straight.run_dir)[-1][M.TOKENS_SEEN] == 6 * 4 * 4 * 32  # the candidates read: 2x the trained


DDP_SCRIPT = '''
import sys, torch
from eslm.data.batch import Batch
from eslm.methods import build_method
from eslm.config import build_config, method_context
from eslm.model.gpt import GPT, preset
from eslm.train.step import StepOptions, forward_backward
from eslm.train.distributed import init_distributed

out_path = sys.argv[1]
info, device = init_distributed("cpu", "gloo")
torch.manual_seed(0)
mc = preset("tiny", vocab_size=64)
model = GPT(mc)
g = torch.Generator().manual_seed(1)
xs = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(4)]
batches = [Batch(x, x.roll(-1, 1), torch.arange(2) + 2 * i) for i, x in enumerate(xs)]  # domain: the row's id
wrapped = model
if info.world_size > 1:
    from torch.nn.parallel import DistributedDataParallel as DDP
    wrapped = DDP(model)
    batches = batches[info.rank * 2:(info.rank + 1) * 2]
cfg = build_config(overrides=["method.name=eslm-h-loss", "method.alpha=0.0", "data.seq_len=16",
                              "train.micro_batch_size_seqs=2", "train.loss_impl=naive"])
method = build_method(method_context(cfg, device=device, n_domains=8, model_config=mc))
kept = method.rows.select_step(model, batches, info.world_size)
opts = StepOptions(accum_steps=len(kept), normalize="global", world_size=info.world_size)
forward_backward(wrapped, model, method, batches, opts, step=1, lr=1e-3)
rows = torch.cat([b.domain for b in kept])
if info.world_size > 1:
    every = [torch.empty_like(rows) for _ in range(info.world_size)]
    torch.distributed.all_gather(every, rows)
    rows = torch.cat(every)
if info.rank == 0:
    torch.save({"rows": sorted(rows.tolist()), "shapes": [tuple(b.x.shape) for b in kept],
                **{n: p.grad.clone() for n, p in model.named_parameters()}}, out_path)
if info.world_size > 1:
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
'''


@pytest.mark.slow
def test_ddp_keeps_the_top_sequences_of_every_rank_and_the_same_gradient(tmp_path):
    # one process with the step's 4 candidate micro-batches against 2 ranks with 2 each: the same 4 sequences kept
    # (the threshold is the step's over both ranks), each rank trains full micro-batches, the same gradient
    import os
    import subprocess
    import sys

    from conftest import torchrun

    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    r = subprocess.run([sys.executable, str(script), str(one)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    torchrun([str(script), str(two)])
    g1, g2 = torch.load(one), torch.load(two)
    rows = g1.pop("rows")
    assert rows == g2.pop("rows") and len(rows) == 4
    assert g1.pop("shapes") == [(2, 16), (2, 16)] and g2.pop("shapes") == [(2, 16)]
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-5, atol=1e-7, msg=name)
