"""The plan of a study: each run's resolved and checked Config (``plan``) and the stages the runs train in
(``stages``: shared models, a branched study's trunks, then the grid's runs; only the last is reported)."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from eslm import metrics as M
from eslm.analysis.rundir import comparable_sets_problem, config_get, experiment_key, find_group, planned_groups
from eslm.config import build_config, equal_flops_budget, flat
from eslm.errors import ConfigError
from eslm.files import atomic_write, listing
from eslm.methods import baseline, control_of
from eslm.study import shared
from eslm.study.schema import MAX_RUNS, flatten, method_entry, refuse, seeds_problems, slug
from eslm.train.branch import SHARED_KEYS


@dataclass(frozen=True)
class Stage:
    """Runs (resolved Configs) that train together, in this order of priority; ``name`` is what the study's
    output calls them ("models", "trunks", "runs")."""

    name: str
    runs: tuple


def stages(study: dict, configs: list) -> list[Stage]:
    """The stages the planned runs ``configs`` train in, first to last."""
    first = []
    if study.get("models") and configs:
        models, _ = shared.plan_models(study, Path(configs[0].run.out_dir), flatten(study["config"] or {}),
                                       list(dict.fromkeys(c.run.seed for c in configs)))
        first = [Stage(shared.STAGE, tuple(models))]
    if study.get("branch") and configs:
        first.append(Stage("trunks", tuple(_trunks(study, configs))))
    return first + [Stage("runs", tuple(configs))]


def trunk_name(study: dict, seed: int) -> str:
    return f"trunk-{study['branch']['from']}-s{seed}"


def branch_step(study: dict, cfg) -> int:
    """The optimizer step of the branch point: ``branch.at_tokens`` in whole steps of ``cfg`` (rounded down)."""
    t = cfg.train
    return int(study["branch"]["at_tokens"]) // (t.micro_batch_size_seqs * cfg.data.seq_len * t.grad_accum_steps)


def _branch_problems(study: dict, configs: list) -> list[str]:
    """The branch point against the runs: past the warmup, before the end of the dense run's schedule, no
    trunk named as a grid run."""
    c = configs[0]
    t, step = c.train, branch_step(study, c)
    decay = t.lr_decay_steps or t.max_steps
    words = f"branch.at_tokens: {study['branch']['at_tokens']} tokens is step {step}"
    out = []
    if step < max(1, t.warmup_steps):
        out.append(f"{words}, inside the warmup ({t.warmup_steps} steps); expected a branch point at or after "
                   f"step {max(1, t.warmup_steps)}")
    if step >= decay:
        out.append(f"{words}, at or past the end of the schedule ({decay} steps); expected an earlier branch point")
    names = {x.run.name for x in configs}
    out += [f"branch: the trunk {trunk_name(study, x.run.seed)!r} has the name of a grid run; label that entry"
            for x in configs if trunk_name(study, x.run.seed) in names][:1]
    return out + _arm_problems(configs)


def _arm_problems(configs: list) -> list[str]:
    """Arms that set a key the branch must share (``eslm.train.branch.SHARED_KEYS``) otherwise than their seed's
    first run, from which the trunk is built: refused in the plan, not after the trunk and the other arms trained."""
    first: dict[int, dict] = {}
    bad: dict[str, list[str]] = {}
    for c in configs:
        values = {k: v for k, v in flat(c).items() if k in SHARED_KEYS or k.split(".")[0] in SHARED_KEYS}
        trunk = first.setdefault(c.run.seed, values)
        for k, v in values.items():
            if trunk.get(k) != v:
                bad.setdefault(k, []).append(c.run.name)
    return [f"branch: {listing(runs, show=str)} set {key} "
            "otherwise than their seed's first run, whose trunk every arm continues; a branched study's arms share "
            "the data, model, batch and optimizer up to the branch point: sweep that key in a study without a "
            "branch section, or give it one value" for key, runs in bad.items()]


def _with_branch(study: dict, configs: list) -> list:
    """Every run continues the checkpoint of its seed's trunk at the branch point (``train.branch_from``)."""
    step = branch_step(study, configs[0])
    out = []
    for c in configs:
        ckpt = Path(c.run.out_dir) / trunk_name(study, c.run.seed) / "checkpoints" / f"step_{step:07d}.pt"
        out.append(replace(c, train=replace(c.train, branch_from=str(ckpt))))
    return out


