"""AdaAlpha, the public Ada-ESLM controller: the update rule by hand, a bit-identical resume, bad settings."""

import math
from types import SimpleNamespace

import pytest
import torch

from eslm.api import AdaAlpha
from eslm.errors import ConfigError


def _stats(cvar):
    return SimpleNamespace(cvar=torch.tensor(cvar))


def test_alpha_follows_the_rule_by_hand():
    ada = AdaAlpha(alpha=0.3, gamma=0.5, interval=2, alpha_min=0.05, alpha_max=0.8)
    cvars = [2.0, 4.0, 3.0, 3.0, 1.0, 1.0]  # two micro-batches per step, interval 2 steps
    alphas = []
    for step in range(3):
        for c in cvars[2 * step:2 * step + 2]:
            ada.observe(_stats(c))
        ada.step()
        alphas.append(ada.alpha)
    # interval 1 (steps 1-2): mean of 2, 4, 3, 3 = 3.0, the first measurement: no update
    assert alphas[:2] == [0.3, 0.3]
    ada.observe(_stats(1.0))
    ada.step()  # step 4 closes interval 2: mean of 1, 1, 1 = 1.0
    d = (1.0 - 3.0) / (3.0 + 1e-8)
    assert ada.alpha == pytest.approx(min(0.3 * math.exp(-0.5 * d), 0.8))
    assert ada.last_delta == pytest.approx(d)


def test_state_dict_resumes_bit_for_bit():
    def run(ada, cvars):
        out = []
        for c in cvars:
            ada.observe(_stats(c))
            ada.step()
            out.append(ada.alpha)
        return out

    g = torch.Generator().manual_seed(0)
    cvars = (torch.rand(40, generator=g) * 3 + 1).tolist()
    full = run(AdaAlpha(alpha=0.2, interval=3), cvars)
    first = AdaAlpha(alpha=0.2, interval=3)
    part = run(first, cvars[:17])
    second = AdaAlpha(alpha=0.5, interval=3)
    second.load_state_dict(first.state_dict())
    assert part + run(second, cvars[17:]) == full
    assert full[-1] != 0.2  # alpha did move


@pytest.mark.parametrize("kw,match", [(dict(alpha=1.0), "alpha"), (dict(interval=0), "interval"),
                                      (dict(gamma=-1.0), "gamma"), (dict(alpha=0.95), "alpha_max"),
                                      (dict(alpha_min=0.5, alpha_max=0.2), "alpha_min")])
def test_bad_settings_are_config_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        AdaAlpha(**kw)
