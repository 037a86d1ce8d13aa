"""Opening a run directory: a new run, or a resume that is the same run (or it is refused before anything is
written; docs/training.md: ``RESUME_MAY_CHANGE``, ``run.allow_change``, ``resumes.jsonl``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from eslm.config import Config, all_keys, flat, from_dict, stored_config_problem, to_yaml, unknown_key_message
from eslm.errors import ConfigError, OwnershipError
from eslm.files import (
    atomic_write,
    foreign_entries,
    link_refused,
    listing,
    named,
    open_nofollow,
    read_yaml,
    stale_temporaries,
)
from eslm.lock import DirLock
from eslm.model.loading import SNAPSHOT_DIR, SNAPSHOT_FILE, step_of
from eslm.tracking import open_trackers
from eslm.train import checkpoint as ckpt
from eslm.train.checkpoint import kept_steps, remove_stale_temporaries
from eslm.train.run_dir import (
    LINK_FREE,
    RUN_MARKER,
    WHOLE_FILES,
    MetricsWriter,
    code_version,
    cut_torn_tail,
    env_info,
    json_lines,
    last_records,
    new_run_marker,
    read_env,
    run_marker,
)
from eslm.train.timing import load_avg

RESUMES_FILE = "resumes.jsonl"

# Keys that do not change what is trained: they may differ on resume (applied and recorded).
RESUME_MAY_CHANGE = (
    "train.max_steps", "train.max_flops", "eval.interval", "log.interval", "log.tensorboard",
    "checkpoint.interval", "checkpoint.keep_last", "checkpoint.milestones", "checkpoint.snapshot_keep",
    "train.device", "train.num_threads", "train.compile", "train.loss_chunk_size", "train.loss_cache_probs",
    "train.loss_route",
    "distributed.backend", "distributed.fsdp",
)
# Per-invocation switches, and where the run directory is (it may have been moved): never compared or recorded.
INVOCATION_KEYS = ("run.resume", "run.resume_from", "run.allow_change", "run.allow_version_change", "run.out_dir",
                   "run.name")


def read_resumes(run_dir: Path) -> list[dict]:
    """The resume records, oldest first (a torn last line, from a kill mid-write, is skipped)."""
    path = Path(run_dir) / RESUMES_FILE
    return json_lines(path)[0] if path.is_file() else []


def effective_config(run_dir: Path) -> Config:
    """The config the run holds now: config.yaml with every recorded resume change applied in order."""
    path = Path(run_dir) / "config.yaml"
    stored = read_yaml(path, "the run's own config", fix="restore it from a checkpoint's 'config' entry or start "
                       "a new run.name")
    # a resume rebuilds the whole config; from_dict cannot fail once stored_config_problem applied it
    return from_dict(apply_resumes(stored, run_dir, complete=True))


def apply_resumes(config: dict, run_dir: Path, complete: bool = False) -> dict:
    """A config.yaml mapping with the recorded resume changes applied (plain dicts; for readers like reports).

    A config written by an earlier eslm (``eslm.config.stored_config_problem``: e.g. the flat method keys of
    before their nesting; with ``complete``, a key it lacks) is refused with one line: eslm 0.x reads its own
    format only."""
    out = json.loads(json.dumps(config))  # a deep copy of plain YAML data
    for rec in read_resumes(run_dir):
        for key, change in (rec.get("changed") or {}).items():
            node = out
            *parents, leaf = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = change[1]
    if (out or complete) and (problem := stored_config_problem(out, complete=complete)):
        raise ConfigError(f"{Path(run_dir) / 'config.yaml'} was written by an earlier eslm: {problem}; this eslm "
                          "reads only run directories in its own format: train the run again with this version, "
                          "or read it with the eslm that wrote it")
    return out


def allowed_changes(cfg: Config) -> set[str]:
    extra = {k.strip() for k in cfg.run.allow_change.split(",") if k.strip()}
    unknown = sorted(extra - set(all_keys()))
    if unknown:
        raise ConfigError("run.allow_change: " + "; ".join(unknown_key_message(k) for k in unknown)
                          + " (expected dotted keys such as train.lr)")
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


def resume_base(run_dir: str) -> tuple[Config, list[str]]:
    """For ``eslm train --resume RUN_DIR``: the run's own config and the overrides that point at RUN_DIR."""
    p = Path(run_dir)
    if not (p / "config.yaml").is_file():
        raise ConfigError(f"--resume {run_dir}: expected a run directory holding config.yaml, found "
                          f"{'nothing' if not p.exists() else 'no config.yaml'} there; check the path")
    cfg = effective_config(p)
    return cfg, [f"run.out_dir={p.parent}", f"run.name={p.name}"]


