"""Load a model from whatever a user points at: a run directory, a checkpoint file, a snapshot, or a HF GPT-2
directory (docs/evaluation.md, "Loading").

Checkpoints (``{"format": "eslm-checkpoint-v1", "model", "model_config", "tokenizer", "step", ...}``, written by
``eslm.train.checkpoint``) are read with ``weights_only=True``; a run's are ``checkpoints/step_XXXXXXX.pt`` with
``checkpoints/latest`` naming the newest; model-only snapshots are ``snapshots/step_XXXXXXX.safetensors``
(``eslm.model.snapshot_file``).
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import torch

from eslm import metrics as M
from eslm.errors import CheckpointError, ConfigError
from eslm.files import RUN_MARKER, verify_checksum
from eslm.model.gpt import GPT, ModelConfig
from eslm.model.hf import from_hf, read_export_info
from eslm.model.snapshot_file import SNAPSHOT_DIR, SNAPSHOT_FORMAT, SnapshotDamaged, list_snapshots, read_snapshot
from eslm.model.state import build_checked, clean_state_dict, load_error_line, non_finite

CHECKPOINT_FORMAT = "eslm-checkpoint-v1"
CHECKPOINT_FILE = re.compile(r"^step_(\d{7,})\.pt$")  # train.checkpoint.checkpoint_name's (7 digits or more)


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, dict]:
    """Load one of our models from ``path`` (eval mode, fp32, on ``device``).

    ``path`` may be a run directory (its ``checkpoints/latest`` is used; its newest snapshot when it has no
    checkpoint), a ``checkpoints/`` directory, a checkpoint ``.pt`` file, a snapshot ``.safetensors`` file,
    or a local HF GPT-2 directory (one holding ``config.json``).
    Returns ``(model, info)``; ``info`` holds ``tokenizer`` (name or None), ``step`` (int or None),
    ``source`` (str path of the file or directory read), ``run_dir`` (str or None), ``model_config``
    (dict) and ``flops_paper`` / ``flops_executed`` when the checkpoint carries them.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"expected a run directory, checkpoint .pt file or HF GPT-2 directory, found nothing at {p}; "
            "check the path"
        )
    if p.is_dir() and (p / "config.json").is_file() and not is_run_dir(p):
        return _load_hf_dir(p, device)
    ckpt_file = resolve_checkpoint(p)
    if ckpt_file.suffix == ".safetensors":
        return _load_snapshot_file(ckpt_file, device)
    return _load_checkpoint_file(ckpt_file, device)


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


def weights_problem(path: Path) -> str | None:
    """Why the weights file ``path`` cannot be used (damaged, unreadable, non-finite), or None."""
    try:
        if path.suffix == ".safetensors":
            state, _ = read_snapshot(path)
        else:
            if verify_checksum(path) is False:
                return _DAMAGED
            state = read_checkpoint(path)["model"]
    except SnapshotDamaged:
        return _DAMAGED
    except Exception as e:  # any unreadable file: not a candidate
        return f"could not be read ({type(e).__name__})"
    bad = non_finite(state)
    return None if bad is None else f"holds non-finite weights ({bad})"


_DAMAGED = "does not match its checksum: it was damaged after it was written"


def newest_good_file(run_dir: Path, skip: Path | None = None) -> Path | None:
    """The newest snapshot or checkpoint of the run that matches its checksum and holds finite weights (reads
    each file it tries, newest step first, the snapshot of a step before its checkpoint)."""
    files = sorted([*list_checkpoints(run_dir), *list_snapshots(run_dir)],
                   key=lambda f: (step_of_file(f), f.suffix == ".safetensors"), reverse=True)
    for f in files:
        if skip is not None and f.resolve() == Path(skip).resolve():
            continue
        if weights_problem(f) is None:
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
    """All ``step_XXXXXXX.pt`` files of a run (or of a checkpoints directory), sorted by step."""
    p = Path(run_dir)
    ckpt_dir = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not ckpt_dir.is_dir():
        return []
    files = [f for f in ckpt_dir.iterdir() if CHECKPOINT_FILE.match(f.name)]
    return sorted(files, key=step_of_file)


