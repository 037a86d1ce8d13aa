"""``eslm study NAME|FILE``: a grid of runs (methods x sweep axes x seeds) at an equal FLOPs budget, then the report.

A study file (configs/studies/NAME.yaml, or any path) holds:

* ``methods``: method names, or mappings ``{name: METHOD, label: TEXT, section.key: value, ...}`` for a
  variant of a method (e.g. ``{name: eslm-entropy, method.standardize: domain}``);
* ``seeds``: the seeds every grid point is run with;
* ``sweep`` (optional): axes ``section.key: [v1, v2, ...]`` expanded to the full grid; an axis that applies to
  some methods only is ``section.key: {values: [...], methods: [m1, m2]}`` (e.g. ``method.alpha`` means
  nothing to CLM, so CLM is not repeated for each alpha);
* ``config``: a config delta shared by every run;
* ``budget``: ``steps_of: METHOD`` sets the FLOPs budget to what that method's dense training spends in
  ``config.train.max_steps`` steps, measured on ``counter`` (default flops_paper, the paper's convention), and
  every run stops at that budget (so a method whose steps count fewer FLOPs runs more steps);
* ``report`` (optional): ``{baseline: clm, target: 4.3}`` passed to ``eslm report``;
* ``jobs`` (optional): how many runs train at once (``--jobs`` overrides it).

Run names are readable: ``<method or label>[-<key><value> ...]-s<seed>``, e.g. ``eslm-loss-alpha0.3-s2``.

Pairing: for one seed, every run sees the same data order and the same initial weights (the model is
initialised from ``run.seed`` before any method component exists, and the training stream is seeded by
``run.seed`` alone), so differences between methods can be paired per seed; tests/test_study.py checks it.

Runs are resumable: a finished run (it has result.json) is skipped, an interrupted one resumes. Runs go
seed by seed, so a study stopped half-way holds complete paired comparisons for its first seeds. With
``--jobs N`` N runs train at once in child processes (each with cpu_count // N threads unless
train.num_threads is set), their output in ``<study>/logs/<run>.log``.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from eslm.errors import ConfigError

# Study files ship inside the package: src/eslm/configs is a link to the repository's configs/, so a
# checkout, an editable install and a wheel all find them next to this module (the wheel holds a copy).
# ./configs/studies is searched next, for a user's own studies kept in the working directory.
STUDIES_DIR = Path(__file__).resolve().parent / "configs" / "studies"

_ENTRY_KEYS = ("name", "label")


def study_dirs() -> list[Path]:
    """Where ``eslm study NAME`` looks for NAME.yaml, in order (duplicates removed)."""
    out: list[Path] = []
    for d in (STUDIES_DIR, Path.cwd() / "configs" / "studies"):
        if d.resolve() not in [o.resolve() for o in out]:
            out.append(d)
    return out


def _read_study_yaml(path: Path) -> dict:
    import yaml

    try:
        study = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"study {str(path)!r} is not valid YAML ({str(e).splitlines()[0]}); fix the file") from None
    except OSError as e:
        raise ConfigError(f"study {str(path)!r} could not be read ({e.strerror}); check the path") from None
    if not isinstance(study, dict):
        raise ConfigError(f"study {str(path)!r} must be a mapping with methods, seeds and config; "
                          f"found {type(study).__name__}")
    return study


def load_study(name: str) -> dict:
    path = Path(name)
    dirs = study_dirs()
    if not path.is_file():
        path = next((d / f"{name}.yaml" for d in dirs if (d / f"{name}.yaml").is_file()), path)
    if not path.is_file():
        known = sorted({p.stem for d in dirs for p in d.glob("*.yaml")})
        where = ", ".join(str(d) for d in dirs)
        if known:
            raise ConfigError(f"unknown study {name!r}; expected a study file or one of: {', '.join(known)}")
        raise ConfigError(f"expected the study {name!r} as a file or in configs/studies, found no study files "
                          f"(looked in: {where}); fix: pass a path (eslm study path/to/study.yaml), put "
                          f"{name}.yaml in ./configs/studies, or reinstall eslm (its wheel ships the studies in "
                          "eslm/configs/studies)")
    study = _read_study_yaml(path)
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


def _entry(item) -> tuple[str, str, list[str]]:
    """A ``methods`` entry -> (method name, label, overrides)."""
    if isinstance(item, str):
        return item, item, []
    if not isinstance(item, dict) or "name" not in item:
        raise ConfigError(f"study methods: expected a method name or a mapping with 'name', got {item!r}")
    over = _flatten({k: v for k, v in item.items() if k not in _ENTRY_KEYS})
    label = item.get("label") or "-".join([item["name"]] + [_slug(o) for o in over])
    return str(item["name"]), str(label), over


def _axes(study: dict) -> list[tuple[str, list, set | None]]:
    """``sweep`` -> [(dotted key, values, methods it applies to or None for all)]."""
    out = []
    for key, spec in (study.get("sweep") or {}).items():
        methods = None
        if isinstance(spec, dict):
            methods = set(spec.get("methods") or []) or None
            spec = spec.get("values")
        if not isinstance(spec, list) or not spec:
            raise ConfigError(f"study sweep {key!r}: expected a non-empty list of values "
                              f"(or {{values: [...], methods: [...]}}), got {spec!r}")
        out.append((str(key), spec, methods))
    return out


def _slug(override: str) -> str:
    """'method.alpha=0.3' -> 'alpha0.3' (readable, path-safe)."""
    key, _, value = override.partition("=")
    text = key.rsplit(".", 1)[-1] + value
    return "".join(c if c.isalnum() or c in "._" else "_" for c in text)


def grid(study: dict, seeds=None) -> list[tuple[str, str, list[str], int]]:
    """Every run of the study as (method, run name, overrides, seed): seeds outermost, then methods in file
    order, then the sweep axes' product. Identical grid points (same overrides) are planned once."""
    points: list[tuple[str, str, list[str]]] = []
    axes = _axes(study)
    for item in study["methods"]:
        method, label, over = _entry(item)
        # a restricted axis names methods by label: a labelled variant is its own entry, not its method's
        applicable = [(k, vals) for k, vals, ms in axes if ms is None or label in ms]
        for combo in itertools.product(*[vals for _, vals in applicable]):
            sweep = [f"{k}={v}" for (k, _), v in zip(applicable, combo)]
            name = "-".join([label] + [_slug(o) for o in sweep])
            points.append((method, name, over + sweep))
    names = [p[1] for p in points]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"study: the grid names {dup[0]!r} twice; give one of the method entries a 'label'")
    return [(m, f"{name}-s{seed}", over, seed) for seed in (seeds or study["seeds"]) for m, name, over in points]


