"""``eslm.selection.risk`` as the one selection rule: the micro-batch rule, the shared-threshold rule, the
device-side count of the drop-in API, and that no other module re-implements it."""

import ast
import math
from pathlib import Path

import pytest
import torch

from eslm.selection import risk

SRC = Path(__file__).resolve().parents[2] / "src" / "eslm"


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.29, 0.5, 0.9999])
def test_num_kept_tensor_matches_num_kept(alpha):
    for n in range(0, 301):
        assert int(risk.num_kept_tensor(torch.tensor(n), alpha)) == risk.num_kept(n, alpha), n


def test_select_top_k_and_shared_threshold():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(4, 25, generator=g)
    index, k = risk.select(s, 0.3)
    assert k == 100 - math.floor(0.3 * 100) == index.numel()
    assert set(index.tolist()) == set(torch.topk(s.reshape(-1), k).indices.tolist())
    thr = torch.tensor(0.5)
    index, k = risk.select(s, 0.3, thr)  # the threshold wins over alpha
    assert k == int((s >= 0.5).sum()) and bool((s.reshape(-1)[index] >= 0.5).all())
    assert risk.at_or_above(torch.tensor([1.0, 2.0, 2.0]), 2.0).tolist() == [False, True, True]


def test_select_valid_keeps_the_top_of_the_valid_tokens_only():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(50, generator=g)
    valid = torch.rand(50, generator=g) > 0.3
    index, keep, k, n_valid = risk.select_valid(s, valid, 0.25, 0.25)
    assert int(n_valid) == int(valid.sum()) and int(k) == risk.num_kept(int(valid.sum()), 0.25)
    kept = index[keep]
    assert bool(valid[kept].all()) and kept.numel() == int(k)
    assert set(kept.tolist()) == set(torch.topk(s.masked_fill(~valid, -1e9), int(k)).indices.tolist())
    none = risk.select_valid(s, torch.zeros(50, dtype=torch.bool), 0.25, 0.25)
    assert int(none[3]) == 0 and not bool(none[1].any())


def test_no_other_module_turns_scores_into_kept_tokens():
    """torch.topk / kthvalue / a FLOOR_EPS constant belong to risk.py (GREATS' row budget uses risk's FLOOR_EPS)."""
    offenders = []
    for path in SRC.rglob("*.py"):
        # the generation loop's top-k sampling of next tokens (logits; eval/generate.py, used by eslm sample and
        # lm-eval's generate_until) is sampling, not token selection
        if path.relative_to(SRC).as_posix() in ("selection/risk.py", "eval/generate.py"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("topk", "kthvalue"):
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno} {node.attr}")
            if isinstance(node, ast.Name) and node.id.endswith("FLOOR_EPS") and isinstance(node.ctx, ast.Store):
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno} {node.id}")
    assert offenders == []
