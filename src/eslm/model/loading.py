"""Load a model from whatever a user points at: a run directory, a checkpoint file, a snapshot, or a HF GPT-2
directory (docs/evaluation.md, "Loading"), and read and verify checkpoint and snapshot files."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import fields
from pathlib import Path

import torch

from eslm import metrics as M
from eslm.errors import CheckpointError, ConfigError
from eslm.files import RUN_MARKER, checksum_path, verify_checksum
from eslm.model.gpt import GPT, ModelConfig
from eslm.model.hf import from_hf, read_export_info
from eslm.model.state import build_checked, clean_state_dict, non_finite

CHECKPOINT_FORMAT = "eslm-checkpoint-v1"
CHECKPOINT_FILE = re.compile(r"^step_(\d{7,})\.pt$")  # train.checkpoint.checkpoint_name's (7 digits or more)
# a snapshot (<run>/snapshots/step_0000100.safetensors): the state dict without the tied lm_head.weight; its
# header's metadata (strings): format, model_config (JSON), tokenizer, step, the counters (JSON), sha256
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


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, dict]:
    """(model in eval mode, fp32, on ``device``; info: ``tokenizer``, ``step``, ``source``, ``run_dir``,
    ``model_config`` and the counters the file carries) of a run directory (its latest checkpoint, else its newest
    snapshot), a ``checkpoints/`` directory, a .pt or .safetensors file, or a local HF GPT-2 directory."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"expected a run directory, checkpoint .pt file or HF GPT-2 directory, found nothing at {p}; "
            "check the path"
        )
    if p.is_dir() and (p / "config.json").is_file() and not is_run_dir(p):
        return _load_hf_dir(p, device)
    return _load_file(resolve_checkpoint(p), device)


def is_run_dir(path: Path) -> bool:
    """A directory eslm trains in (its marker, checkpoints/ or snapshots/): it means its latest checkpoint, also
    when an export was once written into it (a config.json beside them is never preferred)."""
    p = Path(path)
    return (p / RUN_MARKER).is_file() or (p / "checkpoints").is_dir() or (p / SNAPSHOT_DIR).is_dir()


def _refuse(path: Path, problem: str) -> CheckpointError:
    """A one-line error for a weights file that cannot be used, naming the newest good file of its run."""
    run_dir = run_dir_of(path)
    good = newest_good_file(run_dir, skip=path) if run_dir is not None else None
    way = (f"the newest good file of the run is {good}: point at it" if good else
           "no other weights file of the run is intact and finite" if run_dir is not None else
           "point at an intact file written by 'eslm train'")
    return CheckpointError(f"{path} {problem}; {way}")


def read_weights(path: Path, map_location: str | torch.device = "cpu", mmap: bool = False) -> tuple[dict, dict] | str:
    """(state dict, metadata) of a checkpoint (metadata: the whole checkpoint dict) or a snapshot, verified (its
    checksum, format, finite weights and, in a checkpoint, finite optimizer state), or why it cannot be used
    (one phrase). ``mmap=True`` maps a checkpoint's tensors from the file (processes share the page cache)."""
    damaged = "does not match its checksum ({}): it was damaged after it was written"
    snapshot = path.suffix == ".safetensors"
    kind = "snapshot (safetensors)" if snapshot else "checkpoint"
    state: dict | None
    try:
        if snapshot:  # through safetensors' memory map (no pickle)
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as f:
                raw = f.metadata() or {}
                state = {k: f.get_tensor(k) for k in f.keys()}
            if snapshot_digest(state, raw) != raw.get("sha256"):
                return damaged.format("sha256 in its header")
            # save_snapshot writes the strings as they are (format, tokenizer, sha256), every other value as JSON
            meta = {k: v if k in ("format", "tokenizer", "sha256") else json.loads(v) for k, v in raw.items()}
        elif verify_checksum(path) is False:
            return damaged.format(checksum_path(path).name)
        else:
            meta = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
            state = meta.get("model") if isinstance(meta, dict) else None
    except Exception as e:  # unpickling errors (objects other than tensors and plain values), truncated files
        return f"could not be read ({type(e).__name__}): expected an eslm {kind} written by 'eslm train'"
    form = SNAPSHOT_FORMAT if snapshot else CHECKPOINT_FORMAT
    if state is None or meta.get("format") != form or not isinstance(meta.get("model_config"), dict):
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        return f"is not an {form} file with a model_config (found format {found!r})"
    for tree, what in ((state, "weights"), ({} if snapshot else meta.get("optimizer", {}), "values in its optimizer state")):
        if (bad := non_finite(tree)) is not None:
            return f"holds non-finite {what} ({bad})"
    return state, meta


