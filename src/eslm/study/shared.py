"""Study-level shared models: frozen models (a Rho-1 reference, a KD teacher) that a study trains once and every
run that needs one uses (the ``models`` section; docs/study.md, "Shared models"). The plan replaces a model's name
by its directory (``resolve``), so each run's config.yaml records the model it used."""

from __future__ import annotations

import json
from pathlib import Path

from eslm.config import build_config, flat
from eslm.errors import ConfigError, ESLMError, OwnershipError
from eslm.files import atomic_write, listing, read_marker, sha256_file
from eslm.methods import METHODS, baseline
from eslm.model.loading import resolve_checkpoint, step_of
from eslm.study.schema import MODEL_KEYS, flatten
from eslm.train.resume import INVOCATION_KEYS, RESUME_MAY_CHANGE, effective_config

MODELS_DIR = "models"
STAGE = "shared models"  # the name of their stage (``eslm.study.grid.stages``): trained before the runs
# keys that never change a trained model's weights: a shared model's config may differ in these only
_NEUTRAL_PREFIXES = ("log.", "eval.", "checkpoint.")
_NEUTRAL_KEYS = ("train.num_threads", "distributed.backend")


def frozen_model_keys() -> set[str]:
    """The config keys through which a method takes a frozen model (the registry's needs)."""
    return {n.key for spec in METHODS.values() for n in spec.frozen_models}


def model_dir(study_dir: Path, name: str, spec: dict, seed: int) -> Path:
    """Where the model ``name`` that a run of ``seed`` uses lives."""
    return Path(study_dir) / MODELS_DIR / (f"{name}-s{seed}" if spec.get("per_seed") else name)


def _model_seeds(spec: dict, seeds: list[int]) -> list[int]:
    return list(seeds) if spec.get("per_seed") else [spec.get("seed", 0)]


def resolve(items: list[str], study: dict, study_dir: Path, seed: int) -> list[str]:
    """Override items ``key=value`` with a frozen-model key whose value names a shared model of the study ->
    ``key=<the model's directory>`` (the model of ``seed`` for a per_seed model)."""
    models, keys = study.get("models") or {}, frozen_model_keys()
    out = []
    for item in items:
        key, _, value = item.partition("=")
        if key in keys and value in models:
            item = f"{key}={model_dir(study_dir, value, models[value], seed)}"
        out.append(item)
    return out


def plan_models(study: dict, study_dir: Path, base: list[str], seeds: list[int]) -> tuple[list, list[str]]:
    """(the resolved Config of every shared model to train, problems): ``base`` (the study's config) + its own
    keys, without the study's budget. Command-line overrides apply to the runs only: a model is what the study
    file says (an override that changed it would be refused on the next call without it)."""
    models = study.get("models") or {}
    keys = frozen_model_keys()
    configs, problems = [], []
    for name, spec in models.items():
        own = flatten({k: v for k, v in spec.items() if k not in MODEL_KEYS})
        names_a_model = [i for i in own if i.partition("=")[0] in keys and i.partition("=")[2] in models]
        if names_a_model:
            problems.append(f"models {name!r}: {names_a_model[0]}: a shared model cannot use another shared model; "
                            "train it in its own study and give its directory")
            continue
        inherited = [i for i in base
                     if not (i.partition("=")[0] in keys and i.partition("=")[2] in models)]
        for seed in _model_seeds(spec, seeds):
            d = model_dir(study_dir, name, spec, seed)
            items = inherited + own + [f"method.name={spec.get('method', baseline())}", f"run.seed={seed}",
                                       f"run.out_dir={d.parent}", f"run.name={d.name}"]
            try:
                configs.append(build_config(overrides=items))
            except ConfigError as e:
                problems += [f"models {name!r}: {problem}" for problem in dict.fromkeys(e.problems)]
    return configs, problems + changed_problems(configs)


