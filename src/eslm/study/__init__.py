"""``eslm study NAME|FILE``: a grid of runs (methods x sweep axes x seeds) at an equal FLOPs budget, then the report
(docs/study.md). ``run_study`` ties the modules together: ``schema`` (the study file), ``grid`` (the runs' Configs
and stages), ``shared`` (shared models), ``launch`` and ``slurm`` (launchers), ``estimate`` (the time it takes)."""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

from eslm.analysis import report as analysis_report
from eslm.analysis.report.output import check_report_dir
from eslm.errors import ConfigError, ESLMError
from eslm.files import (
    atomic_write,
    check_output_dir,
    ensure_dir,
    foreign_entries,
    link_refused,
    new_marker,
    read_marker,
)
from eslm.lock import DirLock
from eslm.study import shared
from eslm.study.estimate import describe, describe_steps, estimate, steps_by_run
from eslm.study.grid import Stage, check_branch_record, missing_controls, plan, stages
from eslm.study.launch import LAUNCHERS, QUEUED, Launcher, launcher_class, launcher_problems, watch_parent
from eslm.study.schema import is_int, load_study

__all__ = ["load_study", "make_launcher", "plan", "run_study", "stages", "watch_parent"]


def run_study(preset: str, out: str | Path = "runs/studies", *, seeds: list[int] | None = None,
              jobs: int | None = None, dry_run: bool = False, overrides: list[str] | tuple = (),
              launcher: Launcher | str | None = None, detach: bool = False, status: bool = False) -> int:
    """``eslm study``: plan the study ``preset`` (a name in configs/studies or a path) under ``out``/NAME, print
    the plan, train the unfinished runs with ``launcher`` (a Launcher or a name, ``make_launcher``), then the
    report; ``status`` prints each run's state and trains nothing. Returns the exit code: 0 (also for a detached
    study), 143 when stopped by SIGTERM, else that of the failed run."""
    if jobs is not None and not (is_int(jobs) and jobs >= 1):
        raise ConfigError(f"--jobs: expected an integer >= 1, found {jobs!r}")
    study = load_study(preset)
    study_dir = Path(out) / study["name"]
    configs = plan(study, Path(out), seeds, overrides)
    # before the dry run returns: it knows these too
    if problems := shared.changed_run_problems(configs) + shared.unknown_model_problems(configs, study, study_dir):
        raise ConfigError(f"study {study['name']}: " + (problems[0] if len(problems) == 1 else
                          f"{len(problems)} problem(s), nothing was run:" + "".join(f"\n  - {p}" for p in problems)))
    if missing := missing_controls(study.get("report") or {}, configs):  # a warning: the report goes without
        warnings.warn(missing, stacklevel=1)
    launcher = make_launcher(study, launcher, jobs, detach=detach)
    jobs = jobs or study.get("jobs") or 1
    planned = stages(study, configs)
    if status:
        print(f"study {study['name']}: {len(configs)} runs in {study_dir}")
        return launcher.status([c for s in planned for c in s.runs], study_dir)
    how = getattr(launcher, "describe", None)
    print(f"study {study['name']}: {len(configs)} runs -> {study_dir}"
          + (f" ({how()})" if how else f" ({jobs} at a time)" if jobs > 1 else ""))
    steps = steps_by_run(planned)
    for stage in planned[:-1]:
        for c in stage.runs:
            print(f"  {Path(c.run.out_dir).name}/{c.run.name}: method={c.method.name} seed={c.run.seed} "
                  f"{describe_steps(steps[c])} ({stage.name}: trained once, before the runs)")
    for c in configs:
        budget = f", budget {c.train.max_flops:.3g} {c.flops.budget_counter}" if c.train.max_flops > 0 else ""
        print(f"  {c.run.name}: method={c.method.name} seed={c.run.seed}, {describe_steps(steps[c])}{budget}"
              + (" (from its trunk's checkpoint)" if c.train.branch_from else ""))

    if line := describe(estimate(configs, jobs)):
        print(line)
    if dry_run:
        return 0

    run_dirs = [Path(c.run.out_dir) / c.run.name for s in planned for c in s.runs]
    check_study_dir(study_dir, run_dirs)  # before anything is written: another program's directory is refused
    check_report_dir(study_dir / "report")  # refused now, not after all the training
    ensure_dir(study_dir)
    with DirLock(study_dir, what="study directory"):  # a second eslm study on this directory is refused
        check_study_dir(study_dir, run_dirs)
        shared.check_record_owner(study_dir)  # before any training: models.json is written after the models
        if read_marker(study_dir / STUDY_MARKER, STUDY_FORMAT) is None:
            atomic_write(study_dir / STUDY_MARKER, (json.dumps(new_marker(STUDY_FORMAT)) + "\n").encode())
        check_branch_record(study, study_dir, configs)
        return _train_and_report(study, configs, planned, launcher, study_dir)