def check_owner(run_dir: Path, resume: bool) -> str:
    """Whose directory ``run_dir`` is, before anything is written: "new" (absent or empty) or "ours" (eslm's
    marker). Anything else is refused in one line, and so is a symbolic link where eslm appends or keeps its
    subdirectories."""

    if not run_dir.is_dir():
        return "new"
    for name in LINK_FREE:
        if (run_dir / name).is_symlink():
            raise link_refused(run_dir / name)
    for name in ("checkpoints", "snapshots", "eval", "tb"):
        if (run_dir / name).exists() and not (run_dir / name).is_dir():
            raise OwnershipError(f"{str(run_dir / name)!r} is a file; eslm keeps a directory of that name in a "
                                 "run directory: move the file away, or choose another run.name")
    if run_marker(run_dir) is not None:
        return "ours"
    entries = foreign_entries(run_dir, lambda name: name == "eslm.lock")  # a lock left by a killed start
    if not entries:
        return "new"
    raise OwnershipError(
        f"run directory {str(run_dir)!r} holds files eslm did not write ({listing(entries)}) and no {RUN_MARKER}; "
        f"eslm {'resumes only runs it created' if resume else 'starts a run only in a new or empty directory'}: "
        "choose another run.name or run.out_dir")


def holds_run(run_dir: Path) -> bool:
    """A run has begun there: metrics were written or a checkpoint saved."""
    metrics = run_dir / "metrics.jsonl"
    return (metrics.is_file() and metrics.stat().st_size > 0) or bool(kept_steps(run_dir / "checkpoints"))


def _refuse_existing(run_dir: Path) -> None:
    raise ConfigError(f"run directory {str(run_dir)!r} already holds a run; pass run.resume=true "
                      "(--resume) to continue it, or choose another run.name")


def lock_run_dir(run_dir: Path, resume: bool, log):
    """Create the run directory, take its lock (LockHeld if another process runs there) and remove the temporary
    files killed or failed writes left (only names eslm writes). Returns the held ``DirLock``."""

    run_dir.mkdir(parents=True, exist_ok=True)
    lock = DirLock(run_dir, "run directory", warn=log).acquire()
    try:
        if not resume and holds_run(run_dir):  # another run began meanwhile
            _refuse_existing(run_dir)
        stale = remove_stale_temporaries(run_dir / "checkpoints")
        for directory, own in ((run_dir, lambda n: n in WHOLE_FILES),
                               (run_dir / SNAPSHOT_DIR, lambda n: bool(SNAPSHOT_FILE.match(n)))):
            for p in stale_temporaries(directory, own):
                p.unlink(missing_ok=True)
                stale.append(p)
        if stale:
            log(f"removed {len(stale)} temporary file(s) of interrupted writes: " + ", ".join(p.name for p in stale))
    except BaseException:
        lock.release()
        raise
    return lock


def version_change(run_dir: Path, last: dict | None = None) -> dict:
    """{key: [old, new]} of the eslm version, commit and uncommitted changes between the run's last segment and
    this process (empty when the same). A commit counts as changed only when both are known (an installed
    package has none); on one commit, uncommitted changes count as a change when either side has some and their
    ``git diff HEAD`` differs (``git_diff_sha256``; a segment of an earlier eslm without it: any now differ)."""
    last, now = last_segment(run_dir) if last is None else last, code_version()
    out = {k: [last.get(k), now[k]] for k in ("eslm_version", "git_commit")
           if last.get(k) is not None and now[k] is not None and last.get(k) != now[k]}
    same_commit = "git_commit" not in out and last.get("git_commit") is not None and now["git_commit"] is not None
    if same_commit and (last.get("git_dirty") or now.get("git_dirty")):
        old, new = (d.get("git_diff_sha256") if d.get("git_dirty") else "clean" for d in (last, now))
        if old is None or old != new:
            out["uncommitted_changes"] = [_diff_label(old), _diff_label(new)]
    return out


