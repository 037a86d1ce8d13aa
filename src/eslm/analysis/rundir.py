"""Reading run directories for reports (config.yaml, env.json, result.json, metrics.jsonl, eval/*.json; a missing
optional piece is empty, a malformed metrics line skipped with a warning) and grouping runs into seed groups:
runs whose resolved configs are equal except for ``IGNORED_FOR_GROUPING`` are one experiment's seeds.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from eslm import metrics as M
from eslm.config import flat
from eslm.errors import ESLMError
from eslm.files import read_yaml
from eslm.train.resume import RESUME_MAY_CHANGE, apply_resumes
from eslm.train.run_dir import last_records

# Config keys that do not change the experiment, so runs differing only in these are seeds of one group: the
# run's identity and invocation, and the machine-only and bookkeeping settings a resume may change
# (``RESUME_MAY_CHANGE``: threads, device, compile, loss chunking, backend, FSDP, log / eval / checkpoint
# intervals) except how long it trains. A study continued with another --jobs gives its new runs
# train.num_threads = cores // jobs (and its resumed runs record that change): they stay in their groups.
RUN_KEYS = ("run.name", "run.seed", "run.out_dir", "run.resume", "run.resume_from", "run.allow_change")
MACHINE_KEYS = tuple(k for k in RESUME_MAY_CHANGE if k not in ("train.max_steps", "train.max_flops"))
IGNORED_FOR_GROUPING = RUN_KEYS + MACHINE_KEYS


def grouping_view(config: dict) -> dict:
    """A config, flattened, as grouping compares it: ``train.branch_from`` (each seed continues its own trunk's
    checkpoint, eslm.train.branch) reduced to the branch point the seeds share: the trunk's name without its
    ``-s<seed>`` and the checkpoint's step, e.g. ``trunk-clm/step_0000100.pt``."""
    view = flat(config)
    if not (b := view.get("train.branch_from")):
        return view
    p = Path(str(b))
    return {**view, "train.branch_from": f"{re.sub(r'-s-?[0-9]+$', '', p.parent.parent.name)}/{p.name}"}


class RunDirError(ESLMError):
    """A path that is not a readable run directory."""


@dataclass
class Run:
    """One run directory's contents. ``train`` / ``eval`` are metric records in step order."""

    path: Path
    name: str
    config: dict
    env: dict
    train: list[dict]
    eval: list[dict]
    downstream: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    finished: bool = True  # the trainer wrote result.json (False: still running, interrupted or crashed)

    @property
    def seed(self):
        return config_get(self.config, "run.seed", self.env.get("seed"))

    @property
    def method(self) -> str:
        return str(config_get(self.config, "method.name", "unknown"))


@dataclass
class Group:
    """Runs that differ only by seed. ``label`` is unique among the groups of one report."""

    key: str
    label: str
    method: str
    settings: dict
    runs: list[Run]

    @property
    def point(self) -> str | None:
        """The name of its runs without their ``-s<seed>`` suffix when they all share it (a study's grid point,
        e.g. ``eslm-entropy-alpha0.3``), else None."""
        names = {r.name.removesuffix(f"-s{r.seed}") for r in self.runs}
        return names.pop() if len(names) == 1 else None


# ---------------------------------------------------------------- small helpers


