"""``eslm study PRESET``: a grid of methods x seeds at an equal FLOPs budget, then the report.

A study file (configs/studies/NAME.yaml, or any path) holds: ``methods``, ``seeds``, ``config`` (a config delta
shared by every run), and ``budget`` — ``steps_of: METHOD`` sets the FLOPs budget to what that method's dense
training spends in ``config.train.max_steps`` steps, measured on ``counter`` (default flops_paper, the paper's
convention), and every run stops at that budget (so a method whose steps count fewer FLOPs runs more steps).
Runs are sequential and resumable: a finished run (it has result.json) is skipped, an interrupted one resumes.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from eslm.errors import ConfigError

# Study files live in the repository (configs/studies), not in the installed package. A name is looked up
# in the source tree this module was imported from (an editable install or a checkout on sys.path), then in
# ./configs/studies (a non-editable install run from the repository root).
STUDIES_DIR = Path(__file__).resolve().parents[2] / "configs" / "studies"


def study_dirs() -> list[Path]:
    """Where ``eslm study NAME`` looks for NAME.yaml, in order (duplicates removed)."""
    out: list[Path] = []
    for d in (STUDIES_DIR, Path.cwd() / "configs" / "studies"):
        if d.resolve() not in [o.resolve() for o in out]:
            out.append(d)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("preset", help="a study name in configs/studies (e.g. demo) or a path to a study YAML")
    p.add_argument("--out", default="runs/studies", help="parent directory of the study's run directories")
    p.add_argument("--seeds", type=int, nargs="*", help="override the study's seeds")
    p.add_argument("--dry-run", action="store_true", help="print the planned runs and exit")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="config overrides for every run")


def load_study(name: str) -> dict:
    import yaml

    path = Path(name)
    if not path.is_file():
        dirs = study_dirs()
        path = next((d / f"{name}.yaml" for d in dirs if (d / f"{name}.yaml").is_file()), path)
    if not path.is_file():
        known = sorted({p.stem for d in dirs for p in d.glob("*.yaml")})
        where = ", ".join(str(d) for d in dirs)
        if known:
            raise ConfigError(f"unknown study {name!r}; expected a study file or one of: {', '.join(known)}")
        raise ConfigError(f"expected the study {name!r} as a file or in configs/studies, found no study files "
                          f"(looked in: {where}); fix: run from the eslm repository root (the study files are "
                          "not part of an installed wheel), install it editable (pip install -e .), "
                          "or pass a path: eslm study path/to/study.yaml")
    study = yaml.safe_load(path.read_text()) or {}
    for key in ("methods", "seeds", "config"):
        if key not in study:
            raise ConfigError(f"study {str(path)!r} lacks the key {key!r}")
    study["name"] = path.stem
    return study


def _flatten(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _flatten(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={list(v) if isinstance(v, (list, tuple)) else v}")
    return out


def plan(study: dict, out: Path, seeds=None, overrides=()) -> list:
    """The resolved Config of every run of the study (validated up front, all problems at once)."""
    from eslm.config import build_config

    base = _flatten(study["config"]) + list(overrides)
    budget = study.get("budget") or {}
    configs = []
    for method in study["methods"]:
        for seed in seeds or study["seeds"]:
            over = base + [f"method.name={method}", f"run.seed={seed}", f"run.out_dir={out / study['name']}",
                           f"run.name={method}-s{seed}"]
            configs.append(build_config(overrides=over))
    if budget.get("steps_of"):
        configs = [_with_budget(c, budget) for c in configs]
    return configs


def _with_budget(cfg, budget: dict):
    """Equal FLOPs: max_flops = dense FLOPs of max_steps steps; max_steps raised so the budget binds."""
    from dataclasses import replace

    from eslm.flops import FlopsModel
    from eslm.model.gpt import preset

    vocab = cfg.model.vocab_size or (50304 if cfg.data.tokenizer == "gpt2" else 320)
    fm = FlopsModel.from_config(preset(cfg.model.preset, vocab_size=vocab), cfg.data.seq_len)
    t = cfg.train
    tokens_per_step = t.micro_batch_size_seqs * cfg.data.seq_len * t.grad_accum_steps
    if cfg.flops.count_per == "micro":
        tokens_per_step = t.micro_batch_size_seqs * cfg.data.seq_len
    flops = fm.train_per_token * tokens_per_step * t.max_steps
    counter = budget.get("counter", "flops_paper")
    # a selective step costs at least (1 + 2 * keep) / 3 of a dense one in the paper's convention
    max_steps = int(math.ceil(t.max_steps * 3.0 / (1.0 + 2.0 * 0.05))) + 1
    return replace(cfg, train=replace(t, max_flops=flops, max_steps=max_steps, lr_decay_steps=t.lr_decay_steps or t.max_steps),
                   flops=replace(cfg.flops, budget_counter=counter))


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from eslm.cli import main as cli_main
    from eslm.train.trainer import train

    study = load_study(args.preset)
    out = Path(args.out)
    configs = plan(study, out, args.seeds, args.overrides)
    print(f"study {study['name']}: {len(configs)} runs -> {out / study['name']}")
    for c in configs:
        print(f"  {c.run.name}: method={c.method.name} seed={c.run.seed} budget {c.train.max_flops:.3g} "
              f"{c.flops.budget_counter}")
    if args.dry_run:
        return 0
    t0 = time.perf_counter()
    run_dirs = []
    for c in configs:
        rd = Path(c.run.out_dir) / c.run.name
        run_dirs.append(rd)
        if (rd / "result.json").is_file():
            print(f"== {c.run.name}: finished earlier, skipped")
            continue
        resume = (rd / "metrics.jsonl").is_file()
        print(f"== {c.run.name}{' (resuming)' if resume else ''}")
        result = train(replace(c, run=replace(c.run, resume=resume)))
        if result.stopped_by == "preempted":  # SIGTERM: the run saved a checkpoint; stop here, no report
            print(f"study {study['name']}: stopped (SIGTERM) during {c.run.name}; run the same command again "
                  "to resume it and the remaining runs", file=sys.stderr)
            return 143
    report_dir = out / study["name"] / "report"
    code = cli_main(["report", *map(str, run_dirs), "--out", str(report_dir)])
    print(f"study {study['name']} done in {time.perf_counter() - t0:.0f}s; report: {report_dir / 'index.html'}")
    return code
