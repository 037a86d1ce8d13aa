"""The statistics of today's report recomputed from an older report's summary.json, without its run directories.

An older ``eslm report`` summary.json keeps the per-seed values a comparison needs: the paired differences of
the final validation loss, and each group's per-seed to-target costs with its final counters. From them this
recomputes, with ``eslm.analysis.stats``: the minimum detectable effect of every comparison (80% power,
two-sided 5%), the to-target costs with seeds that never reached the target censored at their budget (the
run's final counter; recomputable where every seed of the group ends at the same value, as under a study's
FLOPs budget: paper-FLOPs, executed FLOPs and tokens, not time), and Holm's adjustment over every comparison
recomputed (the report had no primary comparison). What it cannot recompute is listed in the output: the
equal-token read-out and the differences over training need the evaluation curves, which summary.json does
not hold.

    python benchmarks/restat_summary.py docs/results/reproduce-cpu-summary.json --out docs/results/reproduce-cpu-restat
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eslm.analysis import stats as S  # noqa: E402
from eslm.analysis.report import verdicts as V  # noqa: E402

COSTS = {"flops_paper": ("final_flops_paper", "paper-FLOPs"), "flops_executed": ("final_flops_executed", "executed FLOPs"),
         "tokens": ("final_tokens_seen", "tokens"), "time_s": (None, "time")}
FINAL = "final validation loss"


def budgets(group: dict, final_key: str | None) -> dict | None:
    """{seed: the run's final counter} when every seed of the group ends at the same value, else None."""
    if final_key is None:
        return None
    a = group.get(final_key) or {}
    if a.get("count") != len(group["seeds"]) or a.get("min") != a.get("max"):
        return None
    return {str(s): a["min"] for s in group["seeds"]}


def restat(summary: dict) -> dict:
    groups = {g["label"]: g for g in summary["groups"]}
    rows, members = [], []
    for kind, comps in (("baseline", summary["comparisons"]), ("control", summary["controls"])):
        for c in comps:
            g, o = groups[c["group"]], groups[c["against"]]
            d = c["losses"][FINAL]["per_seed"]
            row = {"group": c["group"], "against": c["against"], "kind": kind,
                   "losses": {FINAL: S.paired(d, {s: 0.0 for s in d})}, "to_target": {}, "not_recomputed": []}
            for key, (final_key, _) in COSTS.items():
                x, y = g["to_target"][key]["per_seed"], o["to_target"][key]["per_seed"]
                bx, by = budgets(g, final_key), budgets(o, final_key)
                missing = any(v is None for v in x.values()) or any(v is None for v in y.values())
                if missing and (bx is None or by is None):
                    row["not_recomputed"].append(f"{key}: a seed never reached the target and the runs' final "
                                                 "values differ per seed (not in summary.json)")
                    continue
                row["to_target"][key] = S.paired_censored(x, y, bx or {}, by or {})
            members += [row["losses"][FINAL]] + list(row["to_target"].values())
            rows.append(row)
    family = S.holm_adjust(members)
    for row in rows:
        row["verdicts"] = [V.loss_verdict(row["losses"][FINAL], FINAL, row["against"])] + [
            V.cost_verdict(ci, COSTS[k][1], row["against"], row["group"]) for k, ci in row["to_target"].items()]
    return {"source_target_loss": summary["target_loss"], "holm_family": family, "comparisons": rows,
            "not_recomputable": ["the equal-token read-out (the loss at the baseline's last evaluation) and the "
                                 "paired differences over training: summary.json holds no evaluation curves",
                                 "time to target where a seed never reached it: the runs' CPU seconds differ per "
                                 "seed and only their mean, min and max are in summary.json"]}


def _cell(ci: dict | None, rel: bool) -> str:
    if ci is None or ci["n"] == 0:
        return "—"
    spec = "+.1%" if rel else "+.4f"
    mde = f"{ci['mde']:.1%}" if rel else f"{ci['mde']:.4f}"
    mark = {-1: " **↓**", 1: " **↑**", 0: ""}[S.significant(ci)]
    cens = f", {len(ci['censored_x']) + len(ci['censored_y'])} censored" if ci.get("bias") else ""
    return (f"{ci['mean']:{spec}} [{ci['lo']:{spec}}, {ci['hi']:{spec}}]{mark} (MDE {mde}, Holm p "
            f"{ci['p_adjusted']:.2g}{cens})")


def markdown(r: dict) -> str:
    head = ("| group | vs | Δ final loss | Δ paper-FLOPs to target | Δ executed FLOPs to target | Δ tokens to target |"
            "\n|---|---|---|---|---|---|")
    def cost(x, k):
        if any(n.startswith(k + ":") for n in x["not_recomputed"]):
            return "not recomputable (censored seeds, budgets differ per seed)"
        return _cell(x["to_target"].get(k), True)

    lines = [head] + [f"| {x['group']} | {x['against']} | {_cell(x['losses'][FINAL], False)} | "
                      + " | ".join(cost(x, k) for k in ("flops_paper", "flops_executed", "tokens")) + " |"
                      for x in r["comparisons"]]
    notes = [f"Recomputed from the per-seed values of summary.json (target loss {r['source_target_loss']:.4f}). "
             "Δ: mean paired difference [95% interval], relative for costs; MDE: the smallest true difference "
             "detectable with 80% power (two-sided paired t at 5%); Holm p: adjusted over the "
             f"{r['holm_family']} comparisons recomputed here; **↓**/**↑**: below / above zero after the "
             "adjustment; censored: seeds that never reached the target, counted at their budget.",
             "", "Not recomputable: " + "; ".join(r["not_recomputable"]) + "."]
    verdicts = [f"- **{x['group']}** vs {x['against']}: " + "; ".join(x["verdicts"]) for x in r["comparisons"]]
    return "\n".join(lines + [""] + notes + [""] + verdicts) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("summary", help="an eslm report summary.json")
    p.add_argument("--out", required=True, help="output prefix: writes OUT.json and OUT.md")
    a = p.parse_args(argv)
    try:
        summary = json.loads(Path(a.summary).read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"restat_summary: expected an eslm report summary.json at {a.summary}, could not read it ({e})",
              file=sys.stderr)
        return 2
    r = restat(summary)
    Path(a.out + ".json").write_text(json.dumps(r, indent=2))
    Path(a.out + ".md").write_text(markdown(r))
    print(f"wrote {a.out}.json and {a.out}.md ({len(r['comparisons'])} comparisons, Holm family {r['holm_family']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
