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
* ``report`` (optional): ``{baseline: clm, target: 4.3 | baseline, primary: [GROUP, GROUP]}`` for the report;
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

from eslm import metrics as M
from eslm.errors import ConfigError, ESLMError
from eslm.files import name_problem, read_yaml

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
    try:
        return read_yaml(path, "study", fix="fix the file (a mapping with methods, seeds and config)")
    except OSError as e:
        raise ConfigError(f"study {str(path)!r} could not be read ({e.strerror}); check the path") from None


def load_study(name: str) -> dict:
    """The study file ``name`` (a path, or NAME.yaml in ``study_dirs()``), checked whole (``study_problems``):
    every problem of its structure is refused at once, one line each, before anything runs."""
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
    problems = study_problems(study)
    if (why := name_problem(path.stem, "the study's name (its file name, the folder of its runs)")) is not None:
        problems.insert(0, why)
    _refuse(f"study {str(path)!r}", problems)
    study["name"] = path.stem
    return study


def _refuse(where: str, problems: list[str]) -> None:
    """Raise one ConfigError listing every problem, one per line."""
    if problems:
        lines = "".join(f"\n  - {p}" for p in problems)
        raise ConfigError(f"{where}: {len(problems)} problem(s), nothing was run:{lines}")


# ---------------------------------------------------------------- checking a study file

STUDY_KEYS = ("description", "methods", "seeds", "sweep", "config", "budget", "report", "jobs")
AXIS_KEYS = ("values", "methods")
BUDGET_KEYS = ("steps_of", "counter")
REPORT_KEYS = ("baseline", "target", "primary")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _name_list(v) -> str:
    return ", ".join(repr(x) for x in v)


