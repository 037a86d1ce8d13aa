"""The snapshot file format (``<run>/snapshots/step_0000100.safetensors``): its names, listing and reading.

A snapshot is a model's state dict in the training (parameter) dtype, no optimizer, in a safetensors file; the
tied ``lm_head.weight`` is stored once (as the embedding). The header's metadata (strings) carries what
``eslm.model.loading`` needs: ``format`` (``SNAPSHOT_FORMAT``), ``model_config`` (JSON), ``tokenizer``,
``step``, and the FLOPs / token counters (JSON numbers). The writer, which decides when to snapshot, is
``eslm.train.snapshots``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

SNAPSHOT_FORMAT = "eslm-snapshot-v1"
SNAPSHOT_DIR = "snapshots"
SNAPSHOT_FILE = re.compile(r"^step_(\d{7,})\.safetensors$")


def snapshot_name(step: int) -> str:
    """The file name of the snapshot of ``step``: step_XXXXXXX.safetensors (7 digits at least)."""
    return f"step_{step:07d}.safetensors"


def list_snapshots(path: str | Path) -> list[Path]:
    """The ``step_XXXXXXX.safetensors`` files of a run directory (or of its snapshots/ folder), by step."""
    p = Path(path)
    d = p / SNAPSHOT_DIR if (p / SNAPSHOT_DIR).is_dir() else p
    if not d.is_dir():
        return []
    files = [f for f in d.iterdir() if SNAPSHOT_FILE.match(f.name)]
    return sorted(files, key=lambda f: int(SNAPSHOT_FILE.match(f.name).group(1)))


def read_snapshot(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, metadata) of a snapshot, read through safetensors' memory map (no pickle, no full read)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        raw = f.metadata() or {}
        state = {k: f.get_tensor(k) for k in f.keys()}
    meta = {}
    for k, v in raw.items():
        try:
            meta[k] = json.loads(v) if k not in ("format", "tokenizer") else v
        except json.JSONDecodeError:
            meta[k] = v
    return state, meta