def _trained(configs: list, may_differ):
    """(config, run directory, ["key: old -> new"] or the ConfigError reading it raised) of each of ``configs``
    that has trained, but for the keys ``may_differ(key, run directory)``."""
    for c in configs:
        d = Path(c.run.out_dir) / c.run.name
        if (d / "config.yaml").is_file():
            try:
                old = flat(effective_config(d))
            except ConfigError as e:
                yield c, d, e
                continue
            yield c, d, [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in flat(c).items()
                         if k not in INVOCATION_KEYS and not may_differ(k, d) and old.get(k) != v]


def changed_problems(configs: list) -> list[str]:
    """Shared models already (partly) trained with another config than the plan's, one line each."""
    out = []
    for _, d, diff in _trained(configs, lambda k, _: k in _NEUTRAL_KEYS or k.startswith(_NEUTRAL_PREFIXES)):
        if isinstance(diff, ConfigError):
            out.append(f"shared model {d}: its config cannot be read ({diff}); delete the directory to train it again")
        elif diff:
            out.append(f"shared model {d} was trained with another config ({'; '.join(diff)}); the runs that use "
                       "it would mix two models: restore the study file's models entry, or delete that directory "
                       "and the runs that used it to train it again, or give the changed model a new name")
    return out


# keys a study's run may have trained with other values without changing its results (how it logged, where it
# kept checkpoints, how it ran); every other key of a finished run's config must equal the plan's
RUN_NEUTRAL_KEYS = tuple(k for k in RESUME_MAY_CHANGE if k not in ("train.max_steps", "train.max_flops",
                                                                    "eval.interval"))


def changed_run_problems(configs: list) -> list[str]:
    """Runs that already trained with a config other than the plan's (a finished run would be skipped and reported
    as the study file's; an unfinished one is compared on the keys a resume may not change): one problem."""
    changed = []
    for c, _, diff in _trained(configs, lambda k, d: k in (RUN_NEUTRAL_KEYS if (d / "result.json").is_file()
                                                           else RESUME_MAY_CHANGE)):
        if isinstance(diff, ConfigError):
            changed.append(f"{c.run.name} (its config cannot be read: {diff})")
        elif diff:
            changed.append(f"{c.run.name} ({listing(diff, 4, str, '; ')})")
    if not changed:
        return []
    return [f"{len(changed)} run(s) already trained with settings other than the plan's: {listing(changed, 5, str)};"
            " their results would be reported as the study file's: restore the study file's settings (and the "
            "command's overrides), or give the changed study another name or --out (a new directory trains every "
            "run with the new settings)"]


def unknown_model_problems(configs: list, study: dict, study_dir: Path) -> list[str]:
    """Runs whose frozen-model key names neither a shared model nor an existing path, one line per value."""
    models = study.get("models") or {}
    planned = {model_dir(study_dir, n, spec, seed) for n, spec in models.items()
               for seed in _model_seeds(spec, sorted({c.run.seed for c in configs}))}
    bad: dict[tuple[str, str], list[str]] = {}
    for c in configs:
        values = flat(c)
        for need in METHODS[c.method.name].frozen_models:
            value = values.get(need.key)
            if value and Path(str(value)) not in planned and not Path(str(value)).exists():
                bad.setdefault((need.key, str(value)), []).append(c.run.name)
    names = ", ".join(repr(n) for n in models) or "none"
    return [f"{listing(runs, show=str)}: {key}={value!r} names "
            f"neither a model of the study's models section ({names}) nor an existing path; fix: name one of "
            "them, or give the path of a trained run" for (key, value), runs in bad.items()]


def used_models(cfg, study: dict, study_dir: Path) -> dict[str, Path]:
    """{frozen-model key: model directory} of the shared models a planned run's method uses (a study-wide
    ``method.kd.teacher`` is set in CLM's config too, but CLM does not use it)."""
    models = study.get("models") or {}
    values = flat(cfg)
    dirs = {model_dir(study_dir, n, s, seed): n for n, s in models.items()
            for seed in _model_seeds(s, [cfg.run.seed])}
    keys = [n.key for n in METHODS[cfg.method.name].frozen_models]
    return {k: Path(values[k]) for k in keys if k in values and Path(values[k]) in dirs}