def config_get(cfg: dict, dotted: str, default=None):
    """``cfg["a"]["b"]`` for ``dotted="a.b"``; ``default`` when any level is missing."""
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def is_number(v) -> bool:
    """A finite int/float that is not a bool (None, NaN and strings are not numbers)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ---------------------------------------------------------------- reading files


def _read_json(path: Path, warnings: list[str]) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        warnings.append(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at position {e.start}); ignored")
        return {}
    except (OSError, json.JSONDecodeError) as e:
        warnings.append(f"{path}: unreadable JSON ({e}); ignored")
        return {}
    if not isinstance(data, dict):
        warnings.append(f"{path}: expected a JSON object, found {type(data).__name__}; ignored")
        return {}
    return data


def read_metrics(path: Path, warnings: list[str]) -> tuple[list[dict], list[dict]]:
    """(train, eval) records of a metrics.jsonl, each keeping the LAST line of every (kind, step)
    (``eslm.train.run_dir.last_records``); skipped lines are counted in ``warnings``."""
    recs, bad = last_records(path)
    if bad:
        warnings.append(f"{path}: skipped {bad} malformed line(s)")
    return ([r for r in recs if r[M.KIND] == M.KIND_TRAIN], [r for r in recs if r[M.KIND] == M.KIND_EVAL])


def load_run(path: str | Path) -> Run:
    """Read one run directory; raises RunDirError when ``path`` is not one."""
    p = Path(path)
    if not p.exists():
        raise RunDirError(f"expected a run directory, found nothing at {p}; check the path")
    if not (p / "metrics.jsonl").is_file():
        raise RunDirError(f"expected a run directory with metrics.jsonl at {p}, found none; "
                          "pass runs/<name> directories written by 'eslm train'")
    warnings: list[str] = []
    config = read_yaml(p / "config.yaml", "run file", error=RunDirError, fix="fix or regenerate the file") \
        if (p / "config.yaml").is_file() else {}
    config = apply_resumes(config, p)  # config.yaml is the run's start; resumes.jsonl its recorded changes
    if not config:
        warnings.append(f"{p}: no config.yaml; the run is grouped on its own")
    env = _read_json(p / "env.json", warnings) if (p / "env.json").is_file() else {}
    train, evals = read_metrics(p / "metrics.jsonl", warnings)
    name = str(config_get(config, "run.name") or p.name)
    finished = (p / "result.json").is_file()
    if not finished:
        warnings.append(f"{p}: no result.json, the run is still running or was interrupted; its last eval "
                        "point is not its final one (resume it, or read its numbers as partial)")
    downstream = [d for f in sorted((p / "eval").glob("*.json"))  # eslm eval's results with per-task results
                  if isinstance((d := _read_json(f, warnings)).get("tasks"), dict) and d["tasks"]]
    return Run(path=p, name=name, config=config, env=env, train=train, eval=evals, warnings=warnings, finished=finished,
               downstream=sorted(downstream, key=lambda d: d["step"] if is_number(d.get("step")) else -1))


# ---------------------------------------------------------------- seed groups


def experiment_key(config: dict) -> str:
    """Canonical JSON of a resolved config without ``IGNORED_FOR_GROUPING``: equal keys, one experiment."""
    view = {k: v for k, v in grouping_view(config).items() if k not in IGNORED_FOR_GROUPING}
    return json.dumps(view, sort_keys=True, default=str)


def group_key(run: Run) -> str:
    """``experiment_key`` of the run's config; runs without config key on their path."""
    if not run.config:
        return json.dumps({"__path__": str(run.path.resolve())})
    return experiment_key(run.config)


MAX_TEXT = 200  # characters of one name or value from the runs shown in a report (longer: cut, its length said)
MAX_MESSAGE = 2000  # characters of one message (a warning, a verdict) that names such texts


