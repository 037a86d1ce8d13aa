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
    ex.step(model, micro, alpha=0.3)
    got = [p.grad.clone() for p in model.parameters()]
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
        idx = torch.topk(s, n - math.floor(0.3 * n)).indices
        kept.append(F.cross_entropy(logits[idx], t[idx], reduction="none"))
    torch.cat(kept).mean().backward()
    for a, w in zip(got, [p.grad for p in model.parameters()]):
        assert torch.allclose(a, w, atol=1e-6)


def test_nanogpt_example_learns(capsys):
    losses = load("nanogpt_eslm").main(["--iters", "30", "--ada"])
    assert losses[-1] < losses[0] - 0.5
    assert "plain CE on a fresh batch" in capsys.readouterr().out
