"""Domain weights: presets, custom mappings keyed by name, and one-line errors."""

import random

import pytest

from eslm.data.mixture import DOREMI_SLIMPAJAMA, resolve_weights
from eslm.errors import ConfigError

SP = ["arxiv", "book", "c4", "cc", "github", "stackexchange", "wikipedia"]
PAPER_DOREMI = {"arxiv": 0.04235, "book": 0.08201, "cc": 0.381, "c4": 0.1141, "github": 0.0654,
                "stackexchange": 0.0847, "wikipedia": 0.2305}


def test_doremi_matches_paper_by_name_whatever_the_order():
    assert DOREMI_SLIMPAJAMA == PAPER_DOREMI
    shuffled = SP[:]
    random.Random(0).shuffle(shuffled)
    for order in (SP, shuffled, list(reversed(SP))):
        w = resolve_weights("doremi", order)
        assert list(w) == order  # returned in the dataset's domain order...
        assert abs(sum(w.values()) - 1.0) < 1e-12
        for d in SP:  # ...but each value belongs to its NAME (c4 and cc never swapped)
            assert w[d] == pytest.approx(PAPER_DOREMI[d] / 1.00006, rel=1e-9)
    assert resolve_weights("doremi", SP)["cc"] > 3 * resolve_weights("doremi", SP)["c4"]


def test_unif_is_exactly_one_over_n_not_0_1428():
    w = resolve_weights("unif", SP)
    assert all(v == 1 / 7 for v in w.values()) and abs(sum(w.values()) - 1) < 1e-12
    assert abs(1 / 7 - 0.1428) < 1e-4  # the paper's rounded value, renormalised


def test_natural_is_proportional_to_tokens():
    w = resolve_weights("natural", ["a", "b"], token_counts={"a": 300, "b": 100})
    assert w == {"a": 0.75, "b": 0.25}
    with pytest.raises(ConfigError, match="token counts"):
        resolve_weights("natural", ["a", "b"])


def test_custom_mapping_and_string():
    assert resolve_weights({"a": 0.25, "b": 0.75}, ["a", "b", "c"]) == {"a": 0.25, "b": 0.75, "c": 0.0}
    assert resolve_weights("b=0.5, a=0.5", ["a", "b"]) == {"a": 0.5, "b": 0.5}


@pytest.mark.parametrize("spec,domains,match", [
    ({"a": 0.5, "z": 0.5}, ["a", "b"], r"unknown \['z'\]"),
    ({"a": -0.5, "b": 1.5}, ["a", "b"], ">= 0"),
    ({"a": 0.5, "b": 0.6}, ["a", "b"], "sum 1.1 .*sum to 1"),
    ({"a": 0.0, "b": 0.0}, ["a", "b"], "positive weight"),
    ("doremi", ["code", "docs", "reference"], "SlimPajama domains"),
    ("doremi", SP[:-1], "SlimPajama domains"),
    ("zipf", ["a"], "natural.*unif.*doremi"),
    ("a=half", ["a"], "NAME=NUMBER"),
])
def test_errors_are_one_line(spec, domains, match):
    with pytest.raises(ConfigError, match=match) as e:
        resolve_weights(spec, domains)
    assert "\n" not in str(e.value) and "fix:" in str(e.value)


def test_sum_within_tolerance_is_accepted_and_renormalised():
    w = resolve_weights({"a": 0.5004, "b": 0.5}, ["a", "b"])
    assert abs(sum(w.values()) - 1.0) < 1e-12