def make_launcher(study: dict, launcher: Launcher | str | None = None, jobs: int | None = None, *,
                  detach: bool = False) -> Launcher:
    """The launcher named ``launcher`` (None: the study file's ``launcher.name``, else ``local``), from the study
    file's ``launcher`` section when that section is its own; ``launcher`` itself when it is a Launcher."""
    if launcher is not None and not isinstance(launcher, str):
        return launcher
    section = study.get("launcher") or {}
    name = launcher or section.get("name") or "local"
    if name not in LAUNCHERS:
        raise ConfigError(f"--launcher: expected one of {', '.join(LAUNCHERS)}, found {name!r}")
    own = section if section.get("name", name) == name else {}  # another launcher's section is not this one's
    if problems := launcher_problems(own, name):
        raise ConfigError(f"study {study['name']!r}: the launcher section, for the {name} launcher: "
                          + "; ".join(problems))
    return launcher_class(name).from_study(study, {k: v for k, v in own.items() if k != "name"},
                                           jobs or study.get("jobs"), detach=detach)


STUDY_MARKER, STUDY_FORMAT = "eslm-study.json", "eslm-study-v1"
_STUDY_DIRS = ("plan", "logs", "report", "slurm", "models")


def check_study_dir(study_dir: Path, run_dirs: Sequence[Path] = ()) -> None:
    """Refuse (one line) a study directory that is not new, empty (but for a start's lock) or marked by eslm, and a
    link at any directory eslm writes into (``_STUDY_DIRS``, ``run_dirs`` and the folders between)."""
    check_output_dir(study_dir, "the study directory", lambda d: read_marker(d / STUDY_MARKER, STUDY_FORMAT) is not None
                     or not foreign_entries(d, lambda name: name == "eslm.lock"), f"marked by eslm ({STUDY_MARKER})")
    for path in [study_dir / name for name in _STUDY_DIRS] + [p for d in run_dirs for p in _between(study_dir, d)]:
        if path.is_symlink():
            raise link_refused(path)


def _between(study_dir: Path, d: Path) -> list[Path]:
    """``d`` and its parents below ``study_dir`` (``d`` itself when it lies elsewhere)."""
    return [Path(d), *[p for p in Path(d).parents if p != study_dir and p.is_relative_to(study_dir)]]


def _train_and_report(study: dict, configs: list, plan_stages: list[Stage], launcher: Launcher,
                      study_dir: Path) -> int:
    """Train the unfinished runs stage by stage, then the report of ``configs``. Returns the exit code."""
    t0 = time.perf_counter()

    def finished(c) -> bool:
        return (Path(c.run.out_dir) / c.run.name / "result.json").is_file()

    runs = [c for s in plan_stages for c in s.runs]
    for c in runs:
        if finished(c):
            print(f"== {c.run.name}: finished earlier, skipped")
    unfinished = sum(not finished(c) for c in runs)
    if unfinished and analysis_report.mark_stale(study_dir / "report", f"written before eslm study {study['name']} "
                                                 f"continued on {time.strftime('%Y-%m-%d %H:%M')} with {unfinished} "
                                                 "unfinished run(s); it is replaced when the study finishes"):
        print(f"study {study['name']}: the earlier report in {study_dir / 'report'} is marked stale")
    for stage in plan_stages:
        todo = [c for c in stage.runs if not finished(c)]
        if todo:
            if len(plan_stages) > 1:
                print(f"study {study['name']}: {stage.name}: {len(todo)} run(s)", flush=True)
            launched = launcher.launch(todo, study_dir)
            code = launched.code
            if not code and (queued := sum(o.state == QUEUED for o in launched.outcomes)):
                print(f"study {study['name']}: {queued} run(s) on the cluster; eslm study {study['name']} --status "
                      "shows them, and the same command waits for them and writes the report", flush=True)
                return 0
            if code:
                print(f"study {study['name']}: stopped; run the same command again to resume the unfinished runs",
                      file=sys.stderr)
                return code
        if stage.name == shared.STAGE:  # the models the runs will use, before they start
            shared.write_record(study, study_dir, list(stage.runs), configs)
    return run_report(study, [Path(c.run.out_dir) / c.run.name for c in configs], study_dir / "report", t0)


def run_report(study: dict, run_dirs: list[Path], report_dir: Path, t0: float) -> int:
    opts = study.get("report") or {}
    try:
        summary = analysis_report.build_report([str(p) for p in run_dirs], str(report_dir),
                                               target_loss=opts.get("target"), baseline=opts.get("baseline"),
                                               where="report.", primary=opts.get("primary"),
                                               equivalence_margin=opts.get("equivalence_margin"),
                                               study=study["name"])
    except ESLMError as e:
        raise ESLMError(f"study {study['name']}: every run finished, but the report failed: {e}; fix the study "
                        "file's report section and run the same command again (finished runs are skipped: "
                        "only the report is written)") from None
    analysis_report.print_summary(summary, report_dir)
    print(f"study {study['name']} done in {time.perf_counter() - t0:.0f}s; report: {report_dir / 'index.html'}")
    return 0
