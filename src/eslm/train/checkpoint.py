"""Checkpoints (docs/training.md): ``checkpoints/step_XXXXXXX.pt``, its ``.sha256`` sidecar and ``latest``, written
atomically; a checkpoint holds tensors and plain types only, loaded with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eslm.errors import CheckpointError
from eslm.files import (
    CHECKSUM_SUFFIX,
    atomic_write,
    checksum_path,
    ensure_dir,
    read_checksums,
    stale_temporaries,
    write_checksums,
)
from eslm.model.loading import CHECKPOINT_FILE, CHECKPOINT_FORMAT, list_checkpoints, read_weights, step_of


def checkpoint_name(step: int) -> str:
    return f"step_{step:07d}.pt"


def save_checkpoint(ckpt_dir: Path, state: dict, *, keep_last: int, milestones: tuple = ()) -> Path:
    """Write ``step_XXXXXXX.pt`` and its SHA-256 (``step_XXXXXXX.pt.sha256``), point ``latest`` at it, prune.

    The checksum is written before the file takes its name; when an earlier file of the same step is replaced,
    the sidecar accepts both until the rename is done, so a kill at any point leaves a file that matches it."""
    state = {"format": CHECKPOINT_FORMAT, **state}
    path = ckpt_dir / checkpoint_name(state["step"])
    try:
        ensure_dir(ckpt_dir)
        old = (read_checksums(path) or []) if path.is_file() else []
        digest = atomic_write(path, lambda f: torch.save(state, f),
                               lambda new: write_checksums(path, [new, *old]))
        if old:
            write_checksums(path, [digest])
        atomic_write(ckpt_dir / "latest", path.name.encode())
    except OSError as e:
        prev = latest_checkpoint(ckpt_dir.parent)
        intact = f"the previous checkpoint {prev.name} and `latest` are intact" if prev else "no earlier checkpoint"
        raise CheckpointError(f"could not write checkpoint {path} ({e.strerror or e}); {intact}; "
                              f"{os_fix(e)}, then resume with --resume") from None
    regular = [s for s in kept_steps(ckpt_dir) if s not in set(milestones)]
    for s in regular[:-keep_last] if keep_last > 0 else regular[:-1]:
        (ckpt_dir / checkpoint_name(s)).unlink(missing_ok=True)
        checksum_path(ckpt_dir / checkpoint_name(s)).unlink(missing_ok=True)
    return path


def os_fix(e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free disk space (or set run.out_dir to a larger disk)"
    if e.errno == errno.EFBIG:
        return "raise the file-size limit (ulimit -f) or set run.out_dir to another file system"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make the run directory writable (or set run.out_dir elsewhere)"
    return "check the run directory"


def _own(name: str) -> bool:
    """A name eslm writes in checkpoints/: a checkpoint, its checksum, ``latest``."""
    return name == "latest" or bool(CHECKPOINT_FILE.match(name.removesuffix(CHECKSUM_SUFFIX)))


def remove_stale_temporaries(ckpt_dir: Path) -> list[Path]:
    """Delete what killed or failed saves left in checkpoints/: temporary files (``.step_XXXXXXX.pt.tmp.PID``,
    ``.latest.tmp.PID``, ``.step_XXXXXXX.pt.sha256.tmp.PID``) and checksums of checkpoints that are not there.

    Call only while holding the run directory's lock: then no live process is writing them."""
    stale = stale_temporaries(ckpt_dir, _own)
    if ckpt_dir.is_dir() and not ckpt_dir.is_symlink():
        stale += [p for p in ckpt_dir.iterdir() if p.name.endswith(CHECKSUM_SUFFIX) and _own(p.name)
                  and not p.with_name(p.name.removesuffix(CHECKSUM_SUFFIX)).exists()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def checkpoint_at(run_dir: Path, step: int) -> Path:
    """The kept checkpoint of ``step``, or a one-line error listing the steps that are kept."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    path = ckpt_dir / checkpoint_name(step)
    if not path.is_file():
        kept = kept_steps(ckpt_dir)
        raise CheckpointError(f"no checkpoint of step {step} in {ckpt_dir}; kept steps: "
                              f"{', '.join(map(str, kept)) or 'none'}")
    return path


def kept_steps(ckpt_dir: Path) -> list[int]:
    return [step_of(p) for p in list_checkpoints(ckpt_dir)]


def supersede_after(run_dir: Path, step: int) -> tuple[list[str], Path]:
    """Move the checkpoints after ``step`` to checkpoints/superseded/ (a resume from an earlier step makes
    them another branch of the run; kept, not deleted) and point ``latest`` at ``step``. Returns (the names
    moved, where to)."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    later = [s for s in kept_steps(ckpt_dir) if s > step]
    # checkpoints/superseded/, or superseded/2/, 3/, ... when an earlier --resume-from set aside a file of the same
    # name there (never overwritten: each is a branch)
    dest, k = ckpt_dir / "superseded", 1
    while any((dest / n).exists() or checksum_path(dest / n).exists() for n in map(checkpoint_name, later)):
        k += 1
        dest = ckpt_dir / "superseded" / str(k)
    if later:
        ensure_dir(dest)
    for s in later:
        name = checkpoint_name(s)
        if checksum_path(ckpt_dir / name).exists():  # the checksum first: a kill between leaves no orphan file
            os.replace(checksum_path(ckpt_dir / name), checksum_path(dest / name))
        os.replace(ckpt_dir / name, dest / name)
    atomic_write(ckpt_dir / "latest", checkpoint_name(step).encode())
    return [checkpoint_name(s) for s in later], dest


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpt_dir = Path(run_dir) / "checkpoints"
    pointer = ckpt_dir / "latest"
    if pointer.is_file():
        p = ckpt_dir / pointer.read_text().strip()
        if p.is_file():
            return p
    steps = kept_steps(ckpt_dir)
    return ckpt_dir / checkpoint_name(steps[-1]) if steps else None


def load_checkpoint(path: Path, map_location="cpu", mmap: bool = False) -> dict:
    """The checkpoint at ``path``, verified (``eslm.model.loading.read_weights``), else a one-line
    CheckpointError naming the newest good checkpoint of the run."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} not found; expected a step_XXXXXXX.pt file")
    got = read_weights(path, map_location, mmap)
    if not isinstance(got, str):
        return got[1]
    if path.parent.name != "checkpoints":  # not in a run directory
        raise CheckpointError(f"checkpoint {path} {got}; expected an intact eslm checkpoint")
    good, _ = newest_good_checkpoint(path.parent.parent, skip=path)
    way = (f"the newest good checkpoint is {good}: resume from it with --resume-from {step_of(good)}" if good
           else "no other checkpoint of this run is intact: start a new run.name")
    raise CheckpointError(f"checkpoint {path} {got}; {way}")


def newest_good_checkpoint(run_dir: Path, skip: Path | None = None) -> tuple[Path | None, list[str]]:
    """(the newest kept checkpoint of the run that ``read_weights`` accepts, or None; what was skipped on the
    way: "step_0000003.pt is damaged (...)"). Reads every checkpoint it tries."""
    skipped: list[str] = []
    for path in reversed(list_checkpoints(Path(run_dir) / "checkpoints")):
        if skip is None or path != Path(skip):
            if not isinstance(problem := read_weights(path, mmap=True), str):
                return path, skipped
            skipped.append(f"{path.name} is damaged ({problem})")
    return None, skipped


def check_model_matches(state: dict, model_config: dict, path,
                        fix: str = "resume with the config it was written with, or start a new run.name") -> None:
    """Clear error for a checkpoint of another model shape (before load_state_dict's wall of text)."""
    theirs = state.get("model_config", {})
    diffs = [f"{k}={theirs.get(k)!r} (run: {v!r})" for k, v in model_config.items()
             if k not in ("dropout",) and theirs.get(k) != v]
    if diffs:
        raise CheckpointError(f"checkpoint {str(path)!r} is of another model: {', '.join(diffs)}; {fix}")


# ------------------------------------------------------------------ RNG state as plain types / tensors


def rng_state() -> dict:
    np_state: Any = np.random.get_state()
    py = random.getstate()  # (version, 625 ints, gauss_next)
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"].cpu())  # a checkpoint loaded with map_location=cuda moves it to the GPU
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