def _diff_label(v):
    return "none" if v == "clean" else "unknown" if v is None else f"diff {v[:12]}"


ENV_FILE = "env.json"


def check_provenance(run_dir: Path, cfg: Config) -> None:
    """Refuse (one line) a resume by another eslm version or commit, or with other uncommitted changes, than the
    run's last segment, and a resume of a run whose env.json (its start's provenance) is gone, unless
    ``run.allow_version_change``."""
    if not (Path(run_dir) / ENV_FILE).is_file() and not cfg.run.allow_version_change:
        raise ConfigError(f"resume of {str(run_dir)!r} refused: its {ENV_FILE} (which eslm and code started the "
                          f"run) is missing, so the code it ran cannot be compared; restore {ENV_FILE}, or pass "
                          f"run.allow_version_change=true to continue without that check (recorded in "
                          f"{RESUMES_FILE})")
    last = last_segment(run_dir)
    changed = version_change(run_dir, last)
    if changed and not cfg.run.allow_version_change:
        raise ConfigError(f"resume of {str(run_dir)!r} refused: eslm changed since the run's last segment "
                          f"(step {last.get('step', 0)}): {_changes(changed)}; resume with the eslm (and code) the "
                          f"run used, or pass run.allow_version_change=true to continue with this one (recorded in "
                          f"{RESUMES_FILE})")


def check_resume_point(run_dir: Path, cfg: Config) -> None:
    """Before anything is written: the checkpoint a resume continues from is there, and train.max_steps is not
    below its step; a run without a checkpoint starts again only if it never completed one (docs/training.md)."""
    run_dir = Path(run_dir)
    rf = cfg.run.resume_from
    path = ckpt.checkpoint_at(run_dir, rf) if rf else ckpt.latest_checkpoint(run_dir)
    if path is not None:
        step = step_of(path)
        if cfg.train.max_steps < step:
            raise ConfigError(f"train.max_steps={cfg.train.max_steps} is below step {step}, where the resume "
                              f"continues ({path.name}); expected train.max_steps >= {step}: set it so (or use "
                              f"--resume-from STEP with an earlier kept checkpoint)")
        return
    found = []
    if (run_dir / "result.json").is_file():
        found.append("result.json (a finished run)")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        steps = [r.get("step", 0) for r in last_records(metrics)[0]]
        first = first_save_step(cfg)
        if steps and first is not None and max(steps) > first:
            found.append(f"metrics.jsonl up to step {max(steps)}")
    if found:
        raise ConfigError(f"resume of {str(run_dir)!r} refused: found {' and '.join(found)} but no checkpoint in "
                          f"{run_dir / 'checkpoints'} (deleted or moved?); a resume continues only from a "
                          "checkpoint, and starting again from step 0 would replace the run's results: restore "
                          "its checkpoints, or train again on purpose as a new run (run.name=NEW, without --resume)")


