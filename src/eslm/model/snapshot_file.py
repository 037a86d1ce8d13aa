"""The snapshot file format (``<run>/snapshots/step_0000100.safetensors``): its names, listing and reading.

A model's state dict without the tied ``lm_head.weight``; the header's metadata (strings) holds ``format``,
``model_config`` (JSON), ``tokenizer``, ``step``, the counters (JSON) and ``sha256`` (``snapshot_digest``)."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import torch

from eslm.errors import CheckpointError

SNAPSHOT_FORMAT = "eslm-snapshot-v1"
SNAPSHOT_DIR = "snapshots"
SNAPSHOT_FILE = re.compile(r"^step_(\d{7,})\.safetensors$")


def snapshot_name(step: int) -> str:
    """The file name of the snapshot of ``step``: step_XXXXXXX.safetensors (7 digits at least)."""
    return f"step_{step:07d}.safetensors"


def step_files(path: str | Path, subdir: str, pattern: re.Pattern) -> list[Path]:
    """The files of a run directory's ``subdir`` (or of ``path`` itself) that ``pattern`` names, by step."""
    p = Path(path)
    d = p / subdir if (p / subdir).is_dir() else p
    matches = [(m, f) for f in d.iterdir() if (m := pattern.match(f.name))] if d.is_dir() else []
    return [f for _, f in sorted(matches, key=lambda mf: int(mf[0].group(1)))]


def list_snapshots(path: str | Path) -> list[Path]:
    return step_files(path, SNAPSHOT_DIR, SNAPSHOT_FILE)


class SnapshotDamaged(CheckpointError):
    """A snapshot whose content does not match the checksum in its header."""


def snapshot_digest(state: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """SHA-256 over the tensors (sorted by name: name, dtype, shape, bytes) and the header metadata other than
    ``sha256`` itself; independent of the file's layout, so the writer computes it before writing."""
    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in metadata.items() if k != "sha256"}, sort_keys=True).encode())
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"\n{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def write_safetensors(f, state: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``state`` (CPU tensors) and ``metadata`` to the open binary file ``f`` in the safetensors layout (an
    8-byte little-endian header length, the JSON header padded to 8 bytes, the tensors' bytes in header order),
    streaming, into the file eslm opened: safetensors' own ``save_file`` writes a ``.tmpXXXXXX`` file of its own
    beside the target, which a kill leaves behind under a name eslm cannot prove it made."""
    if sys.byteorder != "little":
        raise CheckpointError("snapshots are written on little-endian machines only")
    header: dict = {"__metadata__": dict(metadata)}
    tensors, offset = [], 0
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        if t.dtype not in _DTYPES:
            raise CheckpointError(f"cannot write tensor {name} of dtype {t.dtype} into a snapshot")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        tensors.append(t)
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
    for t in tensors:
        if t.numel():
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)


def read_snapshot(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, metadata) of a snapshot, read through safetensors' memory map (no pickle). Its header's
    ``sha256`` is checked: ``SnapshotDamaged`` when it differs or is missing."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        raw = f.metadata() or {}
        state = {k: f.get_tensor(k) for k in f.keys()}
    if snapshot_digest(state, raw) != raw.get("sha256"):
        raise SnapshotDamaged(f"{path} does not match its checksum (sha256 in its header): it was damaged after "
                              "it was written")
    # save_snapshot writes the strings as they are (format, tokenizer, sha256), every other value as JSON
    return state, {k: v if k in ("format", "tokenizer", "sha256") else json.loads(v) for k, v in raw.items()}
