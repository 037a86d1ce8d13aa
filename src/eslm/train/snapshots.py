"""Writing model-only snapshots for evaluation (``checkpoint.snapshot_interval`` / ``snapshot_keep``; the format
and its reader: ``eslm.model.loading``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eslm import metrics as M
from eslm.errors import CheckpointError
from eslm.files import atomic_write, ensure_dir, os_error_in
from eslm.model.loading import (
    SNAPSHOT_DIR,
    SNAPSHOT_FORMAT,
    list_snapshots,
    snapshot_digest,
    snapshot_name,
    write_safetensors,
)
from eslm.model.state import clean_state_dict, non_finite
from eslm.train.checkpoint import os_fix
from eslm.train.stopping import TrainingDiverged, last_good_hint


def save_snapshot(snap_dir: Path, state: dict[str, torch.Tensor], meta: dict, keep: int = 0) -> Path:
    """Write ``state`` (CPU tensors) with ``meta`` (JSON-able values) and its checksum atomically (temporary
    file, fsync, rename, fsync of the directory); prune to the newest ``keep``. Non-finite weights are never
    written (TrainingDiverged); a failed write removes its temporary file and is one CheckpointError line."""
    ensure_dir(snap_dir)
    state = {k: v.detach().cpu().contiguous() for k, v in state.items() if k != "lm_head.weight"}
    path = snap_dir / snapshot_name(int(meta["step"]))
    bad = non_finite(state)
    if bad is not None:
        raise TrainingDiverged(f"the weights at step {meta['step']} are not finite ({bad}); no snapshot was "
                               "written. " + last_good_hint(snap_dir.parent))
    header = {"format": SNAPSHOT_FORMAT, **{k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}}
    header["sha256"] = snapshot_digest(state, header)
    try:  # eslm's temporary file (.step_X.safetensors.tmp.PID, removed at the next start after a kill), fsync, rename
        atomic_write(path, lambda f: write_safetensors(f, state, header))
    except Exception as e:  # a full disk, a file-size limit: one line naming the file
        err = os_error_in(e, path)
        if err is None:
            raise
        raise CheckpointError(f"could not write snapshot {path} ({err.strerror}); the checkpoints and the earlier "
                              f"snapshots are intact; {os_fix(err)}, then resume with --resume") from None
    if keep > 0:
        for old in list_snapshots(snap_dir)[:-keep]:
            old.unlink(missing_ok=True)
    return path


def maybe_snapshot(trainer, at_eval: bool) -> Path | None:
    """Called by the trainer after each evaluation (``at_eval``) and after each step; writes a snapshot when
    ``checkpoint.snapshot_interval`` says so. Under FSDP every rank must call it (the weights are gathered)."""
    c = trainer.cfg.checkpoint
    interval = c.snapshot_interval
    due = (interval == 0 and at_eval) or (interval > 0 and not at_eval and trainer.step % interval == 0)
    if not due:
        return None
    if trainer.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(trainer.raw_model,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = trainer.raw_model.state_dict()
    if not trainer.dist.is_main:
        return None

    meta = {"model_config": trainer.model_config.to_dict(), "tokenizer": trainer.dataset.tokenizer_name,
            "step": trainer.step, M.TOKENS_SEEN: trainer.loader_tokens_seen(), **trainer.flops.totals()}
    return save_snapshot(trainer.run_dir / SNAPSHOT_DIR, clean_state_dict(state), meta, keep=c.snapshot_keep)
