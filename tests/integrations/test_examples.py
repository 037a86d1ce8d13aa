"""The examples run as documented, on tiny models, offline."""

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_hf_trainer_example(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    last = load("hf_trainer_eslm").main(["--steps", "3", "--ada", "--output-dir", str(tmp_path)])
    assert last["step"] == 3 and 0.8 < last["eslm/kept_frac"] <= 1.0
    assert "eval_loss (plain CE)" in capsys.readouterr().out


def test_nanogpt_step_gradient_is_the_exact_kept_mean():
    import math

    import torch
    import torch.nn.functional as F

    ex = load("nanogpt_eslm")
    torch.manual_seed(0)
    model, g = ex.GPT(), torch.Generator().manual_seed(2)
    data = ex.toy_tokens(512)
    micro = [ex.get_batch(data, 4, 32, g) for _ in range(2)]
    micro[1][1][0, 20:] = -100  # padding in one micro-batch: dividing by the accumulation steps would be off
    handle = ex.patch_model(model, head=model.lm_head, alpha=0.3)
    ex.step(model, handle, micro)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    handle.remove()
    kept = []
    for X, Y in micro:
        logits, _ = model(X)
        logits, t = logits.reshape(-1, logits.shape[-1]), Y.reshape(-1)
        valid = t != -100
        with torch.no_grad():
            logp = torch.log_softmax(logits, -1)
            s = (-(logp.exp() * logp).sum(-1)).masked_fill(~valid, float("-inf"))
        n = int(valid.sum())
        idx = torch.topk(s, n - math.floor(0.3 * n)).indices
        kept.append(F.cross_entropy(logits[idx], t[idx], reduction="none"))
    torch.cat(kept).mean().backward()
    for a, w in zip(got, [p.grad for p in model.parameters()]):
        assert torch.allclose(a, w, atol=1e-6)


def _hand_grads(ex, model, micro, alpha, with_loss=False):
    """The gradient of the mean CE over every micro-batch's own top K by entropy (full logits, by hand), and with
    ``with_loss`` that mean too."""
    import math

    import torch
    import torch.nn.functional as F

    model.zero_grad()
    kept = []
    for X, Y in micro:
        logits, _ = model(X)
        logits, t = logits.reshape(-1, logits.shape[-1]), Y.reshape(-1)
        valid = t != -100
        with torch.no_grad():
            logp = torch.log_softmax(logits, -1)
            s = (-(logp.exp() * logp).sum(-1)).masked_fill(~valid, float("-inf"))
        n = int(valid.sum())
        kept.append(F.cross_entropy(logits[torch.topk(s, n - math.floor(alpha * n)).indices],
                                    t[torch.topk(s, n - math.floor(alpha * n)).indices], reduction="none"))
    loss = torch.cat(kept).mean()
    loss.backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return (out, float(loss)) if with_loss else out


DDP_SCRIPT = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
import nanogpt_eslm as ex
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
raw = ex.GPT()
handle = ex.patch_model(raw, head=raw.lm_head, alpha=0.3)
model = torch.nn.parallel.DistributedDataParallel(raw)
data, g = ex.toy_tokens(512), torch.Generator().manual_seed(10 + rank)
micro = [ex.get_batch(data, 4, 32, g) for _ in range(2)]
if rank == 1:
    micro[0][1][:, 8:] = -100  # rank 1 keeps far fewer tokens: a per-rank mean would weight it wrongly
ex.step(model, handle, micro)
torch.save({"grads": [p.grad for p in raw.parameters()], "micro": micro}, f"{sys.argv[1]}/rank{rank}.pt")
dist.barrier()
dist.destroy_process_group()
"""


FSDP_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
sys.path.insert(0, sys.argv[2])
import nanogpt_eslm as ex
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
raw = ex.GPT()
handle = ex.patch_model(raw, head=raw.lm_head, alpha=0.3)  # patched first, then sharded (FSDP2)
for block in raw.h:
    fully_shard(block)
fully_shard(raw)
data, g = ex.toy_tokens(512), torch.Generator().manual_seed(10 + rank)
micro = [ex.get_batch(data, 4, 32, g) for _ in range(2)]
if rank == 1:
    micro[0][1][:, 8:] = -100  # rank 1 keeps far fewer tokens: a per-rank mean would weight it wrongly
loss, _ = ex.step(raw, handle, micro)
grads = [p.grad.full_tensor() for p in raw.parameters()]  # each rank holds a shard: gather the whole gradient
torch.save({"grads": grads, "micro": micro, "loss": loss}, f"{sys.argv[1]}/rank{rank}.pt")
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_patch_model_under_fsdp2_gives_the_exact_kept_mean_and_its_gradient(tmp_path):
    """torchrun, two gloo ranks on CPU, FSDP2 ``fully_shard`` on each block and the root of a patched model: the
    selective loss summed over the ranks is the mean CE over the kept tokens of every micro-batch of both ranks,
    and the gathered gradient is its gradient, both by hand on one process (full logits)."""
    import torch

    from conftest import torchrun

    script = tmp_path / "fsdp.py"
    script.write_text(FSDP_SCRIPT)
    torchrun([str(script), str(tmp_path), str(EXAMPLES)])
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for a, b in zip(r0["grads"], r1["grads"]):
        assert torch.equal(a, b)
    ex = load("nanogpt_eslm")
    torch.manual_seed(0)
    want, loss = _hand_grads(ex, ex.GPT(), r0["micro"] + r1["micro"], 0.3, with_loss=True)
    assert r0["loss"] + r1["loss"] == pytest.approx(loss, rel=1e-5)
    for a, w in zip(r0["grads"], want):
        assert torch.allclose(a, w, atol=1e-6)


@pytest.mark.slow
def test_nanogpt_example_under_ddp_all_reduces_the_exact_kept_mean(tmp_path):
    """torchrun, two gloo ranks, DDP(model) with patch_model: both ranks end with the same gradient (DDP's
    all-reduce ran: the loss came out of DDP's own forward), and it is the gradient of the mean CE over the kept
    tokens of every micro-batch of both ranks, by hand."""
    import torch

    from conftest import torchrun

    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    torchrun([str(script), str(tmp_path), str(EXAMPLES)])
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for a, b in zip(r0["grads"], r1["grads"]):
        assert torch.equal(a, b)
    ex = load("nanogpt_eslm")
    torch.manual_seed(0)
    want = _hand_grads(ex, ex.GPT(), r0["micro"] + r1["micro"], 0.3)
    for a, w in zip(r0["grads"], want):
        assert torch.allclose(a, w, atol=1e-6)


def test_nanogpt_example_under_compile_fullgraph():
    """torch.compile(model, fullgraph=True) of the patched model traces the whole forward and loss (one graph,
    no eager fallback) and gives the eager step's gradient."""
    import torch

    ex = load("nanogpt_eslm")
    torch.manual_seed(0)
    model, g = ex.GPT(), torch.Generator().manual_seed(3)
    data = ex.toy_tokens(512)
    micro = [ex.get_batch(data, 4, 32, g) for _ in range(2)]
    handle = ex.patch_model(model, head=model.lm_head, alpha=0.3)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    ex.step(torch.compile(model, fullgraph=True, backend=backend), handle, micro)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ex.step(model, handle, micro)
    assert len(graphs) >= 1
    for a, w in zip(got, [p.grad for p in model.parameters()]):
        assert torch.allclose(a, w, atol=1e-6)


@pytest.mark.slow
def test_nanogpt_example_with_ada_under_compile_is_one_graph():
    """The example's --ada --compile path: patch_model with AdaAlpha (interval 1: alpha moves every step), the
    model compiled with aot_eager and fullgraph=True, 20 steps: one graph (the handle passes Ada's alpha as its
    0-dim tensor while compiling; the float made a recompile per value and ran eagerly from the 9th), and the
    compiled step's loss equals the eager one's."""
    import torch

    ex = load("nanogpt_eslm")
    torch.manual_seed(0)
    model, g = ex.GPT(), torch.Generator().manual_seed(3)
    data = ex.toy_tokens(512)
    ada = ex.AdaAlpha(alpha=0.3, interval=1, gamma=2.0, alpha_min=0.05, alpha_max=0.8)
    handle = ex.patch_model(model, head=model.lm_head, alpha=0.3, ada=ada)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    alphas = []
    for _ in range(20):
        micro = [ex.get_batch(data, 4, 32, g) for _ in range(2)]
        alphas.append(ada.alpha)
        got, _ = ex.step(compiled, handle, micro)
        model.zero_grad()
        if len(alphas) % 5 == 0:
            want, _ = ex.step(model, handle, micro)
            model.zero_grad()
            assert got == pytest.approx(want, rel=1e-5)
        ada.step()
    assert len(set(alphas)) >= 15
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_patch_model_refuses_what_it_cannot_capture():
    import torch

    from eslm.errors import ConfigError

    ex = load("nanogpt_eslm")
    model = ex.GPT()
    X, Y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    with pytest.raises(ConfigError, match="submodule"):
        ex.patch_model(model, head=torch.nn.Linear(32, 64))
    with pytest.raises(ConfigError, match=r"\(V, C\) weight"):
        ex.patch_model(model, head=model.ln_f)
    model.unused = torch.nn.Linear(32, 64)
    handle = ex.patch_model(model, head=model.unused)
    with pytest.raises(ConfigError, match="never called the head"):
        model(X, eslm_targets=Y)
    handle.remove()
    handle = ex.patch_model(model, head=model.lm_head)
    with pytest.raises(ConfigError, match="hidden states of shape"):
        model(X, eslm_targets=Y[:, :4])
    logits, _ = model(X)  # without eslm_targets: the model's own forward
    assert logits.shape == (2, 8, 64)
    handle.remove()
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__


def test_nanogpt_example_learns(capsys):
    losses = load("nanogpt_eslm").main(["--iters", "30", "--ada"])
    assert losses[-1] < losses[0] - 0.5
    assert "plain CE on a fresh batch" in capsys.readouterr().out