def _trunks(study: dict, runs: list) -> list:
    """One trunk per seed: its first run's config with the method ``branch.from``, trained to the branch point on
    the dense run's schedule (unstretched), without a FLOPs budget."""
    first = runs[0].train
    step, decay = branch_step(study, runs[0]), first.lr_decay_steps or first.max_steps
    method = {"method": ((study["config"] or {}).get("method") or {})}
    out = []
    for seed in dict.fromkeys(c.run.seed for c in runs):
        arm = next(c for c in runs if c.run.seed == seed).to_dict()
        out.append(build_config(overrides=flatten({k: v for k, v in arm.items() if k != "method"}) + flatten(method) + [
            f"method.name={study['branch']['from']}", f"run.name={trunk_name(study, seed)}", f"train.max_steps={step}",
            f"train.lr_decay_steps={decay}", "train.lr_schedule=steps", "train.max_flops=0", "train.branch_from="]))
    return out


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


def grid(study: dict, seeds=None) -> list[tuple[str, str, list[str], int]]:
    """Every run as (method, run name, overrides, seed): seeds outermost, then methods in file order, then the
    sweep axes' product. More than ``MAX_RUNS`` runs are refused before anything is expanded."""
    seeds, axes = seeds or study["seeds"], _axes(study)
    entries = []
    for item in study["methods"]:
        method, label, over = method_entry(item)
        # a restricted axis names methods by label: a labelled variant is its own entry, not its method's
        entries.append((method, label, over, [(k, vals) for k, vals, ms in axes if ms is None or label in ms]))
    per_seed = sum(math.prod(len(vals) for _, vals in applicable) for *_, applicable in entries)
    if per_seed * len(seeds) > MAX_RUNS:
        raise ConfigError(f"study {study['name']}: expected at most {MAX_RUNS} runs, found {per_seed} grid points x "
                          f"{len(seeds)} seed(s) = {per_seed * len(seeds)}; shorten the sweep axes or the seeds "
                          "(or split the study)")
    points: list[tuple[str, str, list[str]]] = []
    for method, label, over, applicable in entries:
        for combo in itertools.product(*[vals for _, vals in applicable]):
            sweep = [f"{k}={v}" for (k, _), v in zip(applicable, combo)]
            points.append((method, "-".join([label] + [slug(o) for o in sweep]), over + sweep))
    dup = sorted(n for n, k in Counter(p[1] for p in points).items() if k > 1)
    if dup:
        raise ConfigError(f"study: the grid names {dup[0]!r} twice; give one of the method entries a 'label'")
    return [(m, f"{name}-s{seed}", over, seed) for seed in seeds for m, name, over in points]


def plan(study: dict, out: Path, seeds=None, overrides=()) -> list:
    """The resolved Config of every run of the study, checked before any run starts, every problem at once (each
    run's config, ``seeds``, two runs training the same thing, the report section's group names, the shared
    models and the branch)."""

    where = f"study {study['name']}"
    if seeds:
        refuse(where, seeds_problems(list(seeds), "--seeds"))
    base = flatten(study["config"] or {})
    budget = study.get("budget") or {}
    points = grid(study, seeds)
    configs: list = []
    failures: dict[str, list[str]] = {}  # {problem: [run names]}
    for method, name, over, seed in points:
        items = base + over + list(overrides) + [f"method.name={method}", f"run.seed={seed}",
                                                 f"run.out_dir={out / study['name']}", f"run.name={name}"]
        items = shared.resolve(items, study, out / study["name"], seed)
        try:
            configs.append(build_config(overrides=items))
        except ConfigError as e:
            for problem in e.problems:
                failures.setdefault(problem, []).append(name)
    problems = [f"{'every run' if len(names) == len(points) > 1 else listing(names, show=str)}: {text}"
                for text, names in failures.items()]  # one line per problem, naming its runs
    if not failures:
        if budget.get("steps_of"):
            configs = [_with_budget(c, budget) for c in configs]
        problems += _same_run_problems(configs) + _report_group_problems(study.get("report") or {}, configs)
        if study.get("models"):
            _, found = shared.plan_models(study, out / study["name"], base, list(dict.fromkeys(p[3] for p in points)))
            problems += found + shared.missing_problems(configs, study, out / study["name"])
        if study.get("branch"):
            problems += _branch_problems(study, configs)
    refuse(where, problems)
    return _with_branch(study, configs) if study.get("branch") else configs


