"""Benchmark: the paths torch offers this CPU for the LM head, against the default (fp32 matmuls through torch's
BLAS, one thread), on real training steps of CLM and ESLM-entropy (the loss-path benchmark's steps,
``harness.Bench``), interleaved in ONE process.

Paths: ``fp32`` (the default: one thread, torch's BLAS); ``fp32-2threads`` (two torch threads); ``bf16``
(bf16 autocast, as train.dtype=bf16 runs; only where the processor has bf16 instructions: lscpu's avx512_bf16 or
amx_bf16 flags); ``fp32-onednn-bf16`` (fp32 tensors, oneDNN's matmuls allowed to compute in bf16:
``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``; where torch has the switch). The last two change the
numbers a run computes (bf16 rounding), the first two do not.

The head routes are the fixed rule's (``eslm.ops.head_route``), the same on every path. Every round runs each (method, path) once, the starting point rotated round to round; a step is timed in
process CPU time (all threads; time the process waits while other work runs does not count) and in wall time.
The figure per path is the median over rounds of the ratio of its step to the same round's ``fp32`` step of the
same method (a slow spell of a loaded machine hits both), with the range over rounds.

    python benchmarks/head_paths.py --preset small --seq-len 128 --micro-batch 4 --steps 9

Results: benchmarks/results/head_paths-<preset>-T<seq>-B<mb>.{json,md} (or --name).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from harness import Bench, Variant, environment, write_results  # noqa: E402


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def paths(flags: set[str]) -> tuple[dict, list[str]]:
    """{path: (dtype, threads, oneDNN fp32 precision or None)} available here, and the paths skipped, with why."""
    out = {"fp32": ("fp32", 1, None), "fp32-2threads": ("fp32", 2, None)}
    skipped = []
    if flags & {"avx512_bf16", "amx_bf16"}:
        out["bf16"] = ("bf16", 1, None)
    else:
        skipped.append("bf16: the processor has no avx512_bf16 / amx_bf16 (bf16 would be emulated)")
    mm = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", None)
    if mm is not None and torch.backends.mkldnn.is_available():
        out["fp32-onednn-bf16"] = ("fp32", 1, "bf16")
    else:
        skipped.append("fp32-onednn-bf16: this torch has no torch.backends.mkldnn.matmul.fp32_precision")
    return out, skipped


@contextlib.contextmanager
def path_settings(threads: int, precision: str | None):
    before_threads = torch.get_num_threads()
    before_prec = torch.backends.mkldnn.matmul.fp32_precision if precision else None
    torch.set_num_threads(threads)
    if precision:
        torch.backends.mkldnn.matmul.fp32_precision = precision
    try:
        yield
    finally:
        torch.set_num_threads(before_threads)
        if precision:
            torch.backends.mkldnn.matmul.fp32_precision = before_prec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-step")
    p.add_argument("--alpha", type=float, default=0.5, help="ESLM-entropy's alpha")
    p.add_argument("--steps", type=int, default=9, help="timed rounds (each runs every method x path once)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--name", default="", help="results file name (default from the settings)")
    a = p.parse_args(argv)

    avail, skipped = paths(cpu_flags())
    benches = {d: Bench(preset=a.preset, seq_len=a.seq_len, micro_batch=a.micro_batch, dtype=d)
               for d in sorted({v[0] for v in avail.values()})}
    methods = {"clm": {"method.name": "clm"},
               f"eslm-entropy@{a.alpha}": {"method.name": "eslm-entropy", "method.alpha": a.alpha}}
    cells = [(m, pth) for m in methods for pth in avail]
    vs = {c: Variant(f"{c[0]}/{c[1]}", methods[c[0]]) for c in cells}
    cpu = {c: [] for c in cells}
    wall = {c: [] for c in cells}
    key = environment(next(iter(benches.values())))
    print(f"head-path benchmark: {a.preset}, {a.micro_batch}x{a.seq_len} tokens/step on {key['cpu']} "
          f"({key['cpu_id']}), paths {', '.join(avail)}; {len(cells)} cells x ({a.warmup} warm-up + {a.steps}) "
          f"rounds" + "".join(f"\n  skipped {s}" for s in skipped), flush=True)
    for r in range(a.warmup + a.steps):
        order = cells[r % len(cells):] + cells[:r % len(cells)]
        for c in order:
            dtype, threads, precision = avail[c[1]]
            with path_settings(threads, precision):
                t0, w0 = time.process_time(), time.perf_counter()
                benches[dtype].step(vs[c])
                dc, dw = time.process_time() - t0, time.perf_counter() - w0
            if r >= a.warmup:
                cpu[c].append(dc)
                wall[c].append(dw)
        if r >= a.warmup:
            print(f"  round {r - a.warmup + 1}/{a.steps}: " + "  ".join(
                f"{m}/{pth} {cpu[(m, pth)][-1]:.3f}s" for m, pth in cells), flush=True)

    rows = []
    for m, pth in cells:
        base = cpu[(m, "fp32")]
        ratios = [x / b for x, b in zip(cpu[(m, pth)], base)]
        wratios = [x / b for x, b in zip(wall[(m, pth)], wall[(m, "fp32")])]
        rows.append({"method": m, "path": pth, "cpu_s": statistics.median(cpu[(m, pth)]),
                     "wall_s": statistics.median(wall[(m, pth)]),
                     "cpu_vs_fp32": statistics.median(ratios), "cpu_vs_fp32_min": min(ratios),
                     "cpu_vs_fp32_max": max(ratios), "wall_vs_fp32": statistics.median(wratios)})
    load = list(os.getloadavg())
    name = a.name or f"head_paths-{a.preset}-T{a.seq_len}-B{a.micro_batch}"
    argv_s = " ".join(sys.argv[1:] if argv is None else argv)
    payload = {"command": f"python benchmarks/head_paths.py {argv_s}".strip(), "env": key, "skipped": skipped,
               "load_avg_at_end": load, "rounds": a.steps, "rows": rows,
               "cpu_s": {f"{m}/{pth}": cpu[(m, pth)] for m, pth in cells}}
    md = [f"# Head paths: {a.preset}, {a.micro_batch}x{a.seq_len} tokens per step", "",
          f"`{payload['command']}` on {key['cpu']} ({key['cpu_id']}; {key['blas']}; {key['cpu_capability']}), "
          f"torch {key['torch']}, {a.steps} interleaved rounds; load average at the end "
          f"{load[0]:.1f} (other work shared the machine: every figure is under that load). Step time in "
          "process CPU time (all threads); ratio = median over rounds of path / the same round's fp32 step.", ""]
    md += [f"Skipped: {s}" for s in skipped] + ([""] if skipped else [])
    md += ["| method | path | CPU s / step | wall s / step | CPU vs fp32 (median, range) | wall vs fp32 |",
           "|---|---|---|---|---|---|"]
    md += [f"| {r['method']} | {r['path']} | {r['cpu_s']:.3f} | {r['wall_s']:.3f} | {r['cpu_vs_fp32']:.3f} "
           f"({r['cpu_vs_fp32_min']:.3f}-{r['cpu_vs_fp32_max']:.3f}) | {r['wall_vs_fp32']:.3f} |" for r in rows]
    write_results(name, payload, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
