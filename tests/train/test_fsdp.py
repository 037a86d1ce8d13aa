"""FSDP2 (distributed.fsdp=true) on two CPU processes with gloo, launched by torchrun --standalone (free port).

An FSDP run (the CLI) stops at step 3 and is resumed to step 6; it is compared step by step with an
uninterrupted DDP run of the same config (method clm: a token selector's threshold is discontinuous, so
reduction-order noise could change a selection and the losses would then differ by more than noise). The
gradients of the selective step itself (micro and step scope, naive and fused loss, accumulation with no_sync)
are compared with DDP's at fixed weights, in the same launch as the DDP run (launches are the cost).
"""

import textwrap

import pytest
import torch

from conftest import read_metrics, tiny_overrides, torchrun
from eslm import metrics as M

pytestmark = pytest.mark.slow

COMMON = {"method.name": "clm", "train.lr_decay_steps": 6, "checkpoint.keep_last": 2}

# Launch 3: the gradients of the selective step under FSDP and DDP, then the DDP reference run (argv[1:]).
DDP_SCRIPT = textwrap.dedent('''
    import copy, sys, torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from eslm.config import build_config, method_context
    from eslm.data.batch import Batch
    from eslm.methods import build_method
    from eslm.model.gpt import GPT, preset
    from eslm.train.distributed import FSDPModel, init_distributed, shard_fsdp
    from eslm.train.step import StepOptions, forward_backward
    from eslm.train.trainer import train

    info, device = init_distributed("cpu", "gloo")
    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=64))
    g = torch.Generator().manual_seed(1 + info.rank)
    xs = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(3)]
    batches = [Batch(x, x.roll(-1, 1), torch.zeros(2, dtype=torch.long)) for x in xs]
    for scope, impl in [(s, i) for s in ("micro", "step") for i in ("naive", "fused")]:
        cfg = build_config(overrides=["method.name=eslm-entropy", "method.alpha=0.3", f"method.scope={scope}",
                                      f"train.loss_impl={impl}"])
        opts = StepOptions(accum_steps=len(batches), normalize="global", world_size=2)
        grads, losses = {}, {}
        for kind in ("ddp", "fsdp"):
            raw = copy.deepcopy(model)
            wrapped = DDP(raw) if kind == "ddp" else FSDPModel(shard_fsdp(raw, info, device))
            method = build_method(method_context(cfg, device=device, n_domains=1))
            res = forward_backward(wrapped, raw, method, batches, opts, step=1, lr=1e-3)
            losses[kind] = float(res.loss)
            grads[kind] = {n: (p.grad.full_tensor() if kind == "fsdp" else p.grad)
                           for n, p in raw.named_parameters()}
        assert losses["ddp"] == losses["fsdp"], (scope, impl, losses)
        for n, gd in grads["ddp"].items():
            torch.testing.assert_close(grads["fsdp"][n], gd, rtol=1e-5, atol=1e-7, msg=f"{scope} {impl} {n}")
        print(f"rank {info.rank} {scope} {impl}: gradients equal", flush=True)
    train(build_config(overrides=sys.argv[1:]))  # DDP; shuts the process group down
''')


def _train(data, out_dir, *extra, **over):
    return torchrun(["-m", "eslm.cli", "train", *tiny_overrides(data, out_dir, **{**COMMON, **over}), *extra])


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    first = _train(tiny_data, root / "fsdp", "distributed.fsdp=true", **{"train.max_steps": 3})
    resumed = _train(tiny_data, root / "fsdp", "distributed.fsdp=true", "--resume")
    script = root / "ddp.py"
    script.write_text(DDP_SCRIPT)
    ddp = torchrun([str(script), *tiny_overrides(tiny_data, root / "ddp", **COMMON)])
    return {"fsdp": root / "fsdp" / "t", "ddp": root / "ddp" / "t", "first": first, "resumed": resumed,
            "ddp_out": ddp}


def test_fsdp_trains_checkpoints_and_resumes(runs):
    assert runs["first"].count("step 3/3") == 1  # rank 0 logs alone
    assert "resumed from" in runs["resumed"] and "at step 3" in runs["resumed"]
    lines = read_metrics(runs["fsdp"], "train")
    assert [r[M.STEP] for r in lines] == [1, 2, 3, 4, 5, 6]
    assert all(torch.isfinite(torch.tensor(r[M.TRAIN_LOSS])) for r in lines)
    assert lines[-1][M.TOKENS_SEEN] == 6 * 4 * 32 * 2 * 2  # steps x seqs x len x micro-steps x ranks
    assert [r[M.STEP] for r in read_metrics(runs["fsdp"], "eval")] == [3, 6]
    ckpts = sorted(p.name for p in (runs["fsdp"] / "checkpoints").glob("step_*.pt"))
    assert ckpts == ["step_0000003.pt", "step_0000006.pt"]


def test_fsdp_matches_ddp_step_by_step(runs):
    """Same init, same batches, fp32: equal up to reduction order (also across the FSDP resume at step 3)."""
    f, d = read_metrics(runs["fsdp"]), read_metrics(runs["ddp"])
    assert [(r[M.KIND], r[M.STEP]) for r in f] == [(r[M.KIND], r[M.STEP]) for r in d]
    for a, b in zip(f, d):
        for key in (M.TRAIN_LOSS, M.GRAD_NORM, M.VAL_LOSS):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5), (a[M.STEP], key)


@pytest.mark.parametrize("step", [3, 6])
def test_fsdp_checkpoint_is_a_plain_checkpoint(runs, step):
    """The FSDP checkpoint has the format of a DDP one: it loads with eslm.model.loading and into a plain
    (single-process) model and optimizer, and holds the same values as the DDP run's."""
    from eslm.model.loading import load_model
    from eslm.train.checkpoint import load_checkpoint
    from eslm.train.optim import build_optimizer

    name = f"checkpoints/step_{step:07d}.pt"
    f, d = load_checkpoint(runs["fsdp"] / name), load_checkpoint(runs["ddp"] / name)
    assert f.keys() == d.keys() and f["model"].keys() == d["model"].keys()
    for k in d["model"]:
        assert f["model"][k].device.type == "cpu" and not f["model"][k].requires_grad
        torch.testing.assert_close(f["model"][k], d["model"][k], rtol=1e-5, atol=1e-6, msg=k)
    fo, do = f["optimizer"], d["optimizer"]
    assert fo["param_groups"] == do["param_groups"]
    assert fo["state"].keys() == do["state"].keys()
    for i, s in do["state"].items():
        for k, v in s.items():
            torch.testing.assert_close(fo["state"][i][k], v, rtol=1e-4, atol=1e-7, msg=f"{i}.{k}")

    model, info = load_model(runs["fsdp"] / name)
    assert info["step"] == step
    for k, v in model.state_dict().items():
        assert torch.equal(v, f["model"][k]), k
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), device_type="cpu")
    opt.load_state_dict(f["optimizer"])  # what a resume without FSDP does
    assert torch.equal(opt.state[model.head_weight]["exp_avg"], fo["state"][0]["exp_avg"])


def test_fsdp_gradients_of_the_selective_step_match_ddp(runs):
    """ESLM-entropy with 3 micro-steps (two under no_sync), micro and step scope, naive and fused loss: FSDP's
    reduce-scattered gradients, the tied head's included, equal DDP's (asserted on both ranks in the launch)."""
    assert runs["ddp_out"].count("gradients equal") == 8, runs["ddp_out"]