def missing_problems(run_configs: list, study: dict, study_dir: Path) -> list[str]:
    """Runs already started with a shared model that is gone or unfinished now, or no longer the one pinned."""
    gone: dict[Path, list[str]] = {}
    for c in run_configs:
        if not (Path(c.run.out_dir) / c.run.name / "metrics.jsonl").is_file():
            continue
        for d in used_models(c, study, study_dir).values():
            if not (d / "result.json").is_file():
                gone.setdefault(d, []).append(c.run.name)
    return [f"shared model {d} is gone (or unfinished) but {listing(runs, show=str)} already trained with it; "
            "restore it, or delete those runs to train the model and them again" for d, runs in gone.items()] \
        + pinned_problems(study_dir, run_configs)


def pinned_problems(study_dir: Path, run_configs: list) -> list[str]:
    """A finished shared model whose checkpoint is no longer the one ``models.json`` pins (file and sha256) while
    runs that used it have started: a later seed would load another checkpoint (e.g. an earlier snapshot)."""
    record = read_marker(Path(study_dir) / MODELS_DIR / "models.json", MODELS_FORMAT) or {}
    started = {c.run.name for c in run_configs if (Path(c.run.out_dir) / c.run.name / "metrics.jsonl").is_file()}
    out = []
    for name, entry in record.items():
        if not (isinstance(entry, dict) and entry.get("sha256") and entry.get("checkpoint")):
            continue
        users = [r for r in entry.get("used_by") or [] if r in started]
        d = Path(study_dir) / MODELS_DIR / name
        if not users or not (d / "result.json").is_file():  # a gone model: missing_problems says so
            continue
        try:
            now: Path | None = resolve_checkpoint(d)
        except ESLMError:
            now = None
        if now is not None and str(now) == entry["checkpoint"] and sha256_file(now) == entry["sha256"]:
            continue
        out.append(f"shared model {d} is pinned to {Path(entry['checkpoint']).name} (step {entry.get('step')}, "
                   f"sha256 {str(entry['sha256'])[:12]}; models.json) but now resolves to "
                   f"{now.name if now is not None else 'no checkpoint'}: {listing(users, show=str)} trained with "
                   "the pinned one and a further run would use another; restore that checkpoint, or delete those "
                   "runs (and the model) to train them again")
    return out


MODELS_FORMAT = "eslm-models-v1"  # models.json's marker (``format``)


def check_record_owner(study_dir: Path) -> None:
    """Refuse (one line) a ``models.json`` that is a link or not eslm's: it is never overwritten."""
    path = Path(study_dir) / MODELS_DIR / "models.json"
    if path.is_symlink():
        raise OwnershipError(f"{str(path)!r} is a symbolic link; eslm writes models.json itself: remove the link")
    if path.exists() and read_marker(path, MODELS_FORMAT) is None:
        raise OwnershipError(f"{str(path)!r} was not written by eslm (no format {MODELS_FORMAT!r}); eslm study "
                             "records its shared models there: move the file away, or choose another --out")


def write_record(study: dict, study_dir: Path, model_configs: list, run_configs: list) -> Path | None:
    """``<study>/models/models.json``: per model its config, checkpoint, sha256, step and the runs that use it."""
    if not model_configs:
        return None

    check_record_owner(study_dir)
    record: dict = {"format": MODELS_FORMAT}
    for c in model_configs:
        d = Path(c.run.out_dir) / c.run.name
        entry = {"config": flat(c), "finished": (d / "result.json").is_file()}
        if entry["finished"]:
            ckpt = resolve_checkpoint(d)
            entry.update(checkpoint=str(ckpt), sha256=sha256_file(ckpt), step=step_of(ckpt))
        entry["used_by"] = [r.run.name for r in run_configs if d in used_models(r, study, study_dir).values()]
        record[str(d.name)] = entry
    path = Path(study_dir) / MODELS_DIR / "models.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, (json.dumps(record, indent=2, default=str) + "\n").encode())
    return path
