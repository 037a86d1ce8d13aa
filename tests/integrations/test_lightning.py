"""SelectiveLossMixin in a Lightning Trainer: with gradient accumulation over micro-batches of different
padding, the gradient the optimizer steps with equals that of the exact mean CE over the step's kept tokens."""

import math

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("pytorch_lightning")

from eslm.api import AdaAlpha  # noqa: E402
from eslm.integrations.lightning import SelectiveLossMixin  # noqa: E402

V, C = 23, 8


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix = torch.nn.Embedding(V, C), torch.nn.Linear(C, C)
        self.lm_head = torch.nn.Linear(C, V, bias=False)

    def hidden_states(self, x):
        return torch.tanh(self.mix(self.emb(x)))


class LitLM(SelectiveLossMixin, L.LightningModule):
    def __init__(self, ada=None):
        super().__init__()
        self.model = TinyLM()
        self.setup_eslm(alpha=0.3, score="entropy", ada=ada)

    def training_step(self, batch, batch_idx):
        return self.eslm_loss(batch["targets"], hidden=self.model.hidden_states(batch["x"]),
                              lm_weight=self.model.lm_head.weight)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def micro_batches():
    out = []
    for seed, pad in ((1, 0), (2, 9), (3, 4), (4, 11)):
        g = torch.Generator().manual_seed(seed)
        x, t = torch.randint(0, V, (2, 12), generator=g), torch.randint(0, V, (2, 12), generator=g)
        t[1, 12 - pad:] = -100
        out.append({"x": x, "targets": t})
    return out


def hand_grads(model, micro, alpha):
    kept_ce = []
    for b in micro:
        logits = (model.hidden_states(b["x"]) @ model.lm_head.weight.t()).reshape(-1, V)
        t = b["targets"].reshape(-1)
        valid = t != -100
        with torch.no_grad():
            logp = torch.log_softmax(logits, -1)
            s = (-(logp.exp() * logp).sum(-1)).masked_fill(~valid, float("-inf"))
        n = int(valid.sum())
        idx = torch.topk(s, n - math.floor(alpha * n)).indices
        kept_ce.append(F.cross_entropy(logits[idx], t[idx], reduction="none"))
    model.zero_grad()
    torch.cat(kept_ce).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def fit(module, steps, accumulate):
    trainer = L.Trainer(max_steps=steps, accumulate_grad_batches=accumulate, accelerator="cpu", devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(micro_batches(), batch_size=None))


def test_accumulated_gradient_is_the_exact_kept_mean():
    lit = LitLM()
    fit(lit, steps=1, accumulate=2)
    got = [p.grad.clone() for p in lit.model.parameters()]
    want = hand_grads(TinyLM(), micro_batches()[:2], 0.3)
    for a, w in zip(got, want):
        assert torch.allclose(a, w, atol=1e-6)


def test_ada_steps_once_per_optimizer_step():
    ada = AdaAlpha(alpha=0.3, interval=1, gamma=3.0)
    lit = LitLM(ada=ada)
    fit(lit, steps=2, accumulate=2)
    assert ada.steps == 2 and ada.alpha != 0.3


class WithExtraTerm(LitLM):
    """A regulariser added to the selective loss, as a z-loss or an MoE auxiliary loss would be."""

    def training_step(self, batch, batch_idx):
        h = self.model.hidden_states(batch["x"])
        return self.eslm_loss(batch["targets"], hidden=h, lm_weight=self.model.lm_head.weight) \
            + 0.5 * h.square().mean()


def test_an_added_term_keeps_its_scale_without_accumulation():
    """accumulate_grad_batches=1: the gradient is that of (exact kept mean + 0.5 x regulariser), by hand. It was
    rescaled with the selective term by world / K (off by 9.9% in the issue's case)."""
    lit = WithExtraTerm()
    fit(lit, steps=1, accumulate=1)
    got = [p.grad.clone() for p in lit.model.parameters()]
    model = TinyLM()
    b = micro_batches()[0]
    want_ce = hand_grads(model, [b], 0.3)
    model.zero_grad()
    (0.5 * model.hidden_states(b["x"]).square().mean()).backward()
    for a, c, r in zip(got, want_ce, [p.grad for p in model.parameters()]):
        assert torch.allclose(a, c + (r if r is not None else 0), atol=1e-6)


def test_an_added_term_under_accumulation_is_refused():
    from eslm.errors import ConfigError

    with pytest.raises(ConfigError, match="eslm_loss\\(...\\) alone"):
        fit(WithExtraTerm(), steps=1, accumulate=2)


def test_group_and_other_fixed_options_are_refused():
    from eslm.errors import ConfigError

    class Grouped(LitLM):
        def __init__(self):
            L.LightningModule.__init__(self)
            self.model = TinyLM()
            self.setup_eslm(alpha=0.3, group=object())

    with pytest.raises(ConfigError, match="group"):
        Grouped()


class Recording(LitLM):
    def __init__(self):
        super().__init__()
        self.returned = []

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.returned.append(float(out.detach()))
        return out


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_returned_loss_is_the_kept_mean(accumulate):
    """What Lightning shows as 'loss' is each micro-batch's mean CE over its kept tokens (it was their sum)."""
    lit = Recording()
    fit(lit, steps=1, accumulate=accumulate)
    model = TinyLM()
    for value, b in zip(lit.returned, micro_batches()):
        logits = (model.hidden_states(b["x"]) @ model.lm_head.weight.t()).reshape(-1, V)
        t = b["targets"].reshape(-1)
        valid = t != -100
        logp = torch.log_softmax(logits, -1)
        s = (-(logp.exp() * logp).sum(-1)).masked_fill(~valid, float("-inf"))
        n = int(valid.sum())
        idx = torch.topk(s, n - math.floor(0.3 * n)).indices
        assert value == pytest.approx(float(F.cross_entropy(logits[idx], t[idx])), rel=1e-5)
    assert len(lit.returned) == accumulate


DDP_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[2])
import test_lightning as T
lit = T.LitLM()
trainer = T.L.Trainer(max_steps=1, accumulate_grad_batches=2, accelerator="cpu", devices=2, strategy="ddp",
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
trainer.fit(lit, torch.utils.data.DataLoader(T.micro_batches(), batch_size=None))
torch.save([p.grad.clone() for p in lit.model.parameters()], f"{sys.argv[1]}/rank{trainer.global_rank}.pt")
"""


@pytest.mark.slow
def test_ddp_on_two_processes_gives_the_exact_kept_mean_of_both_ranks(tmp_path):
    """Lightning's strategy="ddp" with two CPU processes (torchrun, gloo), two micro-batches of different padding
    each: both ranks step with the gradient of the mean CE over the kept tokens of all four micro-batches."""
    from pathlib import Path

    from conftest import torchrun

    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    torchrun([str(script), str(tmp_path), str(Path(__file__).parent)])
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for a, b in zip(r0, r1):
        assert torch.equal(a, b)
    want = hand_grads(TinyLM(), micro_batches(), 0.3)  # the sampler deals micro-batches 0, 2 and 1, 3
    for a, w in zip(r0, want):
        assert torch.allclose(a, w, atol=1e-6)