def plan(study: dict, out: Path, seeds=None, overrides=()) -> list:
    """The resolved Config of every run of the study (validated up front, all problems at once)."""
    from eslm.config import build_config

    base = _flatten(study["config"])
    budget = study.get("budget") or {}
    configs, problems = [], []
    for method, name, over, seed in grid(study, seeds):
        items = base + over + list(overrides) + [f"method.name={method}", f"run.seed={seed}",
                                                 f"run.out_dir={out / study['name']}", f"run.name={name}"]
        try:
            configs.append(build_config(overrides=items))
        except ConfigError as e:
            problems.append(f"{name}: {e}")
    if problems:
        raise ConfigError(f"study {study['name']}: " + " | ".join(problems))
    if budget.get("steps_of"):
        configs = [_with_budget(c, budget) for c in configs]
    return configs


def _with_budget(cfg, budget: dict):
    """Equal FLOPs: max_flops = dense FLOPs of max_steps steps; max_steps raised so the budget binds
    (``eslm.flops.equal_flops_budget``); the learning-rate schedule keeps the original length."""
    from dataclasses import replace

    from eslm.flops import equal_flops_budget

    t = cfg.train
    flops, max_steps = equal_flops_budget(cfg)
    counter = budget.get("counter", "flops_paper")
    return replace(cfg, train=replace(t, max_flops=flops, max_steps=max_steps, lr_decay_steps=t.lr_decay_steps or t.max_steps),
                   flops=replace(cfg.flops, budget_counter=counter))


