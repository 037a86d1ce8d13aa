"""The self-describing run directory: eslm-run.json, config.yaml, env.json, metrics.jsonl, tb/, checkpoints/.

``eslm-run.json`` marks a directory eslm created (``RUN_FORMAT``, a random ``id``, when, which eslm): eslm
writes, prunes or deletes only inside directories it can prove it made.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import mmap
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

import eslm
from eslm import metrics as M
from eslm.files import RUN_FORMAT, RUN_MARKER, ensure_dir, named, new_marker, open_nofollow, read_marker
from eslm.tracking import warn_missing

# The files eslm writes whole (temporary file + rename) at the top of a run directory.
WHOLE_FILES = ("config.yaml", "env.json", "result.json", RUN_MARKER, "wandb_run_id")
# What eslm appends to, or keeps as subdirectories: never written through a symbolic link.
LINK_FREE = ("metrics.jsonl", "resumes.jsonl", "eslm.lock", "checkpoints", "snapshots", "tb", "wandb", "eval")


@functools.lru_cache(maxsize=1)
def git_info() -> dict:
    """Commit and dirty flag of the eslm source tree (None outside a git checkout); asked of git once per process
    (callers unpack the dict, never change it)."""
    root = Path(__file__).resolve().parents[3]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
        if sha.returncode == 0:
            out = {"git_commit": sha.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}
            if out["git_dirty"]:  # which uncommitted change: a resume compares it like a commit
                diff = subprocess.run(["git", "diff", "HEAD", "--no-ext-diff", "--no-color"], cwd=root,
                                      capture_output=True, timeout=30)
                if diff.returncode == 0:
                    out["git_diff_sha256"] = hashlib.sha256(diff.stdout).hexdigest()
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    return {"git_commit": None, "git_dirty": None}


def code_version() -> dict:
    """The eslm that runs now: ``eslm_version``, ``git_commit``, ``git_dirty`` and, with uncommitted changes,
    ``git_diff_sha256`` (the SHA-256 of ``git diff HEAD``): a run segment's provenance."""
    return {"eslm_version": eslm.__version__, **git_info()}


def run_marker(run_dir: Path) -> dict | None:
    return read_marker(Path(run_dir) / RUN_MARKER, RUN_FORMAT)


def new_run_marker() -> bytes:
    return (json.dumps(new_marker(RUN_FORMAT), indent=2) + "\n").encode()


def dependency_versions() -> dict[str, str | None]:
    """{key in env.json's "versions": the installed version or None} of the packages that can change a number
    of a run, read from the installed metadata (nothing imported)."""
    out: dict[str, str | None] = {}
    for dist in ("torch", "numpy", "tiktoken", "transformers", "lm-eval", "datasets", "safetensors"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def env_info(device: torch.device, world_size: int, seed: int) -> dict:
    info = {"eslm_version": eslm.__version__, **git_info(), "torch_version": torch.__version__,
            "python_version": sys.version.split()[0], "platform": platform.platform(),
            "device": str(device), "world_size": world_size, "seed": seed,
            "num_threads": torch.get_num_threads(), "versions": dependency_versions()}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    return info


def cut_torn_tail(path: Path) -> None:
    """Truncate a JSON-lines file after its last newline: drops a last line torn by a kill mid-write (that
    step is past the last checkpoint, so a resume writes it again)."""
    if not path.is_file():
        return
    with open_nofollow(path, "rb+") as f:
        size = f.seek(0, 2)
        if size == 0:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:  # rfind scans back from the end only
            end = m.rfind(b"\n") + 1
        if end != size:
            f.truncate(end)


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl (flushed each line; a resume writes the steps past its
    checkpoint again: ``last_records``) and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool):
        self.path = run_dir / "metrics.jsonl"
        cut_torn_tail(self.path)  # else the next line would be glued to a line a kill left half-written
        self.file = open_nofollow(self.path, "a", buffering=1, encoding="utf-8")
        self.tb = None
        self.sinks: list = []  # trackers (eslm.tracking): .log(record), .close()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(ensure_dir(run_dir / "tb")))
            except ImportError:
                warn_missing("log.tensorboard", "tensorboard", "tb")

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with named(self.path):  # a full disk: the error names metrics.jsonl
            self.file.write(json.dumps(clean) + "\n")
        for sink in self.sinks:
            sink.log(clean)
        if self.tb is not None:
            prefix = record.get(M.KIND, "train")
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in (M.STEP, M.KIND):
                    self.tb.add_scalar(f"{prefix}/{k}", v, record.get(M.STEP, 0))

    def close(self) -> None:
        with named(self.path):
            self.file.close()
        for sink in self.sinks:
            sink.close()
        if self.tb is not None:
            self.tb.close()


def read_env(run_dir: Path) -> dict:
    """The run's env.json (written at its start), {} when unreadable: the trackers' run config."""
    try:
        return json.loads((Path(run_dir) / "env.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def last_records(path: Path) -> tuple[list[dict], int]:
    """(records, skipped) of a metrics.jsonl: the LAST line of every (kind, step) in (step, kind) order — a
    resumed run writes the steps after its checkpoint again and the later lines win — and the number of lines
    skipped: torn by a kill mid-write, or not a JSON object with a kind and a numeric step."""
    records, skipped = json_lines(path)
    last: dict = {}
    for rec in records:
        if M.KIND not in rec or not _is_step(rec.get(M.STEP)):
            skipped += 1
        else:
            last[(rec[M.KIND], rec[M.STEP])] = rec
    return sorted(last.values(), key=lambda r: (r[M.STEP], r[M.KIND])), skipped


def json_lines(path: Path) -> tuple[list[dict], int]:
    """(the JSON objects of a JSON-lines file, the number of its other non-empty lines: torn by a kill mid-write)."""
    out, skipped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in filter(str.strip, f):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = None
            if isinstance(rec, dict):
                out.append(rec)
            else:
                skipped += 1
    return out, skipped


def _is_step(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
