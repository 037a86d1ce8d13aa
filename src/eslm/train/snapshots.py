"""Model-only snapshots for evaluation: ``<run>/snapshots/step_0000100.safetensors``.

A full checkpoint holds the optimizer (about 3x the weights) and is pruned to ``checkpoint.keep_last``; the
paper's "best downstream accuracy during training" needs the weights of every evaluated step. A snapshot is
the model's state dict in the training (parameter) dtype, no optimizer, written at every evaluation
(``checkpoint.snapshot_interval=0``, the default) or every N steps, kept by its own retention
(``checkpoint.snapshot_keep``, 0 = all). The tied ``lm_head.weight`` is stored once (as the embedding).

The file format (names, header metadata) and its reader are ``eslm.model.snapshot_file``; this module writes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from eslm.model.snapshot_file import SNAPSHOT_DIR, SNAPSHOT_FORMAT, list_snapshots, snapshot_name


def save_snapshot(snap_dir: Path, state: dict[str, torch.Tensor], meta: dict, keep: int = 0) -> Path:
    """Write ``state`` (CPU tensors) with ``meta`` (JSON-able values) atomically; prune to the newest ``keep``."""
    from safetensors.torch import save_file

    snap_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in state.items() if k != "lm_head.weight"}
    header = {"format": SNAPSHOT_FORMAT, **{k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}}
    path = snap_dir / snapshot_name(int(meta["step"]))
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    save_file(state, str(tmp), metadata=header)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # safetensors creates 0600 files; give them the mode of the checkpoints
    os.replace(tmp, path)
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
    from eslm.model.state import clean_state_dict

    meta = {"model_config": trainer.model_config.to_dict(), "tokenizer": trainer.dataset.tokenizer_name,
            "step": trainer.step, "tokens_seen": trainer.loader_tokens_seen(), **trainer.flops.totals()}
    return save_snapshot(trainer.run_dir / SNAPSHOT_DIR, clean_state_dict(state), meta, keep=c.snapshot_keep)
