"""``eslm study NAME|FILE [key=value ...]``: a grid of runs at equal FLOPs, then the report (docs/study.md)."""

from __future__ import annotations

import argparse

from eslm.study import run_study
from eslm.study.launch import LAUNCHERS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("preset", help="a study name in configs/studies (e.g. demo) or a path to a study YAML")
    p.add_argument("--out", default="runs/studies", help="parent directory of the study's run directories")
    p.add_argument("--seeds", type=int, nargs="*", help="override the study's seeds")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs trained at once, each in its own process (default: the study file's 'jobs', else 1: "
                        "one after the other, in this process)")
    p.add_argument("--dry-run", action="store_true", help="print the planned runs and exit")
    p.add_argument("--launcher", default=None, metavar="{" + ",".join(LAUNCHERS) + "}",
                   help="where the runs train (a launcher of eslm.study.launch.LAUNCHERS): local (this machine, the "
                        "default), slurm (one SLURM array job; needs the extra slurm), ... Default: the study file's "
                        "launcher.name, else local")
    p.add_argument("--detach", action="store_true",
                   help="slurm: return once the runs are submitted (the same command later waits and reports)")
    p.add_argument("--status", action="store_true",
                   help="print each run's state (its run directory; slurm: and the scheduler's) and train nothing")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="config overrides for every run")


def run(args: argparse.Namespace) -> int:
    return run_study(args.preset, args.out, seeds=args.seeds, jobs=args.jobs, dry_run=args.dry_run,
                     overrides=args.overrides, launcher=args.launcher, detach=args.detach, status=args.status)
