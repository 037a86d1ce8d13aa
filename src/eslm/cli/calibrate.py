"""``eslm calibrate``: measure the LM-head route chooser's coefficients here and cache them for this machine
(``eslm.ops.calibrate``)."""

from __future__ import annotations

import argparse

import torch

from eslm.ops import head_costs as hc
from eslm.ops.calibrate import calibrate, write
from eslm.ops.head_costs import ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu | cuda | cuda:N (default: cuda if available)")
    parser.add_argument("--dtype", default="both", choices=["fp32", "bf16", "both"], help="matmul dtype(s)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per coefficient (the fastest)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default); runs with this many threads use the result")
    parser.add_argument("--out", default="", help="also write (or update) this file; use it with ESLM_HEAD_COSTS=FILE")


def run(args: argparse.Namespace) -> int:

    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    entries = calibrate(args.device, dtypes, args.reps, threads=args.threads, cache=True)
    kind = torch.device(args.device).type
    key = hc.machine_key(kind, threads=args.threads or None)
    print(f"cached in {hc.cache_file(key)} for {hc.describe_key(key)}: selective runs here use it")
    for dtype, c in entries.items():
        print(f"{kind}/{dtype}: {1 / c.matmul_s_per_flop / 1e9:.1f} GFLOP/s head matmuls, "
              f"{1 / c.copy_s_per_byte / 1e9:.2f} GB/s row copies, {1 / c.softmax_s_per_elem / 1e9:.3f} G softmax "
              f"elements/s, {c.entropy_s_per_elem * 1e9:.3f} ns per entropy element")
        print(f'    ("{kind}", "{dtype}"): HeadCosts({c.matmul_s_per_flop:.4g}, {c.copy_s_per_byte:.4g}, '
              f'{c.softmax_s_per_elem:.4g}, {c.entropy_s_per_elem:.4g},\n        "{c.source}"),')
    if args.out:
        write(args.out, kind, entries)
        print(f"wrote {args.out}; the chooser uses it with {ENV}={args.out}")
    return 0
