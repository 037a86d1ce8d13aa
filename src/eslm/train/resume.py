"""Opening a run directory: a new run, or a resume that is the same run (or it is refused).

A run directory's ``config.yaml`` is written once, when the run is created. ``--resume`` compares the requested
config with the run's (``config.yaml`` plus the changes recorded in ``resumes.jsonl``):

- keys in ``RESUME_MAY_CHANGE`` (how long to train, how often to log / evaluate / save, where and with how
  many threads to run) are applied and recorded;
- any other difference is refused with the list of differences, before anything is written, unless the user
  names the key in ``run.allow_change`` (e.g. a lower ``train.lr`` after a divergence): then it is applied and
  recorded too, so the run directory never claims a setting the run did not have.

``resumes.jsonl`` holds one JSON object per resume: ``time`` (UTC, ISO 8601), ``step`` (the checkpoint's
step, filled in by the trainer), ``changed`` ({key: [old, new]}). ``effective_config`` replays it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from eslm.config import RENAMED, Config, all_keys, from_dict, to_yaml, upgrade_stored
from eslm.errors import ConfigError

RESUMES_FILE = "resumes.jsonl"

# Keys that do not change what is trained: they may differ on resume (applied and recorded).
RESUME_MAY_CHANGE = (
    "train.max_steps", "train.max_flops", "eval.interval", "log.interval", "log.tensorboard",
    "checkpoint.interval", "checkpoint.keep_last", "checkpoint.milestones",
    "train.device", "train.num_threads", "train.compile", "train.loss_chunk_size", "train.loss_cache_probs",
    "train.loss_route",
    "distributed.backend", "distributed.fsdp",
)
# Per-invocation switches, and where the run directory is (it may have been moved): never compared or recorded.
INVOCATION_KEYS = ("run.resume", "run.resume_from", "run.allow_change", "run.out_dir", "run.name")


def flat(cfg: Config) -> dict:
    """{dotted key: value} over every leaf (tuples as lists, as in config.yaml)."""
    d = cfg.to_dict()
    out = {}
    for key in all_keys():
        node = d
        for part in key.split("."):
            node = node[part]
        out[key] = node
    return out


def read_resumes(run_dir: Path) -> list[dict]:
    """The resume records, oldest first (a torn last line, from a kill mid-write, is skipped)."""
    path = Path(run_dir) / RESUMES_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def effective_config(run_dir: Path) -> Config:
    """The config the run holds now: config.yaml with every recorded resume change applied in order."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    try:
        stored = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML ({str(e).splitlines()[0]}); it is the run's own config: "
                          "restore it from a checkpoint's 'config' entry or start a new run.name") from None
    try:
        return from_dict(apply_resumes(stored, run_dir))
    except ConfigError as e:
        raise ConfigError(f"{path} (the run's own config) does not fit this version of eslm: {e}; "
                          "resume with the eslm version that created the run, or start a new run.name") from None


def apply_resumes(config: dict, run_dir: Path) -> dict:
    """A config.yaml mapping with the recorded resume changes applied (plain dicts; for readers like reports).

    A run written before the method settings were nested stores their old flat keys (in config.yaml and in
    resumes.jsonl): they are read as the new keys (``eslm.config.RENAMED``), so such a run still resumes and
    still groups with new runs of the same settings."""
    out = upgrade_stored(config)
    for rec in read_resumes(run_dir):
        for key, change in (rec.get("changed") or {}).items():
            key = RENAMED.get(key, key)
            node = out
            *parents, leaf = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = change[1]
    return out


def allowed_changes(cfg: Config) -> set[str]:
    extra = {k.strip() for k in cfg.run.allow_change.split(",") if k.strip()}
    unknown = sorted(extra - set(all_keys()))
    renamed = [f"{k} was renamed: did you mean {RENAMED[k]}?" for k in unknown if k in RENAMED]
    if renamed:
        raise ConfigError("run.allow_change: " + "; ".join(renamed))
    if unknown:
        raise ConfigError(f"run.allow_change: unknown config key(s) {', '.join(unknown)}; "
                          "expected dotted keys such as train.lr")
    return set(RESUME_MAY_CHANGE) | extra