def shorten(text, limit: int = MAX_TEXT) -> str:
    """``text`` as a string of at most about ``limit`` characters: a longer one keeps its start and says how
    long it was (a 200,000-character config value would otherwise fill the page and every figure's legend)."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def group_runs(runs: list[Run]) -> list[Group]:
    """Group runs by ``group_key``, in order of first appearance; labels name the method and the settings
    that differ from other groups of the same method (e.g. ``eslm-entropy (method.alpha=0.2)``), shortened
    (``shorten``; two labels equal after it get #2, #3 ...)."""
    buckets: dict[str, list[Run]] = {}
    for r in runs:
        buckets.setdefault(group_key(r), []).append(r)
    groups = []
    for key, members in buckets.items():
        groups.append(Group(key=key, label="", method=members[0].method, settings={}, runs=members))
    for method in {g.method for g in groups}:
        same = [g for g in groups if g.method == method]
        flats = [grouping_view(g.runs[0].config) for g in same]
        varying = [k for k in sorted(set().union(*flats)) if k not in IGNORED_FOR_GROUPING and k != "method.name"
                   and len({json.dumps(c.get(k), sort_keys=True, default=str) for c in flats}) > 1]
        for g, view in zip(same, flats):
            g.settings = {k: view.get(k) for k in varying}
            extra = ", ".join(f"{k}={v}" for k, v in g.settings.items())
            g.label = shorten(f"{method} ({extra})" if extra else method)
    seen: dict[str, int] = {}
    for g in groups:  # labels still equal (e.g. runs without a config): #2, #3 ...
        n = seen[g.label] = seen.get(g.label, 0) + 1
        if n > 1:
            g.label = f"{g.label} #{n}"
    return groups


def planned_groups(configs: list[dict]) -> list[Group]:
    """The groups that runs with these resolved configs (``Config.to_dict()``) will form in a report."""
    runs = [Run(path=Path(str(config_get(c, "run.out_dir", "."))) / str(config_get(c, "run.name", "")),
                name=str(config_get(c, "run.name", "")), config=c, env={}, train=[], eval=[]) for c in configs]
    return group_runs(runs)


def find_group(groups: list[Group], name: str, option: str) -> tuple[Group | None, str | None]:
    """The group ``name`` names: a group label, else the grid point of a study (its runs' names without the
    seed suffix), else a method with exactly one group; (None, one line saying why, starting with ``option``,
    the place the name was given) otherwise."""
    for match in ([g for g in groups if g.label == name], [g for g in groups if g.point == name]):
        if len(match) == 1:
            return match[0], None
    by_method = [g for g in groups if g.method == name]
    if len(by_method) == 1:
        return by_method[0], None
    names = lambda gs: ", ".join(repr(g.point or g.label) for g in gs)  # noqa: E731
    if by_method:
        return None, f"{option}: {name!r} is the method of {len(by_method)} groups; name one of {names(by_method)}"
    return None, f"{option}: no group {name!r} among the runs; expected one of {names(groups)}"


# ---------------------------------------------------------------- what one report may hold

# What makes two runs' validation losses and FLOPs per token comparable: the validation data (the data set, its
# windows, the evaluation budget), the tokenizer (a loss in nats per token of another vocabulary is another
# quantity) and the model (FLOPs per token). One report puts every group on one target loss and compares
# FLOPs per token with the baseline, so it holds runs of one such set only.
# ``data`` stands for data.dir, or data.source when no prepared directory replaces it.
COMPARABLE_KEYS = ("data", "data.tokenizer", "data.seq_len", "model.preset", "model.vocab_size", "model.block_size",
                   "eval.tokens_per_domain")


def comparable_sets_problem(groups: list[Group]) -> str | None:
    """None when every group (with a config) trained on one data set, tokenizer and model; else one line naming
    the keys that differ and the groups of each set."""
    sets: dict[str, tuple[dict, list[str]]] = {}
    for g in groups:
        if not g.runs[0].config:
            continue
        c = g.runs[0].config
        key = {"data": config_get(c, "data.dir") or config_get(c, "data.source"),
               **{k: config_get(c, k) for k in COMPARABLE_KEYS[1:]}}
        sets.setdefault(json.dumps(key, sort_keys=True, default=str), (key, []))[1].append(g.point or g.label)
    if len(sets) < 2:
        return None
    keys = [k for k in COMPARABLE_KEYS if len({json.dumps(s[0].get(k), default=str) for s in sets.values()}) > 1]
    parts = [", ".join(f"{k}={key.get(k)}" for k in keys) + f" ({', '.join(labels)})" for key, labels in sets.values()]
    return (f"expected runs of one data set, tokenizer and model (they are put on one target loss and compared "
            f"in FLOPs per token), found {len(sets)} sets that differ in {', '.join(keys)}: " + " | ".join(parts)
            + "; report each set separately")


def one_run_per_seed(groups: list[Group]) -> list[tuple[Run, Run]]:
    """Keep one run per (group, seed): a later run repeating a seed of its group (a copied run directory, two
    studies of the same settings) is removed from the group, so no seed counts twice. Returns the
    [(removed run, the run kept for its seed)]."""
    removed = []
    for g in groups:
        kept: dict[str, Run] = {}
        for r in list(g.runs):
            if (first := kept.setdefault(json.dumps(r.seed, default=str), r)) is not r:
                g.runs.remove(r)
                removed.append((r, first))
    return removed


def distinct_names(runs: list[Run]) -> None:
    """Runs are known by their directory: where two directories share a run name (two studies, a copied run),
    each is shown as ``<parent folder>/<name>`` (its full path if that is still ambiguous)."""
    for _ in range(2):
        names = [r.name for r in runs]
        twice = {n for n in names if names.count(n) > 1}
        if not twice:
            return
        for r in runs:
            if r.name in twice:
                r.name = f"{r.path.parent.name}/{r.path.name}" if "/" not in r.name else str(r.path)
