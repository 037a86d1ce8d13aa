"""Checkpoints: everything with state, written atomically, loaded without executing code.

Layout: <run>/checkpoints/step_0000100.pt and <run>/checkpoints/latest (the newest file's name).
A checkpoint is a dict (see ``CHECKPOINT_FORMAT``): "model" (state dict, CPU), "model_config", "tokenizer",
"step", "optimizer", "loader", "method", "flops", "rng", "elapsed_s", ... Saved with torch.save and loaded
with ``torch.load(weights_only=True)``, so a file can never run code; every value is a tensor or plain type.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import torch

from eslm.errors import CheckpointError

CHECKPOINT_FORMAT = "eslm-checkpoint-v1"
_NAME = re.compile(r"^step_(\d{7})\.pt$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:07d}.pt"


def _atomic_write(path: Path, write) -> None:
    """Write via a temporary file in the same directory, fsync, then rename: a kill never leaves a torn file."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a permission error: leave no partial file behind (it may be GBs)
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(ckpt_dir: Path, state: dict, *, keep_last: int, milestones: tuple = ()) -> Path:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state = {"format": CHECKPOINT_FORMAT, **state}
    path = ckpt_dir / checkpoint_name(state["step"])
    try:
        _atomic_write(path, lambda f: torch.save(state, f))
        _atomic_write(ckpt_dir / "latest", lambda f: f.write(path.name.encode()))
    except OSError as e:
        prev = latest_checkpoint(ckpt_dir.parent)
        intact = f"the previous checkpoint {prev.name} and `latest` are intact" if prev else "no earlier checkpoint"
        raise CheckpointError(f"could not write checkpoint {path} ({e.strerror or e}); {intact}; "
                              f"{_os_fix(e)}, then resume with --resume") from None
    _prune(ckpt_dir, keep_last, set(milestones))
    return path


def _os_fix(e: OSError) -> str:
    import errno

    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free disk space (or set run.out_dir to a larger disk)"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make the run directory writable (or set run.out_dir elsewhere)"
    return "check the run directory"


def remove_stale_temporaries(ckpt_dir: Path) -> list[Path]:
    """Delete ``.step_*.pt.tmp.PID`` / ``.latest.tmp.PID`` files that a killed or failed save left behind.

    Call only while holding the run directory's lock: then no live process is writing them."""
    if not ckpt_dir.is_dir():
        return []
    stale = [p for p in ckpt_dir.iterdir() if p.name.startswith(".") and ".tmp." in p.name]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def state_is_finite(model_state: dict) -> bool:
    """True when every floating-point tensor of a state dict is finite (one host sync)."""
    flags = [torch.isfinite(t).all() for t in model_state.values() if torch.is_tensor(t) and t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


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
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in ckpt_dir.iterdir() if (m := _NAME.match(p.name)))


def supersede_after(run_dir: Path, step: int) -> list[str]:
    """Move the checkpoints after ``step`` to checkpoints/superseded/ (a resume from an earlier step makes
    them another branch of the run; kept, not deleted) and point ``latest`` at ``step``."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    later = [s for s in kept_steps(ckpt_dir) if s > step]
    if later:
        (ckpt_dir / "superseded").mkdir(exist_ok=True)
    for s in later:
        os.replace(ckpt_dir / checkpoint_name(s), ckpt_dir / "superseded" / checkpoint_name(s))
    _atomic_write(ckpt_dir / "latest", lambda f: f.write(checkpoint_name(step).encode()))
    return [checkpoint_name(s) for s in later]


def _prune(ckpt_dir: Path, keep_last: int, milestones: set) -> None:
    steps = sorted(int(m.group(1)) for p in ckpt_dir.iterdir() if (m := _NAME.match(p.name)))
    regular = [s for s in steps if s not in milestones]
    for s in regular[:-keep_last] if keep_last > 0 else regular[:-1]:
        (ckpt_dir / checkpoint_name(s)).unlink(missing_ok=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpt_dir = Path(run_dir) / "checkpoints"
    pointer = ckpt_dir / "latest"
    if pointer.is_file():
        p = ckpt_dir / pointer.read_text().strip()
        if p.is_file():
            return p
    steps = sorted(int(m.group(1)) for p in ckpt_dir.glob("step_*.pt") if (m := _NAME.match(p.name)))
    return ckpt_dir / checkpoint_name(steps[-1]) if steps else None


def load_checkpoint(path: Path, map_location="cpu", mmap: bool = False) -> dict:
    """``mmap=True`` maps the tensors from the file instead of reading them (processes share the page cache)."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} not found; expected a step_XXXXXXX.pt file") from None
    except Exception as e:  # unpickling errors, truncated files
        raise CheckpointError(f"checkpoint {str(path)!r} could not be read ({type(e).__name__}); "
                              "expected an eslm checkpoint — the file may be truncated or of another program") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{str(path)!r} is not an {CHECKPOINT_FORMAT} checkpoint")
    return state


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
    np_state = np.random.get_state()
    state = {
        "python": _to_plain(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_to_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"].cpu())  # a checkpoint loaded with map_location=cuda moves it to the GPU
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _to_plain(x):
    return [_to_plain(v) for v in x] if isinstance(x, (tuple, list)) else x


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, list) else x
