"""random-domain, the domain-matched random control: ESLM-entropy's kept count per domain, drawn uniformly at
random within each domain (eslm.selection.domain_random)."""

import math

import pytest
import torch

from eslm.config import build_config, method_context
from eslm.data.batch import Batch
from eslm.methods import METHODS, build_method
from eslm.ops.token_stats import TokenStats

B, T, D = 6, 32, 3


def _method(name, alpha, seed=1, extra=()):
    cfg = build_config(overrides=[f"method.name={name}", f"method.alpha={alpha}", f"run.seed={seed}", *extra])
    return build_method(method_context(cfg, device=torch.device("cpu"), n_domains=D))


def _batch_and_stats(seed, skew=True):
    """Rows of domains 0, 1, 2, 0, 1, 2; domain 2's tokens score far higher than the others' when ``skew`` (so
    ESLM keeps it almost whole), and within every row the score rises with the position."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50, (B, T), generator=g)
    domain = torch.arange(B) % D
    scores = torch.rand(B, T, generator=g) + torch.linspace(0, 3, T)
    if skew:
        scores = scores + 5.0 * (domain == 2).float()[:, None]
    flat = scores.reshape(-1)
    return Batch(x, x.roll(-1, 1), domain), TokenStats(loss=-flat, entropy=flat, lse=torch.zeros_like(flat))


def _per_domain(index, batch):
    return torch.bincount(batch.domain.repeat_interleave(T)[index], minlength=D)


def test_registered_as_a_control_that_scores_like_eslm_entropy():
    spec = METHODS["random-domain"]
    assert spec.role == "control" and not spec.needs
    m = _method("random-domain", 0.2)
    assert m.name == "random-domain" and m.tokens.score == "entropy"  # the step runs ESLM-entropy's scoring pass


@pytest.mark.parametrize("alpha", [0.1, 0.2, 0.5])
@pytest.mark.parametrize("extra", [(), ("method.standardize=domain",)])
def test_keeps_eslm_entropys_count_per_domain(alpha, extra):
    ctrl, eslm = _method("random-domain", alpha, extra=extra), _method("eslm-entropy", alpha, extra=extra)
    for i in range(20):
        batch, stats = _batch_and_stats(i, skew=i % 2 == 0)
        mine, theirs = ctrl.tokens.select(stats, batch), eslm.tokens.select(stats, batch)
        assert mine.num_kept == theirs.num_kept == B * T - math.floor(alpha * B * T)
        assert mine.index.numel() == mine.index.unique().numel() == mine.num_kept  # a subset, no repeats
        assert _per_domain(mine.index, batch).tolist() == _per_domain(theirs.index, batch).tolist()
        assert mine.stats.kept_per_domain.tolist() == theirs.stats.kept_per_domain.tolist()


def test_within_a_domain_the_kept_set_is_uniform_not_the_top_scores():
    """Every token of a domain is kept with probability (ESLM's count)/(domain's tokens): a binomial count over
    many draws, within 5 SD for every position, while ESLM keeps the top scores (the row's last positions)."""
    alpha, draws = 0.5, 1500
    ctrl, eslm = _method("random-domain", alpha), _method("eslm-entropy", alpha)
    batch, stats = _batch_and_stats(0, skew=True)
    want = _per_domain(eslm.tokens.select(stats, batch).index, batch).float()
    per_dom_tokens = torch.bincount(batch.domain, minlength=D).float() * T
    p = (want / per_dom_tokens)[batch.domain.repeat_interleave(T)]  # each token's keep probability
    assert 0.0 < float(p.min()) < 0.5 < float(p.max())  # domain 2 nearly whole, the others below half
    counts = torch.zeros(B * T)
    for _ in range(draws):
        counts[ctrl.tokens.select(stats, batch).index] += 1
    sd = (draws * p * (1 - p)).sqrt().clamp(min=1.0)
    assert ((counts - draws * p).abs() / sd).max() < 5
    # ESLM would have kept the rows' top-scoring (last) positions; the control keeps first and last halves alike
    first, last = counts.view(B, T)[:, : T // 2].sum(), counts.view(B, T)[:, T // 2:].sum()
    assert abs(float(first - last)) < 5 * math.sqrt(float((draws * p * (1 - p)).sum()))


def test_seeded_and_its_stream_survives_a_checkpoint():
    batch, stats = _batch_and_stats(3)
    a, b = _method("random-domain", 0.3, seed=4), _method("random-domain", 0.3, seed=4)
    assert torch.equal(a.tokens.select(stats, batch).index, b.tokens.select(stats, batch).index)
    state = a.state_dict()
    nxt = a.tokens.select(stats, batch).index
    c = _method("random-domain", 0.3, seed=9)
    assert not torch.equal(c.tokens.select(stats, batch).index, nxt)
    c.load_state_dict(state)
    assert torch.equal(c.tokens.select(stats, batch).index, nxt)
