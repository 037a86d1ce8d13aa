"""A confirmatory study's sample size planned from a pilot: the paired standard deviation of a final-loss
difference, its interval, and the pairs needed for a target minimum detectable effect at the pilot's upper
confidence limit of that SD (not its point estimate: with 5 pairs the point estimate can be half the true SD).

Each argument is a study directory (``eslm study ... --out DIR``: its runs ``<group>-s<seed>/result.json``).
For each, the paired differences GROUP - OTHER of the final validation loss over the seeds both have: their
mean, SD with its chi-squared 95% interval and one-sided upper ``--confidence`` limit
(``eslm.analysis.stats.sd_ci``, ``sd_upper``), and the pairs a two-sided paired t test at 5% needs for an MDE of
``--mde`` at 80% power from the point estimate and from the upper limit (``pairs_for_mde``); with ``--margin``,
the pairs for 80% power of the TOST equivalence test within +-margin when the true difference is 0, at the
upper limit (``tost_pairs``: the usual t approximation); and each group's
between-seed SD.

    python benchmarks/plan_from_pilot.py runs/pilot/pilot-branch-b54 runs/pilot/pilot-branch-none \\
        --group eslm-loss --other random --mde 0.025
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from scipy import stats as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eslm.analysis import stats as S  # noqa: E402


def finals(study: Path, group: str) -> dict:
    """{seed: final validation loss} of the finished runs ``<group>-s<seed>`` of a study directory."""
    out = {}
    for d in sorted(study.glob(f"{group}-s*")):
        m = re.fullmatch(rf"{re.escape(group)}-s(\d+)", d.name)
        result = d / "result.json"
        if m and result.is_file():
            value = json.loads(result.read_text()).get("val_loss")
            if value is not None:
                out[m.group(1)] = float(value)
    return out


def tost_pairs(sd: float, margin: float, power: float = 0.8, most: int = 10000) -> int:
    """The fewest pairs whose TOST shows equivalence within +-``margin`` with probability ``power`` when the
    true mean difference is 0 and the paired SD is ``sd``: the usual approximation for that case,
    power = 2 P(T_{n-1} < margin / se - t_{0.95, n-1}) - 1, se = sd / sqrt(n)."""
    import math

    for n in range(3, most + 1):
        df = n - 1
        z = margin / (sd / math.sqrt(n)) - st.t.ppf(0.95, df)
        if 2.0 * st.t.cdf(z, df) - 1.0 >= power:
            return n
    return most


def plan(study: Path, group: str, other: str, mde: float, confidence: float, margin: float | None = None) -> dict:
    x, y = finals(study, group), finals(study, other)
    d = S.paired(x, y)
    row = {"study": study.name, "pairs": d["n"], "mean": d["mean"], "p": d["p"], "sd": d["std"]}
    if d["n"] >= 2:
        ci = S.sd_ci(list(d["per_seed"].values()))
        upper = S.sd_upper(d["std"], d["n"], confidence)
        row.update(sd_lo=ci["lo"], sd_hi=ci["hi"], sd_upper=upper, confidence=confidence,
                   pairs_at_sd=S.pairs_for_mde(d["std"], mde), pairs_at_upper=S.pairs_for_mde(upper, mde))
        if margin:
            row["tost_pairs_at_upper"] = tost_pairs(upper, margin)
        ys = list(x.values()), list(y.values())
        row["group_sd"] = {group: statistics.stdev(ys[0]) if len(ys[0]) > 1 else None,
                           other: statistics.stdev(ys[1]) if len(ys[1]) > 1 else None}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("studies", nargs="+", type=Path)
    ap.add_argument("--group", default="eslm-loss")
    ap.add_argument("--other", default="random")
    ap.add_argument("--mde", type=float, default=0.025, help="target minimum detectable effect (nats)")
    ap.add_argument("--confidence", type=float, default=0.8, help="one-sided upper confidence limit of the SD")
    ap.add_argument("--margin", type=float, help="equivalence margin (nats): pairs for 80%% TOST power at 0")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    rows = [plan(s, args.group, args.other, args.mde, args.confidence, args.margin) for s in args.studies]
    print(f"| study | pairs | mean {args.group} - {args.other} | p | paired SD [95%] | upper {args.confidence:.0%} "
          f"limit | pairs for MDE {args.mde} (at SD / at upper) | SD {args.group} / {args.other} |"
          + (f" pairs for TOST +-{args.margin} (80% power at 0, at upper) |" if args.margin else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|" if args.margin else ""))
    for r in rows:
        if r["pairs"] < 2:
            print(f"| {r['study']} | {r['pairs']} | — | — | — | — | — | — |" + (" — |" if args.margin else ""))
            continue
        g = r["group_sd"]
        print(f"| {r['study']} | {r['pairs']} | {r['mean']:+.4f} | {r['p']:.2g} | {r['sd']:.4f} "
              f"[{r['sd_lo']:.4f}, {r['sd_hi']:.4f}] | {r['sd_upper']:.4f} | {r['pairs_at_sd']} / "
              f"{r['pairs_at_upper']} | {g[args.group]:.4f} / {g[args.other]:.4f} |"
              + (f" {r['tost_pairs_at_upper']} |" if "tost_pairs_at_upper" in r else ""))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