def run_study(preset: str, out: str | Path = "runs/studies", *, seeds: list[int] | None = None,
              jobs: int | None = None, dry_run: bool = False, overrides: list[str] | tuple = ()) -> int:
    """``eslm study``: plan the study ``preset`` (a name in configs/studies or a path) under ``out``/NAME, print
    the plan, train the unfinished runs (``jobs`` at once; default: the study file's, else 1), then the
    report. Returns the exit code: 0, 143 when stopped by SIGTERM, else that of the failed run."""
    study = load_study(preset)
    out = Path(out)
    configs = plan(study, out, seeds, overrides)
    jobs = jobs or study.get("jobs") or 1
    if not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"study {study['name']}: expected jobs >= 1, got {jobs!r}")
    print(f"study {study['name']}: {len(configs)} runs -> {out / study['name']}"
          + (f" ({jobs} at a time)" if jobs > 1 else ""))
    for c in configs:
        print(f"  {c.run.name}: method={c.method.name} seed={c.run.seed} budget {c.train.max_flops:.3g} "
              f"{c.flops.budget_counter}")
    if dry_run:
        return 0
    t0 = time.perf_counter()
    run_dirs = [Path(c.run.out_dir) / c.run.name for c in configs]
    pending = [c for c in configs if not (Path(c.run.out_dir) / c.run.name / "result.json").is_file()]
    for c in configs:
        if c not in pending:
            print(f"== {c.run.name}: finished earlier, skipped")
    code = _run_serial(pending) if jobs == 1 else _run_parallel(pending, jobs, out / study["name"])
    if code:
        print(f"study {study['name']}: stopped; run the same command again to resume the unfinished runs",
              file=sys.stderr)
        return code
    return _report(study, run_dirs, out / study["name"] / "report", t0)


def _resume_flag(c):
    from dataclasses import replace

    resume = (Path(c.run.out_dir) / c.run.name / "metrics.jsonl").is_file()
    return replace(c, run=replace(c.run, resume=resume)), resume


def _run_serial(configs: list) -> int:
    from eslm.train.trainer import train

    for c in configs:
        c, resume = _resume_flag(c)
        print(f"== {c.run.name}{' (resuming)' if resume else ''}", flush=True)
        if train(c).stopped_by == "preempted":  # SIGTERM: the run saved a checkpoint; stop here, no report
            return 143
    return 0


def _run_parallel(configs: list, jobs: int, study_dir: Path) -> int:
    """Train up to ``jobs`` runs at once, each as ``python -m eslm.cli train PLAN.yaml`` with its resolved
    config; SIGTERM is passed on to the children (each saves a checkpoint and exits), then the study stops."""
    from dataclasses import replace

    from eslm.config import to_yaml

    threads = max(1, (os.cpu_count() or 1) // jobs)
    (study_dir / "plan").mkdir(parents=True, exist_ok=True)
    (study_dir / "logs").mkdir(parents=True, exist_ok=True)
    queue, running, failed, stop = list(configs), {}, [], []
    old = signal.signal(signal.SIGTERM, lambda *_: stop.append(True)) if _main_thread() else None
    try:
        while queue or running:
            while queue and len(running) < jobs and not stop:
                c, resume = _resume_flag(queue.pop(0))
                if c.train.num_threads == 0:
                    c = replace(c, train=replace(c.train, num_threads=threads))
                plan_file = study_dir / "plan" / f"{c.run.name}.yaml"
                plan_file.write_text(to_yaml(c))
                log = open(study_dir / "logs" / f"{c.run.name}.log", "a")
                cmd = [sys.executable, "-m", "eslm.cli", "train", str(plan_file)]
                running[c.run.name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log)
                print(f"== {c.run.name}{' (resuming)' if resume else ''} started", flush=True)
            if stop:
                for proc, _ in running.values():
                    proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            for name, (proc, log) in list(running.items()):
                if proc.poll() is not None:
                    log.close()
                    del running[name]
                    ok = proc.returncode == 0 and (study_dir / name / "result.json").is_file()
                    print(f"== {name} {'finished' if ok else f'stopped (exit {proc.returncode})'}", flush=True)
                    if not ok:
                        failed.append(name)
            if stop and not running:
                return 143
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    if failed:
        print(f"study: {len(failed)} run(s) did not finish: {', '.join(failed)}; see {study_dir / 'logs'}",
              file=sys.stderr)
        return 1
    return 0


def _report(study: dict, run_dirs: list[Path], report_dir: Path, t0: float) -> int:
    from eslm.analysis.report import build_report, print_summary

    opts = study.get("report") or {}
    summary = build_report([str(p) for p in run_dirs], str(report_dir), target_loss=opts.get("target"),
                           baseline=opts.get("baseline"))
    print_summary(summary, report_dir)
    print(f"study {study['name']} done in {time.perf_counter() - t0:.0f}s; report: {report_dir / 'index.html'}")
    return 0


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
