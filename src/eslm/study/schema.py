"""The study file: where ``eslm study NAME`` finds it, and the check of its structure (``study_problems``),
every problem at once, one line each, before anything is planned or run. The file's keys are described in
``eslm.study`` (the package's docstring) and docs/study.md."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from eslm.config import MAX_SEED, build_config, flat, is_int, method_problem
from eslm.errors import ConfigError
from eslm.files import MAX_YAML_BYTES, name_problem, read_yaml, yaml_list_lengths
from eslm.study.launch import launcher_problems

# Study files ship inside the package: src/eslm/configs is a link to the repository's configs/, so a
# checkout, an editable install and a wheel all find them beside this package (the wheel holds a copy).
# ./configs/studies is searched next, for a user's own studies kept in the working directory.
STUDIES_DIR = Path(__file__).resolve().parents[1] / "configs" / "studies"

_ENTRY_KEYS = ("name", "label")


def study_dirs() -> list[Path]:
    """Where ``eslm study NAME`` looks for NAME.yaml, in order (duplicates removed)."""
    here = Path.cwd() / "configs" / "studies"
    return [STUDIES_DIR] + ([here] if here.resolve() != STUDIES_DIR.resolve() else [])


_SMALL_STUDY_BYTES = 64 << 10  # a study at the limits (MAX_SEEDS seeds, MAX_RUNS runs) is far smaller


def _read_study_yaml(path: Path) -> dict:
    try:
        if path.stat().st_size > _SMALL_STUDY_BYTES:  # counted before any value is built (libyaml's events)
            with open(path, "rb") as f:
                raw = f.read(MAX_YAML_BYTES + 1)
            text = raw.decode("utf-8-sig", errors="replace")  # (read_yaml names a byte that is not UTF-8)
            n = yaml_list_lengths(text).get("seeds", 0) if len(raw) <= MAX_YAML_BYTES else 0
            # the count is all seeds_problems checks first: a list of that length stands for the seeds
            refuse(f"study {str(path)!r}", seeds_problems([0] * n, "seeds") if n > MAX_SEEDS else [])
        return read_yaml(path, "study", fix="fix the file (a mapping with methods, seeds and config)")
    except OSError as e:
        raise ConfigError(f"study {str(path)!r} could not be read ({e.strerror}); check the path") from None


def load_study(name: str) -> dict:
    """The study file ``name`` (a path, or NAME.yaml in ``study_dirs()``), every problem refused at once."""
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
    refuse(f"study {str(path)!r}", problems)
    study["name"] = path.stem
    return study


def refuse(where: str, problems: list[str]) -> None:
    """Raise one ConfigError listing every problem, one per line."""
    if problems:
        lines = "".join(f"\n  - {p}" for p in problems)
        raise ConfigError(f"{where}: {len(problems)} problem(s), nothing was run:{lines}")


# ---------------------------------------------------------------- checking a study file

STUDY_KEYS = ("description", "methods", "seeds", "sweep", "config", "budget", "report", "jobs", "models",
              "launcher", "branch")
AXIS_KEYS = ("values", "methods")
BUDGET_KEYS = ("steps_of", "counter")
REPORT_KEYS = ("baseline", "target", "primary", "equivalence_margin", "controls")
MODEL_KEYS = ("method", "seed", "per_seed")  # of a ``models`` entry, besides its config keys
BRANCH_KEYS = ("from", "at_tokens")


def _name_list(v) -> str:
    return ", ".join(repr(x) for x in v)


def _unknown_keys(where: str, d: dict, keys: tuple) -> list[str]:
    extra = [k for k in d if k not in keys]
    return [f"{where}: unknown key(s) {_name_list(extra)}; expected {_name_list(keys)}"] if extra else []


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
            if (why := method_problem(item["name"])) is not None:
                problems.append(f"{where}: {why}")
                continue
            if "label" in item and (why := name_problem(item["label"], f"{where}: label")) is not None:
                problems.append(why)
                continue
        elif isinstance(item, str):
            if (why := method_problem(item)) is not None:
                problems.append(f"{where}: {why}")
                continue
        else:
            problems.append(f"{where}: expected a method name or a mapping with 'name', found {item!r}")
            continue
        method, label, _ = method_entry(item)
        names.append(method)
        labels.append(label)
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        problems.append(f"methods: the entry {twice[0]!r} is listed {labels.count(twice[0])} times; list it once, "
                        "or give each variant its own 'label'")
    return problems, names, labels


MAX_SEEDS = 1000  # seeds of one study
MAX_RUNS = 10_000  # runs of one study's grid (methods x sweep points x seeds), refused before it is expanded


def seeds_problems(seeds, where: str) -> list[str]:
    if is_int(seeds):
        return [f"{where}: expected a list of integer seeds, found {seeds!r}; write seeds: [{seeds}]"]
    if not isinstance(seeds, list) or not seeds:
        return [f"{where}: expected a non-empty list of integer seeds, found {seeds!r}"]
    if len(seeds) > MAX_SEEDS:  # first: every check below is linear, but a million runs is no study
        return [f"{where}: expected at most {MAX_SEEDS} seeds, found {len(seeds)}; list fewer seeds (each seed "
                "trains every grid point once)"]
    bad = [s for s in seeds if not is_int(s)]
    if bad:
        return [f"{where}: expected integer seeds, found {_name_list(bad)}"]

    out = [s for s in seeds if not 0 <= s < MAX_SEED - 1024]  # run.seed's range (eslm.config.validate)
    if out:
        return [f"{where}: expected seeds in [0, {MAX_SEED - 1024}) (run.seed's range), found {_name_list(out)}"]
    counts = Counter(seeds)
    twice = sorted(s for s, n in counts.items() if n > 1)
    if twice:
        return [f"{where}: seed {twice[0]} is listed {counts[twice[0]]} times; list each seed once "
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
            problems += _unknown_keys(where, spec, AXIS_KEYS)
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
    if budget is None:
        return []
    if not isinstance(budget, dict):
        return [f"budget: expected a mapping {{steps_of: METHOD, counter: COUNTER}}, found {budget!r}"]
    problems = _unknown_keys("budget", budget, BUDGET_KEYS)
    steps_of = budget.get("steps_of")
    if "steps_of" in budget and (not isinstance(steps_of, str) or steps_of not in names + labels):
        known = _name_list(dict.fromkeys(names + labels))
        problems.append(f"budget.steps_of: expected one of the study's methods ({known}), found {steps_of!r}")
    if "counter" in budget:
        try:  # the config's own check of flops.budget_counter (its choices live there)
            build_config(overrides=[f"flops.budget_counter={budget['counter']}"])
        except ConfigError as e:
            problems += [p.replace("flops.budget_counter", "budget.counter") for p in e.problems]
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
    bad = [f"report.{key}: expected {what}, found {report[key]!r}"
           for key, (ok, what) in _REPORT_VALUES.items() if key in report and not ok(report[key])]
    if _positive(report.get("equivalence_margin")) and "primary" not in report:
        bad.append("report.equivalence_margin: applies to the primary comparison; add report.primary")
    return _unknown_keys("report", report, REPORT_KEYS) + bad


def _positive(v) -> bool:
    return (is_int(v) or isinstance(v, float)) and 0 < v < float("inf")


_REPORT_VALUES = {  # key: (accepts the value, what it expects)
    "controls": (lambda v: isinstance(v, bool), "true or false (false: the report goes without the controls the "
                 "registry names, random at the same alpha)"),
    "baseline": (lambda v: isinstance(v, str) and bool(v), "a group or method name"),
    "target": (lambda v: v == "baseline" or _positive(v), "a positive validation loss or 'baseline'"),
    "equivalence_margin": (_positive, "a positive number of nats"),
    "primary": (lambda v: isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) and x for x in v)
                and v[0] != v[1], "two different group names [GROUP, GROUP]"),
}


def models_problems(models) -> list[str]:
    """The ``models`` section's structure (config keys and values are checked when the models are planned,
    ``eslm.study.shared.plan_models``)."""
    if models is None:
        return []
    if not isinstance(models, dict) or not models:
        return [f"models: expected a mapping {{NAME: {{method: METHOD, section.key: value, ...}}}}, found {models!r}"]
    out = []
    for name, spec in models.items():
        where = f"models {name!r}"
        if (why := name_problem(name, f"{where}: the model's name (its directory under models/)")) is not None:
            out.append(why)
            continue
        if not isinstance(spec, dict):
            out.append(f"{where}: expected a mapping {{method: METHOD, section.key: value, ...}}, found {spec!r}")
            continue
        if "method" in spec and (why := method_problem(spec["method"])) is not None:
            out.append(f"{where}: method: {why}")
        if "seed" in spec and not is_int(spec["seed"]):
            out.append(f"{where}: seed: expected an integer, found {spec['seed']!r}")
        if "per_seed" in spec and not isinstance(spec["per_seed"], bool):
            out.append(f"{where}: per_seed: expected true or false, found {spec['per_seed']!r}")
        if "per_seed" in spec and spec.get("per_seed") and "seed" in spec:
            out.append(f"{where}: seed and per_seed: true exclude each other (per_seed trains one model per seed "
                       "of the study, with that seed); remove one")
        if "run" in spec or any(str(k).startswith("run.") for k in spec):
            out.append(f"{where}: run.* keys are the study's (the model's directory and seed); use seed or "
                       "per_seed")
    return out


def _branch_problems(branch) -> list[str]:
    """The branch section's form (the branch point against the runs' schedule is checked by ``plan``)."""
    if branch is None:
        return []
    if not isinstance(branch, dict):
        return [f"branch: expected a mapping {{from: METHOD, at_tokens: N}}, found {branch!r}"]
    problems = _unknown_keys("branch", branch, BRANCH_KEYS)
    if missing := [k for k in BRANCH_KEYS if k not in branch]:
        problems.append(f"branch: missing {_name_list(missing)}; write branch: {{from: clm, at_tokens: 40000}}")
    if "from" in branch and (why := method_problem(branch["from"])) is not None:
        problems.append(f"branch.from: {why}")
    if "at_tokens" in branch and not (is_int(branch["at_tokens"]) and branch["at_tokens"] > 0):
        problems.append(f"branch.at_tokens: expected a positive number of training tokens, found "
                        f"{branch['at_tokens']!r}")
    return problems


def study_problems(study: dict) -> list[str]:
    """Every problem of a study file's structure (one phrase each; empty when it is well-formed). Config keys and
    values, and the report's group names, are checked when the runs are planned (``plan``)."""
    problems = []
    unknown = [k for k in study if k not in STUDY_KEYS]
    if unknown:
        problems.append(f"unknown key(s) {_name_list(unknown)}; expected some of {_name_list(STUDY_KEYS)}")
    missing = [k for k in ("methods", "seeds", "config") if k not in study]
    if missing:
        problems.append(f"missing key(s) {_name_list(missing)}; a study needs methods, seeds and config")
    names: list[str] = []
    labels: list[str] = []
    if "methods" in study:
        found, names, labels = _entries_problems(study["methods"])
        problems += found
    if "seeds" in study:
        problems += seeds_problems(study["seeds"], "seeds")
    if "config" in study and study["config"] is not None and not isinstance(study["config"], dict):
        problems.append(f"config: expected a mapping of config sections (e.g. {{train: {{max_steps: 90}}}}), "
                        f"found {study['config']!r}")
    problems += _sweep_problems(study.get("sweep"), labels)
    trunk = [study["branch"]["from"]] if isinstance(study.get("branch"), dict) and "from" in study["branch"] else []
    problems += _budget_problems(study.get("budget"), names + trunk, labels)  # the trunk's method may set it
    problems += _report_problems(study.get("report"))
    problems += _branch_problems(study.get("branch"))
    if "jobs" in study and not (is_int(study["jobs"]) and study["jobs"] >= 1):
        problems.append(f"jobs: expected an integer >= 1, found {study['jobs']!r}")
    problems += models_problems(study.get("models"))
    if "launcher" in study:  # a section that names no launcher: checked by the one --launcher picks (make_launcher)
        problems += launcher_problems(study["launcher"])
    if "description" in study and not isinstance(study["description"], str):
        problems.append(f"description: expected a text, found {study['description']!r}")
    return problems


def flatten(d: dict) -> list[str]:
    """A nested mapping as ``key=value`` overrides."""
    return [f"{k}={list(v) if isinstance(v, (list, tuple)) else v}" for k, v in flat(d).items()]


def method_entry(item) -> tuple[str, str, list[str]]:
    """A ``methods`` entry (checked by ``study_problems``) -> (method name, label, overrides)."""
    if isinstance(item, str):
        return item, item, []
    over = flatten({k: v for k, v in item.items() if k not in _ENTRY_KEYS})
    label = item.get("label") or "-".join([item["name"]] + [slug(o) for o in over])
    return str(item["name"]), str(label), over


def slug(override: str) -> str:
    """'method.alpha=0.3' -> 'alpha0.3' (readable, path-safe)."""
    key, _, value = override.partition("=")
    text = key.rsplit(".", 1)[-1] + value
    return "".join(c if c.isalnum() or c in "._" else "_" for c in text)


