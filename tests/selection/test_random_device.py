"""The random control draws its permutation on the model's device (no CPU permutation copied to the GPU each step),
with the CPU stream it always had on the CPU, and refuses to continue a stream drawn on another device."""

import pytest
import torch

from eslm.config import build_config, method_context
from eslm.data.batch import Batch
from eslm.errors import CheckpointError
from eslm.methods import build_method
from eslm.selection import risk
from eslm.selection.selectors import RandomSelector


def _batch(B=4, T=16):
    x = torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(0))
    return Batch(x, x.roll(-1, 1), torch.tensor([0, 1, 0, 1]))


def test_on_the_cpu_the_stream_is_the_one_a_cpu_generator_gives():
    s, ref = RandomSelector(0.3, seed=5, n_domains=2), torch.Generator().manual_seed(5)
    k = risk.num_kept(64, 0.3)
    for _ in range(3):
        assert torch.equal(s.select(None, _batch()).index, torch.randperm(64, generator=ref)[:k])


def test_the_generator_and_the_permutation_are_on_the_methods_device(monkeypatch):
    """Built for a CUDA run, the control asks torch for a CUDA generator and draws with it on its device (recorded
    here on a CPU-only torch: the generator handed back is a CPU one)."""
    asked, drawn = [], []
    real_generator, real_randperm = torch.Generator, torch.randperm

    def generator(device="cpu"):
        asked.append(torch.device(device))
        return real_generator()

    def randperm(n, *, generator, device):
        drawn.append(device)
        return real_randperm(n, generator=generator, device=device)

    monkeypatch.setattr(torch, "Generator", generator)
    cfg = build_config(overrides=["method.name=random", "method.alpha=0.2"])
    method = build_method(method_context(cfg, device=torch.device("cuda"), n_domains=2))
    assert asked == [torch.device("cuda")]
    monkeypatch.setattr(torch, "randperm", randperm)
    method.tokens.select(None, _batch())
    assert drawn == [method.tokens.generator.device]


def test_a_stream_from_another_device_is_refused_in_one_line():
    s = RandomSelector(0.5, seed=3)
    state = {**s.state_dict(), "generator_device": "cuda"}
    with pytest.raises(CheckpointError, match="drawn on cuda; fix: resume on a cuda device"):
        s.load_state_dict(state)