def check_resume(run_dir: Path, requested: Config) -> dict:
    """The changes {key: [old, new]} a resume of ``run_dir`` with ``requested`` applies; refuses others.

    Reads only. Raises ConfigError when the run does not exist or a key outside the allowed set differs."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        what = "no run directory" if not run_dir.exists() else "no config.yaml (no run was created there)"
        raise ConfigError(f"cannot resume {str(run_dir)!r}: {what}; check run.out_dir / run.name (or the "
                          "path given to --resume), or drop --resume to start a new run")
    old, new = flat(effective_config(run_dir)), flat(requested)
    changed = {k: [old[k], new[k]] for k in new if k not in INVOCATION_KEYS and old[k] != new[k]}
    refused = sorted(set(changed) - allowed_changes(requested))
    if refused:
        diff = ", ".join(f"{k}: {changed[k][0]!r} -> {changed[k][1]!r}" for k in refused)
        raise ConfigError(
            f"resume of {str(run_dir)!r} refused: the config differs from the run's own in {diff}; "
            f"`eslm train --resume {run_dir}` continues with the run's config, run.allow_change="
            f"{','.join(refused)} applies the change from the resume step on (recorded in {RESUMES_FILE}), "
            "or start a new run.name")
    return changed


def record_resume(run_dir: Path, changed: dict, step: int | None, **extra) -> None:
    """Append one record to resumes.jsonl (a torn previous line, from a kill mid-write, is cut first)."""
    from eslm.train.run_dir import cut_torn_tail

    path = Path(run_dir) / RESUMES_FILE
    if path.is_file():
        cut_torn_tail(path)
    rec = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "step": step, "changed": changed, **extra}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def resume_base(run_dir: str) -> tuple[Config, list[str]]:
    """For ``eslm train --resume RUN_DIR``: the run's own config and the overrides that point at RUN_DIR."""
    p = Path(run_dir)
    if not (p / "config.yaml").is_file():
        raise ConfigError(f"--resume {run_dir}: expected a run directory holding config.yaml, found "
                          f"{'nothing' if not p.exists() else 'no config.yaml'} there; check the path")
    cfg = effective_config(p)
    return cfg, [f"run.out_dir={p.parent}", f"run.name={p.name}"]





def lock_run_dir(run_dir: Path, resume: bool, log):
    """Create the run directory, take its lock (LockHeld if another process runs there) and remove the temporary
    checkpoint files an interrupted save left. Returns the held ``DirLock``."""
    from eslm.lock import DirLock
    from eslm.train.checkpoint import remove_stale_temporaries

    run_dir.mkdir(parents=True, exist_ok=True)
    lock = DirLock(run_dir, "run directory", warn=log).acquire()
    try:
        metrics = run_dir / "metrics.jsonl"
        if not resume and metrics.is_file() and metrics.stat().st_size > 0:  # another run finished meanwhile
            raise ConfigError(f"run directory {str(run_dir)!r} already holds a run; pass run.resume=true "
                              "(--resume) to continue it, or choose another run.name")
        stale = remove_stale_temporaries(run_dir / "checkpoints")
        if stale:
            log(f"removed {len(stale)} temporary checkpoint file(s) of an interrupted save: "
                + ", ".join(p.name for p in stale))
    except BaseException:
        lock.release()
        raise
    return lock


def open_run_dir(run_dir: Path, cfg: Config, *, device, world_size: int, num_params: int, log):
    """Rank 0, before the first step: (the held lock, the resume's changes or None, the metrics writer).

    A resume is compared with the run (reading only) before anything is written; a new run writes config.yaml
    and env.json once, describing its start."""
    from eslm.tracking import open_trackers
    from eslm.train.run_dir import MetricsWriter, env_info, read_env
    from eslm.train.timing import load_avg

    has_metrics = (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size > 0
    changes = check_resume(run_dir, cfg) if cfg.run.resume else None
    if has_metrics and not cfg.run.resume:
        raise ConfigError(f"run directory {str(run_dir)!r} already holds a run; pass run.resume=true "
                          "(--resume) to continue it, or choose another run.name")
    lock = lock_run_dir(run_dir, cfg.run.resume, log)
    if not cfg.run.resume:
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        env = env_info(device, world_size, cfg.run.seed)
        env["model_params_non_embedding"] = num_params
        env["load_avg_at_start"] = load_avg()
        (run_dir / "env.json").write_text(json.dumps(env, indent=2) + "\n")
    writer = MetricsWriter(run_dir, cfg.log.tensorboard)
    writer.sinks += open_trackers(cfg, run_dir, read_env(run_dir))
    return lock, changes, writer


def record_resumed_at(run_dir: Path, cfg: Config, changes: dict | None, step: int, log) -> None:
    """Rank 0, once the checkpoint is loaded: checkpoints after a --resume-from step are moved aside
    (superseded), the applied changes are logged, and resumes.jsonl gains its record."""
    from eslm.train import checkpoint as ckpt

    extra = {}
    if cfg.run.resume_from:
        extra["resume_from"] = step
        extra["superseded"] = ckpt.supersede_after(run_dir, step)
        if extra["superseded"]:
            log(f"later checkpoints moved to {run_dir / 'checkpoints' / 'superseded'}: "
                f"{', '.join(extra['superseded'])}")
    for key, (old, new) in (changes or {}).items():
        log(f"resume changes {key}: {old!r} -> {new!r} (recorded in resumes.jsonl)")
    record_resume(run_dir, changes or {}, step, **extra)