def _method_problem(name) -> str | None:
    import difflib

    from eslm.methods import METHODS

    if not isinstance(name, str):
        return f"expected a method name, found {name!r}"
    if name not in METHODS:
        close = difflib.get_close_matches(name, list(METHODS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown method {name!r}{hint}; expected one of {', '.join(METHODS)}"
    return None


def _entries_problems(methods) -> tuple[list[str], list[str], list[str]]:
    """(problems, method names, labels) of the ``methods`` list."""
    if isinstance(methods, str):
        return [f"methods: expected a list, found the text {methods!r}; write methods: [{methods}]"], [], []
    if not isinstance(methods, list) or not methods:
        return [f"methods: expected a non-empty list of method names or {{name: METHOD, label: TEXT, "
                f"section.key: value}} mappings, found {methods!r}"], [], []
    problems, names, labels = [], [], []
    for i, item in enumerate(methods, 1):
        where = f"methods entry {i}"
        if isinstance(item, dict):
            if "name" not in item:
                problems.append(f"{where}: a mapping needs 'name' (the method), found keys {_name_list(item)}")
                continue
            if (why := _method_problem(item["name"])) is not None:
                problems.append(f"{where}: {why}")
                continue
            if "label" in item and (why := name_problem(item["label"], f"{where}: label")) is not None:
                problems.append(why)
                continue
        elif isinstance(item, str):
            if (why := _method_problem(item)) is not None:
                problems.append(f"{where}: {why}")
                continue
        else:
            problems.append(f"{where}: expected a method name or a mapping with 'name', found {item!r}")
            continue
        method, label, _ = _entry(item)
        names.append(method)
        labels.append(label)
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        problems.append(f"methods: the entry {twice[0]!r} is listed {labels.count(twice[0])} times; list it once, "
                        "or give each variant its own 'label'")
    return problems, names, labels


def _seeds_problems(seeds, where: str) -> list[str]:
    if _is_int(seeds):
        return [f"{where}: expected a list of integer seeds, found {seeds!r}; write seeds: [{seeds}]"]
    if not isinstance(seeds, list) or not seeds:
        return [f"{where}: expected a non-empty list of integer seeds, found {seeds!r}"]
    bad = [s for s in seeds if not _is_int(s)]
    if bad:
        return [f"{where}: expected integer seeds, found {_name_list(bad)}"]
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        return [f"{where}: seed {twice[0]} is listed {seeds.count(twice[0])} times; list each seed once "
                "(a repeated seed would train the same run twice and be counted twice in the report)"]
    return []


def _sweep_problems(sweep, labels: list[str]) -> list[str]:
    if sweep is None:
        return []
    if not isinstance(sweep, dict):
        return [f"sweep: expected a mapping of axes (section.key: [v1, v2]), found {sweep!r}"]
    problems = []
    for key, spec in sweep.items():
        where = f"sweep {key!r}"
        if isinstance(spec, dict):
            extra = [k for k in spec if k not in AXIS_KEYS]
            if extra:
                problems.append(f"{where}: unknown key(s) {_name_list(extra)}; expected {_name_list(AXIS_KEYS)}")
            ms = spec.get("methods")
            if "methods" in spec:
                if isinstance(ms, str):
                    problems.append(f"{where}: methods: expected a list, found the text {ms!r}; write methods: [{ms}]")
                elif not isinstance(ms, list) or not ms:
                    problems.append(f"{where}: methods: expected a non-empty list of method entries (leave "
                                    f"'methods' out to sweep every entry), found {ms!r}")
                else:
                    unknown = [m for m in ms if m not in labels]
                    if unknown and labels:
                        problems.append(f"{where}: methods names {_name_list(unknown)}, which is no entry of the "
                                        f"study's methods; expected some of {_name_list(labels)} (a labelled "
                                        "variant is named by its label)")
            spec = spec.get("values")
        if not isinstance(spec, list) or not spec:
            problems.append(f"{where}: expected a non-empty list of values (or {{values: [...], methods: [...]}}), "
                            f"found {spec!r}")
            continue
        texts = [str(v) for v in spec]
        twice = sorted({t for t in texts if texts.count(t) > 1})
        if twice:
            problems.append(f"{where}: the value {twice[0]} is listed twice; list each value once")
    return problems


def _budget_problems(budget, names: list[str], labels: list[str]) -> list[str]:
    from eslm.config import build_config

    if budget is None:
        return []
    if not isinstance(budget, dict):
        return [f"budget: expected a mapping {{steps_of: METHOD, counter: COUNTER}}, found {budget!r}"]
    problems = []
    extra = [k for k in budget if k not in BUDGET_KEYS]
    if extra:
        problems.append(f"budget: unknown key(s) {_name_list(extra)}; expected {_name_list(BUDGET_KEYS)}")
    steps_of = budget.get("steps_of")
    if "steps_of" in budget and (not isinstance(steps_of, str) or steps_of not in names + labels):
        known = _name_list(dict.fromkeys(names + labels))
        problems.append(f"budget.steps_of: expected one of the study's methods ({known}), found {steps_of!r}")
    if "counter" in budget:
        try:  # the config's own check of flops.budget_counter (its choices live there)
            build_config(overrides=[f"flops.budget_counter={budget['counter']}"])
        except ConfigError as e:
            problems.append(f"budget.counter: {str(e).partition('flops.budget_counter: ')[2] or e}")
        else:
            if "steps_of" not in budget:
                problems.append("budget.counter applies with budget.steps_of only; add steps_of: METHOD, or "
                                "set flops.budget_counter and train.max_flops under config")
    return problems


def _report_problems(report) -> list[str]:
    """The report section's form (whether its names are groups of the study is checked by ``plan``)."""
    if report is None:
        return []
    if not isinstance(report, dict):
        return [f"report: expected a mapping {{baseline: GROUP, target: LOSS|baseline, primary: [GROUP, GROUP]}}, "
                f"found {report!r}"]
    problems = []
    extra = [k for k in report if k not in REPORT_KEYS]
    if extra:
        problems.append(f"report: unknown key(s) {_name_list(extra)}; expected {_name_list(REPORT_KEYS)}")
    if "baseline" in report and (not isinstance(report["baseline"], str) or not report["baseline"]):
        problems.append(f"report.baseline: expected a group or method name, found {report['baseline']!r}")
    target = report.get("target")
    if "target" in report and target != "baseline" and not (
            isinstance(target, (int, float)) and not isinstance(target, bool) and 0 < target < float("inf")):
        problems.append(f"report.target: expected a positive validation loss or 'baseline', found {target!r}")
    primary = report.get("primary")
    if "primary" in report and not (isinstance(primary, list) and len(primary) == 2
                                    and all(isinstance(x, str) and x for x in primary) and primary[0] != primary[1]):
        problems.append(f"report.primary: expected two different group names [GROUP, GROUP], found {primary!r}")
    return problems


def study_problems(study: dict) -> list[str]:
    """Every problem of a study file's structure (one phrase each; empty when it is well-formed): its keys,
    ``methods`` (known methods, path-safe labels, no entry twice), ``seeds`` (integers, each once), ``sweep``
    (non-empty value lists; ``methods`` naming entries of the study), ``config`` (a mapping), ``budget``
    (``steps_of`` a method of the study, a known ``counter``), ``report`` (its keys and values) and ``jobs``.
    Config keys and values, and the report's group names, are checked when the runs are planned (``plan``)."""
    problems = []
    unknown = [k for k in study if k not in STUDY_KEYS]
    if unknown:
        problems.append(f"unknown key(s) {_name_list(unknown)}; expected some of {_name_list(STUDY_KEYS)}")
    missing = [k for k in ("methods", "seeds", "config") if k not in study]
    if missing:
        problems.append(f"missing key(s) {_name_list(missing)}; a study needs methods, seeds and config")
    names, labels = [], []
    if "methods" in study:
        found, names, labels = _entries_problems(study["methods"])
        problems += found
    if "seeds" in study:
        problems += _seeds_problems(study["seeds"], "seeds")
    if "config" in study and study["config"] is not None and not isinstance(study["config"], dict):
        problems.append(f"config: expected a mapping of config sections (e.g. {{train: {{max_steps: 90}}}}), "
                        f"found {study['config']!r}")
    problems += _sweep_problems(study.get("sweep"), labels)
    problems += _budget_problems(study.get("budget"), names, labels)
    problems += _report_problems(study.get("report"))
    if "jobs" in study and not (_is_int(study["jobs"]) and study["jobs"] >= 1):
        problems.append(f"jobs: expected an integer >= 1, found {study['jobs']!r}")
    if "description" in study and not isinstance(study["description"], str):
        problems.append(f"description: expected a text, found {study['description']!r}")
    return problems


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
    """``sweep`` -> [(dotted key, values, methods it applies to or None for all)] (checked by ``study_problems``)."""
    out = []
    for key, spec in (study.get("sweep") or {}).items():
        methods = None
        if isinstance(spec, dict):
            methods = set(spec["methods"]) if "methods" in spec else None
            spec = spec.get("values")
        out.append((str(key), spec, methods))
    return out


def _slug(override: str) -> str:
    """'method.alpha=0.3' -> 'alpha0.3' (readable, path-safe)."""
    key, _, value = override.partition("=")
    text = key.rsplit(".", 1)[-1] + value
    return "".join(c if c.isalnum() or c in "._" else "_" for c in text)


def grid(study: dict, seeds=None) -> list[tuple[str, str, list[str], int]]:
    """Every run of the study as (method, run name, overrides, seed): seeds outermost, then methods in file
    order, then the sweep axes' product. Two grid points with one name are refused."""
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


def _by_message(failures: list[tuple[str, str]], total: int) -> list[str]:
    """[(run name, problem)] -> one line per distinct problem, naming its runs ("every run" when all have it)."""
    runs: dict[str, list[str]] = {}
    for name, text in failures:
        runs.setdefault(text, []).append(name)
    out = []
    for text, names in runs.items():
        who = "every run" if len(names) == total > 1 else ", ".join(names[:3]) + (
            f" and {len(names) - 3} more" if len(names) > 3 else "")
        out.append(f"{who}: {text}")
    return out


def plan(study: dict, out: Path, seeds=None, overrides=()) -> list:
    """The resolved Config of every run of the study, checked before any run starts, every problem at once:
    each run's config (keys, values, the method's own checks), ``seeds`` given on the command line, two runs
    that would train the same thing (the report would count them as one group's seed twice), and the
    report section's group names against the groups the planned runs form."""
    from eslm.config import build_config

    where = f"study {study['name']}"
    if seeds:
        _refuse(where, _seeds_problems(list(seeds), "--seeds"))
    base = _flatten(study["config"] or {})
    budget = study.get("budget") or {}
    points = grid(study, seeds)
    configs, failures = [], []
    for method, name, over, seed in points:
        items = base + over + list(overrides) + [f"method.name={method}", f"run.seed={seed}",
                                                 f"run.out_dir={out / study['name']}", f"run.name={name}"]
        try:
            configs.append(build_config(overrides=items))
        except ConfigError as e:
            failures.append((name, str(e)))
    problems = _by_message(failures, len(points))
    if not failures:
        if budget.get("steps_of"):
            configs = [_with_budget(c, budget) for c in configs]
        problems += _same_run_problems(configs) + _report_group_problems(study.get("report") or {}, configs)
    _refuse(where, problems)
    return configs


def _same_run_problems(configs: list) -> list[str]:
    """Grid points whose runs' resolved configs are equal but for their names: the same training twice."""
    from eslm.analysis.rundir import experiment_key

    seen: dict[tuple[str, int], str] = {}
    pairs: dict[tuple[str, str], None] = {}
    for c in configs:
        key = (experiment_key(c.to_dict()), c.run.seed)
        point = c.run.name.removesuffix(f"-s{c.run.seed}")
        if key in seen:
            pairs[(seen[key], point)] = None
        else:
            seen[key] = point
    return [f"{a} and {b} plan the same runs (equal configs, the same seeds): the report would count each seed "
            "twice in one group; remove one entry or make them differ" for a, b in pairs]


def _report_group_problems(report: dict, configs: list) -> list[str]:
    """Names in the report section that would not name one group of the planned runs (``find_group``), and
    runs the report could not put on one target (``comparable_sets_problem``: data, tokenizer, model)."""
    from eslm.analysis.rundir import comparable_sets_problem, find_group, planned_groups

    groups = planned_groups([c.to_dict() for c in configs])
    why = comparable_sets_problem(groups)
    fix = "; run one study per set"
    out = [] if why is None else [f"the study's report would refuse its runs: "
                                  f"{why.replace('; report each set separately', fix)}"]
    names = [("report.baseline", report["baseline"])] if "baseline" in report else []
    names += [("report.primary", n) for n in report.get("primary") or []]
    for option, name in names:
        _, why = find_group(groups, name, option)
        if why:
            out.append(why)
    if report.get("target") == "baseline" and "baseline" not in report:
        _, why = find_group(groups, "clm", "report.target: baseline uses the default baseline, which")
        if why:
            out.append(why + "; add report.baseline")
    return out


def _with_budget(cfg, budget: dict):
    """Equal FLOPs: max_flops = dense FLOPs of max_steps steps; max_steps raised so the budget binds
    (``eslm.flops.equal_flops_budget``); lr_decay_steps = the dense run's length, which the trainer stretches to
    each run's own step count under ``train.lr_schedule: budget`` (``eslm.train.optim.plan_schedule``)."""
    from dataclasses import replace

    from eslm.flops import equal_flops_budget

    t = cfg.train
    flops, max_steps = equal_flops_budget(cfg)
    counter = budget.get("counter", M.FLOPS_PAPER)
    return replace(cfg, train=replace(t, max_flops=flops, max_steps=max_steps, lr_decay_steps=t.lr_decay_steps or t.max_steps),
                   flops=replace(cfg.flops, budget_counter=counter))


def run_study(preset: str, out: str | Path = "runs/studies", *, seeds: list[int] | None = None,
              jobs: int | None = None, dry_run: bool = False, overrides: list[str] | tuple = ()) -> int:
    """``eslm study``: plan the study ``preset`` (a name in configs/studies or a path) under ``out``/NAME, print
    the plan, train the unfinished runs (``jobs`` at once; default: the study file's, else 1), then the
    report. Returns the exit code: 0, 143 when stopped by SIGTERM, else that of the failed run."""
    if jobs is not None and not (_is_int(jobs) and jobs >= 1):
        raise ConfigError(f"--jobs: expected an integer >= 1, found {jobs!r}")
    study = load_study(preset)
    out = Path(out)
    configs = plan(study, out, seeds, overrides)
    jobs = jobs or study.get("jobs") or 1
    print(f"study {study['name']}: {len(configs)} runs -> {out / study['name']}"
          + (f" ({jobs} at a time)" if jobs > 1 else ""))
    for c in configs:
        print(f"  {c.run.name}: method={c.method.name} seed={c.run.seed} budget {c.train.max_flops:.3g} "
              f"{c.flops.budget_counter}")
    if dry_run:
        return 0
    from eslm.lock import DirLock

    study_dir = out / study["name"]
    study_dir.mkdir(parents=True, exist_ok=True)
    with DirLock(study_dir, what="study directory"):  # a second eslm study on this directory is refused
        return _train_and_report(study, configs, jobs, study_dir)


def _train_and_report(study: dict, configs: list, jobs: int, study_dir: Path) -> int:
    t0 = time.perf_counter()
    run_dirs = [Path(c.run.out_dir) / c.run.name for c in configs]
    pending = [c for c in configs if not (Path(c.run.out_dir) / c.run.name / "result.json").is_file()]
    for c in configs:
        if c not in pending:
            print(f"== {c.run.name}: finished earlier, skipped")
    if pending:  # an earlier report no longer describes the study: say so on it until the new one replaces it
        from eslm.analysis.report import mark_stale

        if mark_stale(study_dir / "report", f"written before eslm study {study['name']} continued on "
                      f"{time.strftime('%Y-%m-%d %H:%M')} with {len(pending)} unfinished run(s); it is replaced "
                      "when the study finishes"):
            print(f"study {study['name']}: the earlier report in {study_dir / 'report'} is marked stale")
    code = _run_serial(pending) if jobs == 1 else _run_parallel(pending, jobs, study_dir)
    if code:
        print(f"study {study['name']}: stopped; run the same command again to resume the unfinished runs",
              file=sys.stderr)
        return code
    return _report(study, run_dirs, study_dir / "report", t0)


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


# The study parent's lifeline: its children inherit the read end of a pipe whose write end only the parent holds.
# When the parent ends, however it ends (SIGKILL included), the kernel closes the write end, the child reads EOF
# and stops as on SIGTERM: after its current step, with a checkpoint (``watch_parent``).
PARENT_FD_ENV = "ESLM_STUDY_PARENT_FD"


def watch_parent() -> None:
    """In a study's child (``eslm train`` started by ``eslm study``): SIGTERM this process when the study's
    process is gone. Does nothing in a process the study did not start."""
    import threading

    fd = os.environ.pop(PARENT_FD_ENV, None)  # popped: the run's own subprocesses are not study children
    if fd is None or not fd.isdigit():
        return

    def wait() -> None:
        try:
            while os.read(int(fd), 1):
                pass
        except OSError:
            pass
        print("eslm study: the study process is gone: this run stops after its current step (checkpoint saved)",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="eslm-study-parent", daemon=True).start()


def _child_outcome(code: int, finished: bool, sent_term: bool) -> tuple[bool, str]:
    """(finished, words) for a child that exited with ``code``."""
    if code == 0 and finished:
        return True, "finished"
    if code == 0:  # eslm train exits 0 when SIGTERM stopped it after a step and its checkpoint
        return False, "preempted (checkpoint saved; the same command resumes it)"
    if code in (-signal.SIGTERM, 128 + signal.SIGTERM) and sent_term:
        return False, "stopped by SIGTERM before its first step (the same command starts it again)"
    return False, f"failed (exit {code})"


def _run_parallel(configs: list, jobs: int, study_dir: Path) -> int:
    """Train up to ``jobs`` runs at once, each as ``python -m eslm.cli train PLAN.yaml`` with its resolved
    config. The children run in their own sessions, so a terminal's Ctrl-C or a signal to the study's process
    group reaches the study only, which passes SIGTERM on once to each child (each saves a checkpoint and
    exits) and waits for them; they also stop by themselves if the study's process dies (``watch_parent``)."""
    from dataclasses import replace

    from eslm.config import to_yaml

    threads = max(1, (os.cpu_count() or 1) // jobs)
    (study_dir / "plan").mkdir(parents=True, exist_ok=True)
    (study_dir / "logs").mkdir(parents=True, exist_ok=True)
    queue, running, failed, stop = list(configs), {}, [], []
    old = signal.signal(signal.SIGTERM, lambda *_: stop.append(True)) if _main_thread() else None
    lifeline_r, lifeline_w = os.pipe()  # not inheritable: a child gets the read end only, through pass_fds
    env = {**os.environ, PARENT_FD_ENV: str(lifeline_r)}

    def terminate_all():
        for name, (proc, _, sent) in running.items():
            if not sent and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                running[name] = (proc, running[name][1], True)

    def reap():
        for name, (proc, log, sent) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                del running[name]
                ok, words = _child_outcome(proc.returncode, (study_dir / name / "result.json").is_file(), sent)
                print(f"== {name} {words}", flush=True)
                if not ok:
                    failed.append(name)

    try:
        while queue or running:
            while queue and len(running) < jobs and not stop:
                c, resume = _resume_flag(queue.pop(0))
                if c.train.num_threads == 0:
                    c = replace(c, train=replace(c.train, num_threads=threads))
                plan_file = study_dir / "plan" / f"{c.run.name}.yaml"
                _write_text_atomic(plan_file, to_yaml(c))
                log = open(study_dir / "logs" / f"{c.run.name}.log", "a")
                cmd = [sys.executable, "-m", "eslm.cli", "train", str(plan_file)]
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(lifeline_r,),
                                        start_new_session=True)
                running[c.run.name] = (proc, log, False)
                print(f"== {c.run.name}{' (resuming)' if resume else ''} started", flush=True)
            if stop:
                terminate_all()
            time.sleep(0.5)
            reap()
            if stop and not running:
                return 143
    finally:
        if running:  # an exception or Ctrl-C in the study: its children stop cleanly before it goes
            terminate_all()
            for proc, log, _ in running.values():
                proc.wait()
                log.close()
        os.close(lifeline_r)
        os.close(lifeline_w)
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    if failed:
        print(f"study: {len(failed)} run(s) did not finish: {', '.join(failed)}; see {study_dir / 'logs'}",
              file=sys.stderr)
        return 1
    return 0


def _write_text_atomic(path: Path, text: str) -> None:
    """Write through a temporary file beside ``path`` and a rename: a reader (a child starting, a second look
    at the plan) never sees half a file, and a link at ``path`` is replaced, not followed."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _report(study: dict, run_dirs: list[Path], report_dir: Path, t0: float) -> int:
    from eslm.analysis.report import build_report, print_summary

    opts = study.get("report") or {}
    try:
        summary = build_report([str(p) for p in run_dirs], str(report_dir), target_loss=opts.get("target"),
                               baseline=opts.get("baseline"), where="report.", primary=opts.get("primary"))
    except ESLMError as e:
        raise ESLMError(f"study {study['name']}: every run finished, but the report failed: {e}; fix the study "
                        "file's report section and run the same command again (finished runs are skipped: "
                        "only the report is written)") from None
    print_summary(summary, report_dir)
    print(f"study {study['name']} done in {time.perf_counter() - t0:.0f}s; report: {report_dir / 'index.html'}")
    return 0


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
