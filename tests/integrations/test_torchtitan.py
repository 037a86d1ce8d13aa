"""The torchtitan-style loss: a step of two micro-batches with different padding, divided by the step's kept
tokens (global_kept_tokens, counted before the micro-batch loop as torchtitan counts its valid tokens), has the
gradient of the exact mean CE over the step's kept tokens; with lm_head= the loss takes hidden states."""

import math

import pytest
import torch
import torch.nn.functional as F

from eslm.api import AdaAlpha
from eslm.integrations.torchtitan import SelectiveCrossEntropy, global_kept_tokens

V, C = 31, 8


def micro():
    out = []
    for seed, pad in ((1, 0), (2, 13)):
        g = torch.Generator().manual_seed(seed)
        h = torch.randn(2, 16, C, generator=g)
        t = torch.randint(0, V, (2, 16), generator=g)
        t[0, 16 - pad:] = -100
        out.append((h, t))
    return out


@pytest.mark.parametrize("route", ["logits", "hidden"])
def test_step_gradient_is_the_exact_kept_mean(route):
    torch.manual_seed(0)
    head = torch.nn.Linear(C, V, bias=False)
    loss_fn = SelectiveCrossEntropy(alpha=0.25, score="loss", lm_head=head if route == "hidden" else None)
    batches = micro()
    global_kept = global_kept_tokens([t for _, t in batches], alpha=0.25)
    metrics = []
    for h, t in batches:
        loss, m = loss_fn(h if route == "hidden" else head(h), t, global_kept)
        loss.backward()
        metrics.append(m)
    got = head.weight.grad.clone()
    head.weight.grad = None
    kept = []
    for h, t in batches:
        logits, tt = head(h).reshape(-1, V), t.reshape(-1)
        ce = F.cross_entropy(logits, tt.clamp(min=0), reduction="none")
        s = ce.detach().masked_fill(tt == -100, float("-inf"))
        n = int((tt != -100).sum())
        kept.append(ce[torch.topk(s, n - math.floor(0.25 * n)).indices])
    assert int(global_kept) == sum(len(k) for k in kept)
    torch.cat(kept).mean().backward()
    assert torch.allclose(got, head.weight.grad, atol=1e-6)
    assert set(metrics[0]) == {"eslm/kept_frac", "eslm/var", "eslm/cvar"}


def test_ada_reads_and_observes():
    ada = AdaAlpha(alpha=0.4, interval=1)
    loss_fn = SelectiveCrossEntropy(ada=ada)
    h, t = micro()[0]
    _, m = loss_fn(torch.nn.Linear(C, V)(h), t)
    assert float(m["eslm/kept_frac"]) == pytest.approx(1 - math.floor(0.4 * 32) / 32)