def list_evaluable(run_dir: str | Path) -> list[Path]:
    """One weights file per saved step of a run, by step: its snapshot where there is one (small, memory-mapped),
    else its full checkpoint. What ``eslm eval --all-checkpoints`` evaluates."""
    by_step = {step_of_file(f): f for f in list_checkpoints(run_dir)}
    by_step.update({step_of_file(f): f for f in list_snapshots(run_dir)})
    return [by_step[s] for s in sorted(by_step)]


def step_of_file(f: Path) -> int:
    """The step of a checkpoint or snapshot file by its name (step_0000006.pt, step_0000003.safetensors)."""
    m = re.match(r"^step_(\d+)", f.name)
    if m is None:
        raise ValueError(f"expected a step_XXXXXXX file name, found {f.name!r}")
    return int(m.group(1))


def run_dir_of(checkpoint: str | Path) -> Path | None:
    """The run directory that holds a checkpoint file (``<run>/checkpoints/step_X.pt``), else None."""
    p = Path(checkpoint).resolve()
    if p.parent.name in ("checkpoints", SNAPSHOT_DIR):
        return p.parent.parent
    return None


def read_checkpoint(path: str | Path) -> dict:
    """The raw checkpoint dict, validated for format; no model built."""
    p = Path(path)
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle errors, zip errors, unsafe globals: all mean "not our checkpoint"
        raise CheckpointError(
            f"expected an eslm checkpoint (torch.save'd dict) at {p}, but it could not be read "
            f"({load_error_line(e, 'it')}); "
            "point at a step_XXXXXXX.pt written by 'eslm train'"
        ) from None
    if not isinstance(ckpt, dict) or "format" not in ckpt:
        raise CheckpointError(
            f"expected a dict with format {CHECKPOINT_FORMAT!r} in {p}, found {type(ckpt).__name__} without one; "
            "point at a step_XXXXXXX.pt written by 'eslm train'"
        )
    if ckpt["format"] != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"expected checkpoint format {CHECKPOINT_FORMAT!r} in {p}, found {ckpt['format']!r}; "
            "use a checkpoint written by this version of eslm"
        )
    for key in ("model", "model_config"):
        if key not in ckpt:
            raise CheckpointError(f"expected key {key!r} in checkpoint {p}, found keys {sorted(ckpt)}; "
                                  "the file is incomplete, use another checkpoint")
    return ckpt


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


def _load_checkpoint_file(path: Path, device: str | torch.device) -> tuple[GPT, dict]:
    if verify_checksum(path) is False:
        raise _refuse(path, _DAMAGED.replace("checksum", f"checksum ({path.name}.sha256)"))
    ckpt = read_checkpoint(path)
    return _loaded(path, clean_state_dict(ckpt["model"]), ckpt, device)


def _load_snapshot_file(path: Path, device: str | torch.device) -> tuple[GPT, dict]:
    try:
        state, meta = read_snapshot(path)
    except SnapshotDamaged:
        raise _refuse(path, _DAMAGED.replace("checksum", "checksum (sha256 in its header)")) from None
    except Exception as e:  # header or file errors: not our snapshot
        raise CheckpointError(f"expected an eslm snapshot (safetensors) at {path}, but it could not be read "
                              f"({type(e).__name__}); point at a snapshots/step_XXXXXXX.safetensors "
                              "written by 'eslm train'") from None
    if meta.get("format") != SNAPSHOT_FORMAT or not isinstance(meta.get("model_config"), dict):
        raise CheckpointError(f"expected a safetensors file with format {SNAPSHOT_FORMAT!r} and a model_config in "
                              f"its metadata at {path}, found format {meta.get('format')!r}; point at a "
                              "snapshot written by 'eslm train'")
    return _loaded(path, state, meta, device)


def _loaded(path: Path, state: dict, meta: dict, device: str | torch.device) -> tuple[GPT, dict]:
    """The model of a checkpoint or snapshot (finite weights, checked against its config before it is built)
    and its ``load_model`` info, from the file's metadata ``meta``."""
    bad = non_finite(state)
    if bad is not None:
        raise _refuse(path, f"holds non-finite weights ({bad})")
    model = build_checked(config_from_dict(dict(meta["model_config"]), source=str(path)), state, source=str(path))
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