def first_save_step(cfg: Config) -> int | None:
    """The step of a run's first checkpoint on its interval (after its branch point for a branched run), or None
    without checkpoint.interval."""
    interval = cfg.checkpoint.interval
    if interval <= 0:
        return None
    try:
        start = step_of(Path(cfg.train.branch_from)) if cfg.train.branch_from else 0
    except ValueError:  # not a step_XXXXXXX.pt name: read_branch_point refuses it in one line
        start = 0
    return (start // interval + 1) * interval


def check_checkpoint_of_run(state: dict, cfg: Config, run_dir: Path, path) -> None:
    """A checkpoint resumed into a run must be that run's: its config (method, seed, data, model, ...) equals
    the run's except for keys a resume may change, keys the resume allows (run.allow_change) and keys changed
    by earlier resumes."""
    theirs = flat(state["config"])
    changed_before = {k for rec in read_resumes(run_dir) for k in (rec.get("changed") or {})}
    skip = set(INVOCATION_KEYS) | allowed_changes(cfg) | changed_before
    diffs = [f"{key}={theirs[key]!r} (run: {value!r})" for key, value in flat(cfg).items()
             if key not in skip and key in theirs and theirs[key] != value]
    if diffs:
        raise ConfigError(f"checkpoint {str(path)!r} is not of this run: {listing(diffs, 4, str)}; it was written by "
                          "another run (copied in?): remove it from checkpoints/, or resume the run it belongs to")


def _changes(changed: dict) -> str:
    """{key: [old, new]} of ``version_change`` in words (commits shortened)."""
    def short(v):
        return v[:12] if isinstance(v, str) and len(v) == 40 else v

    return ", ".join(f"{k} {short(old)!r} -> {short(new)!r}" for k, (old, new) in changed.items())


def last_segment(run_dir: Path) -> dict:
    """The provenance of the run's last segment: its last resume record that has one, else env.json (the start)."""
    for rec in reversed(read_resumes(run_dir)):
        if "eslm_version" in rec:
            return rec
    env = read_env(run_dir)
    return {"step": 0, **{k: env.get(k) for k in ("eslm_version", "git_commit", "git_dirty", "git_diff_sha256")}} \
        if isinstance(env, dict) else {}


def open_run_dir(run_dir: Path, cfg: Config, *, device, world_size: int, num_params: int, log):
    """Rank 0, before the first step: (the held lock, the resume's changes or None, the metrics writer).

    Whose directory it is, a resume's config and eslm version are checked (reading only) before anything is
    written; a new run writes its marker, config.yaml and env.json once, describing its start."""

    owner = check_owner(run_dir, cfg.run.resume)
    changes = check_resume(run_dir, cfg) if cfg.run.resume else None
    if cfg.run.resume:
        check_provenance(run_dir, cfg)
        check_resume_point(run_dir, cfg)
    if not cfg.run.resume and owner != "new" and holds_run(run_dir):
        _refuse_existing(run_dir)
    lock = lock_run_dir(run_dir, cfg.run.resume, log)
    try:
        if not cfg.run.resume:
            (run_dir / RESUMES_FILE).unlink(missing_ok=True)  # of a start killed before its first step
            atomic_write(run_dir / RUN_MARKER, new_run_marker())
            atomic_write(run_dir / "config.yaml", to_yaml(cfg).encode())
            env = {**env_info(device, world_size, cfg.run.seed), "model_params_non_embedding": num_params,
                   "load_avg_at_start": load_avg(), "segments": [{"step": 0, "time": _now(), **code_version()}]}
            atomic_write(run_dir / "env.json", (json.dumps(env, indent=2) + "\n").encode())
        writer = MetricsWriter(run_dir, cfg.log.tensorboard)
        writer.sinks += open_trackers(cfg, run_dir, read_env(run_dir))
    except BaseException:
        lock.release()
        raise
    return lock, changes, writer


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def record_resumed_at(run_dir: Path, cfg: Config, changes: dict | None, step: int, log) -> None:
    """Rank 0, once the checkpoint is loaded: checkpoints after a --resume-from step are moved aside
    (superseded), the applied changes are logged, and resumes.jsonl and env.json's segments gain its record."""
    extra: dict[str, Any] = {}
    if cfg.run.resume_from:
        extra["resume_from"] = step
        extra["superseded"], dest = ckpt.supersede_after(run_dir, step)
        if extra["superseded"]:
            extra["superseded_to"] = str(dest.relative_to(run_dir))
            log(f"later checkpoints moved to {dest}: {', '.join(extra['superseded'])}")

    changed_code = version_change(run_dir)  # allowed by check_provenance: run.allow_version_change
    if not (Path(run_dir) / ENV_FILE).is_file():
        extra["env_missing"] = True
        log(f"resumed without {ENV_FILE}: the code of the run's start is unknown (run.allow_version_change; "
            "recorded in resumes.jsonl)")
    if changed_code:
        extra["version_change"] = changed_code
        log(f"resumed with another eslm: {_changes(changed_code)} (run.allow_version_change; recorded in "
            "resumes.jsonl)")
    for key, (old, new) in (changes or {}).items():
        log(f"resume changes {key}: {old!r} -> {new!r} (recorded in resumes.jsonl)")
    segment = {"time": _now(), "step": step, **code_version()}
    path = Path(run_dir) / RESUMES_FILE  # one record appended, after a torn last line (a kill mid-write) is cut
    if path.is_file():
        cut_torn_tail(path)
    with named(path), open_nofollow(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({**segment, "changed": changes or {}, **extra}) + "\n")
    if env := read_env(run_dir):  # env.json's segments: the start, then every resume
        env["segments"].append(segment)
        atomic_write(run_dir / "env.json", (json.dumps(env, indent=2) + "\n").encode())
