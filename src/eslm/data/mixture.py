"""Domain mixtures: a validated weight per domain NAME (never per position: public SlimPajama code paths disagree
on the domains' order). Specs: "natural", "unif", "doremi" (the paper's table, renormalised), a mapping or
"a=0.5,b=0.5"; docs/data.md ("Mixtures") says what each is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from eslm.errors import ConfigError

# Table "Domain weights used for experiments on the SlimPajama-6B mixture" of the paper (DoReMi column).
DOREMI_SLIMPAJAMA = {
    "arxiv": 0.04235,
    "book": 0.08201,
    "cc": 0.381,
    "c4": 0.1141,
    "github": 0.0654,
    "stackexchange": 0.0847,
    "wikipedia": 0.2305,
}
PRESETS = ("natural", "unif", "doremi")
SUM_TOLERANCE = 1e-3


def resolve_weights(spec: str | Mapping[str, float], domains: list[str], *,
                    token_counts: Mapping[str, int] | None = None) -> dict[str, float]:
    """Weights for ``domains`` (a dict in ``domains`` order, values >= 0 summing to 1); ``token_counts``
    ({domain: train tokens}) is required by "natural"."""
    domains = list(domains)
    if not domains:
        raise ConfigError("expected at least one domain to weight; found none; fix: check the data directory")
    if isinstance(spec, str) and "=" in spec:
        spec = parse_weight_string(spec)
    if isinstance(spec, Mapping):
        return _custom(spec, domains)
    if spec == "unif":
        return {d: 1.0 / len(domains) for d in domains}
    if spec == "natural":
        return _natural(domains, token_counts)
    if spec == "doremi":
        return _doremi(domains)
    raise ConfigError(f"expected weights {list(PRESETS)} or a mapping {{domain: weight}}; found {spec!r}; "
                      "fix: use a preset name or give one weight per domain")


def parse_weight_string(text: str) -> dict[str, float]:
    """``"code=0.5, docs=0.5"`` -> ``{"code": 0.5, "docs": 0.5}`` (for command lines)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            out[name.strip()] = float(value if sep else "no number")
        except ValueError:
            raise ConfigError(f"expected NAME=NUMBER in weights; found {part!r}; fix: e.g. code=0.5,docs=0.5") from None
    return out


def _custom(spec: Mapping[str, float], domains: list[str]) -> dict[str, float]:
    unknown = [d for d in spec if d not in domains]
    if unknown:
        raise ConfigError(f"expected weights for domains among {domains}; found unknown {unknown}; "
                          "fix: use the data's domain names")
    bad = {d: w for d, w in spec.items()
           if isinstance(w, bool) or not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0)}
    if bad:
        raise ConfigError(f"expected finite weights >= 0; found {bad}; fix: use non-negative numbers")
    total = float(sum(spec.values()))
    if total <= 0:
        raise ConfigError(f"expected at least one positive weight; found all zero {dict(spec)}; "
                          "fix: give some domain a positive weight")
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise ConfigError(f"expected weights summing to 1 (within {SUM_TOLERANCE}); found sum {total:.6g} "
                          f"for {dict(spec)}; fix: make data.weights sum to 1")
    return {d: float(spec.get(d, 0.0)) / total for d in domains}


def _natural(domains: list[str], token_counts: Mapping[str, int] | None) -> dict[str, float]:
    if token_counts is None:
        raise ConfigError("expected token counts for weights 'natural'; found none; "
                          "fix: pass token_counts={domain: dataset.num_tokens('train', domain)}")
    missing = [d for d in domains if d not in token_counts]
    if missing:
        raise ConfigError(f"expected token counts for every domain; found none for {missing}; "
                          "fix: pass counts for all domains")
    total = sum(int(token_counts[d]) for d in domains)
    if total <= 0:
        raise ConfigError(f"expected some train tokens for weights 'natural'; found {dict(token_counts)}; "
                          "fix: prepare a non-empty corpus")
    return {d: int(token_counts[d]) / total for d in domains}


def _doremi(domains: list[str]) -> dict[str, float]:
    if set(domains) != set(DOREMI_SLIMPAJAMA):
        raise ConfigError(f"expected the SlimPajama domains {sorted(DOREMI_SLIMPAJAMA)} for weights 'doremi'; "
                          f"found {sorted(domains)}; fix: prepare slimpajama-6b, or use 'unif'/'natural'/a mapping")
    total = sum(DOREMI_SLIMPAJAMA.values())  # 1.00006: renormalised explicitly
    return {d: DOREMI_SLIMPAJAMA[d] / total for d in domains}