def newest_good_file(run_dir: Path, skip: Path | None = None) -> Path | None:
    """The newest snapshot or checkpoint of the run that ``read_weights`` accepts (reads each file it tries,
    newest step first, the snapshot of a step before its checkpoint)."""
    files = sorted([*list_checkpoints(run_dir), *list_snapshots(run_dir)],
                   key=lambda f: (step_of(f), f.suffix == ".safetensors"), reverse=True)
    for f in files:
        if (skip is None or f.resolve() != Path(skip).resolve()) and not isinstance(read_weights(f, mmap=True), str):
            return f
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint file that ``path`` names: itself if a file, else the ``latest`` one of the run."""
    p = Path(path)
    if p.is_file():
        return p
    ckpt_dir = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    latest = ckpt_dir / "latest"
    if latest.is_file():
        name = latest.read_text().strip()
        target = ckpt_dir / name
        if not target.is_file():
            raise CheckpointError(
                f"expected {latest} to name an existing checkpoint, found {name!r} which does not exist; "
                "point at a specific step_XXXXXXX.pt instead"
            )
        return target
    found = list_checkpoints(p) or list_snapshots(p)
    if found:
        return found[-1]
    raise CheckpointError(
        f"expected a run directory with checkpoints/latest, step_XXXXXXX.pt or snapshots/*.safetensors files, "
        f"found none in {p}; "
        "train first or point at a checkpoint file"
    )


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    return step_files(run_dir, "checkpoints", CHECKPOINT_FILE)


def list_evaluable(run_dir: str | Path) -> list[Path]:
    """One weights file per saved step of a run, by step: its snapshot where there is one (small, memory-mapped),
    else its full checkpoint. What ``eslm eval --all-checkpoints`` evaluates."""
    by_step = {step_of(f): f for f in list_checkpoints(run_dir)}
    by_step.update({step_of(f): f for f in list_snapshots(run_dir)})
    return [by_step[s] for s in sorted(by_step)]


def step_of(path: str | Path) -> int:
    """The step of a checkpoint or snapshot file named step_XXXXXXX.pt / .safetensors."""
    m = re.match(r"^step_(\d+)\.(?:pt|safetensors)$", Path(path).name)
    if m is None:
        raise ValueError(f"expected a file named step_XXXXXXX.pt or .safetensors, found {Path(path).name!r}")
    return int(m.group(1))


def run_dir_of(checkpoint: str | Path) -> Path | None:
    """The run directory that holds a checkpoint file (``<run>/checkpoints/step_X.pt``), else None."""
    p = Path(checkpoint).resolve()
    if p.parent.name in ("checkpoints", SNAPSHOT_DIR):
        return p.parent.parent
    return None


def config_from_dict(d: dict, source: str = "checkpoint") -> ModelConfig:
    """ModelConfig from a dict; unknown keys are an error (they mean a different model version)."""
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise CheckpointError(
            f"expected model_config keys among {sorted(known)} in {source}, found unknown {unknown}; "
            "the checkpoint was written by a different model version"
        )
    return ModelConfig(**d)


def _load_file(path: Path, device: str | torch.device) -> tuple[GPT, dict]:
    """The model of a checkpoint or snapshot (checked against its config before it is built) and its
    ``load_model`` info, from the file's metadata."""
    got = read_weights(path)
    if isinstance(got, str):
        raise _refuse(path, got)
    state, meta = got
    model = build_checked(config_from_dict(dict(meta["model_config"]), source=str(path)), clean_state_dict(state),
                          source=str(path))
    return model.to(device).eval(), _info(model, meta, path, run_dir_of(path))


def _info(model: GPT, meta: dict, path: Path, run_dir: Path | None) -> dict:
    info = {"tokenizer": meta.get("tokenizer"), "step": meta.get("step"), "source": str(path),
            "run_dir": str(run_dir) if run_dir else None, "model_config": model.config.to_dict()}
    return info | {k: meta[k] for k in (M.FLOPS_PAPER, M.FLOPS_EXECUTED, M.TOKENS_SEEN) if k in meta}


def _load_hf_dir(path: Path, device: str | torch.device) -> tuple[GPT, dict]:
    model = from_hf(path)
    bad = non_finite(model.state_dict())
    if bad is not None:
        raise CheckpointError(f"{path} holds non-finite weights ({bad}); export an intact checkpoint again")
    meta = read_export_info(path)
    # A directory without our export metadata is a foreign GPT-2 (e.g. OpenAI's): GPT-2 BPE when the
    # vocabulary is GPT-2's, otherwise unknown.
    tok = meta.get("tokenizer") or ("gpt2" if model.config.vocab_size in (50257, 50304) else None)
    return model.to(device).eval(), _info(model, {**meta, "tokenizer": tok}, path, None)


def check_device(device: str, option: str) -> str:
    """``device`` when torch knows it and it is usable here, else one line (a typo, CUDA on a CPU-only build)."""
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{option}: expected cpu, cuda, cuda:N or mps, found {device!r}") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "torch sees no CUDA device"
        raise ConfigError(f"{option}: expected a CUDA device; found none ({why}: CUDA is not available); "
                          "fix: use cpu")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ConfigError(f"{option}: expected cuda:0 .. cuda:{torch.cuda.device_count() - 1}, found {device!r}; "
                          "fix: a smaller index, or fewer processes per node")
    if d.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{option}: expected a device this machine has, found {device!r} (MPS not available)")
    if d.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{option}: expected cpu, cuda, cuda:N or mps, found {device!r}")
    return device
