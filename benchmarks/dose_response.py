"""The dose-response read-out of a sweep study (``configs/studies/alpha-cpu.yaml``'s primary): the slope, against
the swept value, of the paired final-loss difference GROUP - OTHER.

For each seed that has both groups' runs finished at every value, the difference d(v) = loss(GROUP at v) -
loss(OTHER at v) of the final validation loss (each run's ``result.json``), and that seed's least-squares slope
of d against v; the study's slope is the mean of the per-seed slopes with its Student-t 95% interval and
two-sided p over seeds (the same as least squares over every value with a seed effect when every seed has every
value), and the smallest slope detectable at 80% power from their SD (``eslm.analysis.stats.mde``). Also the
mean difference at each value with its interval. The run directories are ``<group>-alpha<v>-s<seed>`` for the
sweep over ``method.alpha`` (the study's own names; ``--tag`` for another swept key).

    python benchmarks/dose_response.py runs/alpha-cpu --group eslm-entropy --other random --values 0.1 0.3 0.5
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eslm.analysis import stats as S  # noqa: E402


def _label(v: float) -> str:
    return f"{v:g}"


def finals(study: Path, group: str) -> dict[int, float]:
    """{seed: final validation loss} of the finished runs ``<group>-s<seed>`` of a study directory."""
    out = {}
    for d in sorted(study.glob(f"{group}-s*")):
        m = re.fullmatch(rf"{re.escape(group)}-s(\d+)", d.name)
        if m and (d / "result.json").is_file():
            value = json.loads((d / "result.json").read_text()).get("val_loss")
            if value is not None:
                out[int(m.group(1))] = float(value)
    return out


def slope(values: list[float], diffs: list[float]) -> float:
    """The least-squares slope of ``diffs`` against ``values``."""
    mv, md = sum(values) / len(values), sum(diffs) / len(diffs)
    sxx = sum((v - mv) ** 2 for v in values)
    return sum((v - mv) * (d - md) for v, d in zip(values, diffs)) / sxx


def dose_response(study: Path, group: str, other: str, values: list[float], tag: str = "alpha") -> dict:
    if len(values) < 2:
        raise ValueError(f"a slope needs at least 2 values, got {values}")
    per_value = {}
    for v in values:
        g, o = finals(study, f"{group}-{tag}{_label(v)}"), finals(study, f"{other}-{tag}{_label(v)}")
        per_value[v] = {s: g[s] - o[s] for s in g.keys() & o.keys()}
    seeds = sorted(set.intersection(*(set(d) for d in per_value.values())))
    slopes = {s: slope(values, [per_value[v][s] for v in values]) for s in seeds}
    ci = S.mean_ci(list(slopes.values()))
    p = S.p_value(ci) if ci["n"] >= 2 else None
    at = {_label(v): S.mean_ci([per_value[v][s] for s in seeds]) for v in values}
    return {"study": study.name, "group": group, "other": other, "tag": tag, "values": values, "seeds": seeds,
            "per_seed_slope": slopes, "slope": ci, "p": p,
            "mde": S.mde(ci["std"], ci["n"]) if ci["n"] >= 2 else None, "difference_at": at}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path, help="the study directory (eslm study ... --out DIR: DIR/<study>)")
    ap.add_argument("--group", default="eslm-entropy")
    ap.add_argument("--other", default="random")
    ap.add_argument("--values", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    ap.add_argument("--tag", default="alpha", help="the swept key's tag in the run names (<group>-<tag><v>-s<seed>)")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    if not args.study.is_dir():
        print(f"dose_response: error: expected a study directory, found no directory at {args.study}; fix: pass "
              "the directory eslm study wrote (its --out DIR followed by the study's name)", file=sys.stderr)
        return 2
    try:
        r = dose_response(args.study, args.group, args.other, args.values, args.tag)
    except ValueError as e:
        print(f"dose_response: error: {e}; fix: pass two or more --values", file=sys.stderr)
        return 2
    n, ci = len(r["seeds"]), r["slope"]
    if n < 2:
        print(f"dose_response: {args.study}: {n} seed(s) with every run finished at {args.values}: no interval")
        return 0
    print(f"{r['study']}: slope of {args.group} - {args.other} (final validation loss) against {args.tag}, "
          f"{n} seeds: {ci['mean']:+.4f} [{ci['lo']:+.4f}, {ci['hi']:+.4f}] nats per unit of {args.tag} "
          f"(p = {r['p']:.2g}); smallest slope detectable at 80% power: {r['mde']:.4f}")
    for v, c in r["difference_at"].items():
        print(f"  at {args.tag} {v}: {c['mean']:+.4f} [{c['lo']:+.4f}, {c['hi']:+.4f}] nats")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