def _same_run_problems(configs: list) -> list[str]:
    """Grid points whose runs' resolved configs are equal but for their names: the same training twice."""
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
    """What the report would refuse: names in the report section that name no one group, runs of several sets."""
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
    base = [g for g in groups if g.method == baseline()]
    if "baseline" not in report and len({g.point or g.label for g in base}) > 1:  # e.g. two CLM labels
        _, why = find_group(groups, baseline(), "report.baseline (not set: the default)")
        if why:
            out.append(why + "; add report.baseline naming one of them")
    elif report.get("target") == "baseline" and "baseline" not in report:
        _, why = find_group(groups, baseline(), "report.target: baseline uses the default baseline, which")
        if why:
            out.append(why + "; add report.baseline")
    return out


def missing_controls(report: dict, configs: list) -> str | None:
    """One line naming the planned groups whose registry control (``control_of``) has no group at their alpha;
    None when every one has it or ``report.controls`` is false."""
    if report.get("controls") is False:
        return None
    groups = planned_groups([c.to_dict() for c in configs])

    def alpha(g):
        return config_get(g.runs[0].config, "method.alpha")

    lacking = [(g, control) for g in groups if (control := control_of(g.method)) is not None
               and not any(c.method == control and alpha(c) == alpha(g) for c in groups)]
    if not lacking:
        return None
    which = "; ".join(f"{g.point or g.label} (no {control} at method.alpha={alpha(g)})" for g, control in lacking)
    return (f"report: {len(lacking)} group(s) have no control among the planned runs, so the report will not compare "
            f"them with it: {which}; add the control to methods (or its alpha to the sweep), or set "
            "report.controls: false to report without it")


def _with_budget(cfg, budget: dict):
    """Equal FLOPs (``eslm.config.equal_flops_budget``); lr_decay_steps = the dense run's length, which the
    trainer stretches to each run's own step count under ``train.lr_schedule: budget``."""
    t = cfg.train
    flops, max_steps = equal_flops_budget(cfg)
    counter = budget.get("counter", M.FLOPS_PAPER)
    return replace(cfg, train=replace(t, max_flops=flops, max_steps=max_steps, lr_decay_steps=t.lr_decay_steps or t.max_steps),
                   flops=replace(cfg.flops, budget_counter=counter))


BRANCH_RECORD = "branch.json"


def check_branch_record(study: dict, study_dir: Path, runs: list) -> None:
    """Refuse to continue a study whose branch settings changed since its runs started (or that starts branching
    runs trained without); else record them in ``<study>/branch.json``."""
    now = ({"from": study["branch"]["from"], "at_tokens": study["branch"]["at_tokens"],
            "step": branch_step(study, runs[0])} if study.get("branch") else None)
    path = study_dir / BRANCH_RECORD
    fix = ("restore the study file's branch section, or give the changed study its own --out (or file name)")
    if path.is_file():
        try:
            before = json.loads(path.read_text()).get("branch")
        except (OSError, json.JSONDecodeError, AttributeError):
            raise ConfigError(f"study {study['name']}: {path} is not the JSON eslm wrote; delete it only if every "
                              "run of the study was branched as the study file says") from None
        same = (before is None) == (now is None) and (now is None or (before.get("from"), before.get("step"))
                                                      == (now["from"], now["step"]))
        if not same:
            raise ConfigError(f"study {study['name']}: its runs were started with branch {_words(before)}; the "
                              f"study file now says {_words(now)}; a study's runs share one branch point: {fix}")
        return
    started = [c.run.name for c in runs if (Path(c.run.out_dir) / c.run.name).exists()]
    if now is not None and started:
        raise ConfigError(f"study {study['name']}: {', '.join(started[:3])} started without a branch; the study "
                          f"file now says {_words(now)}: {fix}")
    atomic_write(path, (json.dumps({"branch": now}, indent=2) + "\n").encode())


def _words(branch: dict | None) -> str:
    if branch is None:
        return "none (every run from step 0)"
    return f"from {branch.get('from')} at step {branch.get('step')} ({branch.get('at_tokens')} tokens)"
