"""The 124M GPU pilot's per-seed validation losses and paired differences, read from the logs of its study runs.

    python benchmarks/gpu_pilot_table.py benchmarks/results/pilot-124m-gpu-stdlib/seeds-*.log [--out FILE.md]

The pilot (configs/studies/pilots/pilot-124m-gpu-stdlib.yaml) ran seeds 1-2 as one study and seeds 3-5 as a
second study of the same settings, stopped by the GPU window's end during clm-s5; the second study's run
directories did not come back, its log did. Every evaluation line of the logs is read (``eval step N: val_loss
X``, under the run's ``run directory:`` line); a seed counts only when all three arms finished. Paired
differences by seed: mean, SD, Student-t 95% interval and two-sided p (exploratory: no Holm adjustment; the
study file's own report holds the pre-registered primary on its 2 seeds).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

from scipy import stats as st

ARMS = ("clm", "eslm-entropy", "random")
PAIRS = (("eslm-entropy", "random"), ("eslm-entropy", "clm"), ("random", "clm"))


def read_logs(paths: list[Path]) -> dict[str, dict[int, float]]:
    runs: dict[str, dict[int, float]] = {}
    cur = None
    for path in paths:
        for line in path.read_text().splitlines():
            m = re.match(r"run directory: \S+/(\S+)\s+\|", line)
            if m:
                cur = m.group(1)
                runs[cur] = {}
            m = re.match(r"eval step (\d+): val_loss ([\d.]+)", line)
            if m and cur:
                runs[cur][int(m.group(1))] = float(m.group(2))
            if line.startswith("done (") and cur:
                runs[cur][-1] = 1.0  # finished (not preempted)
            if line.startswith("done (preempted)") and cur:
                runs[cur].pop(-1, None)
    return runs


def paired(d: list[float]) -> str:
    """Mean, SD, Student-t 95% interval and two-sided p of paired differences (scipy's t distribution, as the
    report's)."""
    n, m = len(d), statistics.mean(d)
    sd = statistics.stdev(d)
    half = st.t.ppf(0.975, n - 1) * sd / n ** 0.5
    p = 2.0 * st.t.sf(abs(m) / (sd / n ** 0.5), n - 1)
    return f"{m:+.4f} | {sd:.4f} | [{m - half:+.4f}, {m + half:+.4f}] | {p:.3f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    runs = read_logs(a.logs)
    seeds = sorted({int(k.rsplit("-s", 1)[1]) for k in runs
                    if all(-1 in runs.get(f"{arm}-s{k.rsplit('-s', 1)[1]}", {}) for arm in ARMS)})
    final = {(arm, s): runs[f"{arm}-s{s}"][max(k for k in runs[f"{arm}-s{s}"] if k >= 0)] for arm in ARMS
             for s in seeds}
    at_clm_end = {(arm, s): runs[f"{arm}-s{s}"][max(runs[f"clm-s{s}"])] for arm in ARMS for s in seeds}
    lines = [f"# 124M GPU pilot: {len(seeds)} seeds ({', '.join(map(str, seeds))}), from the study logs", "",
             f"Command: `python benchmarks/gpu_pilot_table.py {' '.join(str(x) for x in a.logs)}`", "",
             "| seed | " + " | ".join(f"{arm} final" for arm in ARMS) + " | " +
             " | ".join(f"{arm} at CLM's last step" for arm in ARMS) + " |",
             "|---|" + "---|" * (2 * len(ARMS))]
    for s in seeds:
        lines.append(f"| {s} | " + " | ".join(f"{final[arm, s]:.4f}" for arm in ARMS) + " | " +
                     " | ".join(f"{at_clm_end[arm, s]:.4f}" for arm in ARMS) + " |")
    lines += ["", "Paired differences by seed (nats; exploratory, unadjusted):", "",
              "| difference | when | mean | SD | 95% interval | p |", "|---|---|---|---|---|---|"]
    for x, y in PAIRS:
        for when, table in (("final", final), ("CLM's last step (equal tokens)", at_clm_end)):
            lines.append(f"| {x} - {y} | {when} | " + paired([table[x, s] - table[y, s] for s in seeds]) + " |")
    text = "\n".join(lines) + "\n"
    if a.out:
        a.out.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
