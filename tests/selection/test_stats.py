"""selection/stats.py: one SelectionStats type, filled by one function, returned by every scoring selector and by
the drop-in selective_loss, read by attribute everywhere."""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eslm.api import selective_loss
from eslm.data.batch import Batch
from eslm.ops.token_stats import TokenStats
from eslm.selection.selectors import RandomSelector, VaRSelector
from eslm.selection.stats import SelectionStats, selection_stats

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "eslm"


def test_the_selectors_and_the_api_return_the_same_type_with_the_same_numbers():
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(4, 16, 30, generator=g), torch.randint(0, 30, (4, 16), generator=g)
    _, api = selective_loss(targets, logits=logits, score="loss", alpha=0.25)
    scores = F.cross_entropy(logits.reshape(-1, 30), targets.reshape(-1), reduction="none").view(4, 16)
    batch = Batch(targets, targets, torch.arange(4) % 2)
    flat = scores.reshape(-1)
    stats = TokenStats(loss=flat, entropy=None, lse=torch.zeros_like(flat))
    sel = VaRSelector("loss", 0.25, n_domains=2).select(stats, batch).stats
    rnd = RandomSelector(0.25, seed=1, n_domains=2).select(None, batch).stats
    assert type(api) is type(sel) is type(rnd) is SelectionStats
    per_domain = ("kept_per_domain", "tokens_per_domain")  # (D,) and only where the caller has domains
    for field in (f.name for f in dataclasses.fields(SelectionStats) if f.name not in per_domain):
        assert float(getattr(api, field)) == pytest.approx(float(getattr(sel, field)), rel=1e-6), field
    assert sel.tokens_per_domain.tolist() == [32.0, 32.0] and float(sel.kept_per_domain.sum()) == 48


def test_an_empty_selection_has_zero_statistics_not_nan():
    st = selection_stats(torch.tensor([1.0, 2.0, 3.0]), torch.zeros(3, dtype=torch.bool))
    assert int(st.num_kept) == 0 and int(st.num_tokens) == 3
    assert float(st.threshold) == 0.0 and float(st.cvar) == 0.0 and float(st.score_dropped_mean) == 2.0
    st = selection_stats(torch.tensor([1.0, 2.0]), torch.zeros(2, dtype=torch.bool), valid=torch.zeros(2, dtype=torch.bool))
    assert int(st.num_tokens) == 0 and float(st.kept_frac) == 0.0 and float(st.score_dropped_mean) == 0.0


def test_a_non_finite_score_outside_the_set_does_not_leak():
    scores = torch.tensor([float("nan"), 2.0, 4.0, float("inf")])
    st = selection_stats(scores, torch.tensor([False, True, True, False]), valid=torch.tensor([False, True, True, False]))
    assert float(st.cvar) == 3.0 and float(st.threshold) == 2.0 and float(st.score_dropped_mean) == 0.0


def _violations() -> list[str]:
    """SelectionStats built anywhere but selection_stats; selection statistics read by string key (in the package,
    the benchmarks and the examples)."""
    out = []
    paths = [*SRC.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]
    for path in sorted(paths):
        rel = path.relative_to(SRC).as_posix() if path.is_relative_to(SRC) else path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "SelectionStats" \
                    and rel != "selection/stats.py":
                out.append(f"{rel}:{node.lineno}: builds a SelectionStats (only selection_stats does)")
            stats_attr = lambda n: isinstance(n, ast.Attribute) and n.attr == "stats"  # noqa: E731
            if isinstance(node, ast.Subscript) and stats_attr(node.value) and isinstance(node.slice, ast.Constant):
                out.append(f"{rel}:{node.lineno}: reads .stats[{node.slice.value!r}] (read the attribute)")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and stats_attr(node.func.value):
                out.append(f"{rel}:{node.lineno}: reads .stats.get(...) (read the attribute)")
    return out


def test_one_function_fills_the_statistics_and_readers_use_attributes():
    assert _violations() == []
