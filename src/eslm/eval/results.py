"""The files of ``eslm eval``: where a checkpoint's results go, and writing them with their tables; only files
eslm eval wrote are replaced (``check_output``)."""

from __future__ import annotations

import json
from pathlib import Path

from eslm.errors import ConfigError, OwnershipError
from eslm.eval.tables import checkpoint_table, summary_table
from eslm.files import atomic_write, ensure_dir, read_marker

EVAL_FORMAT = "eslm-eval-v1"


def output_paths(info: dict, out: str | None) -> tuple[Path, Path]:
    """(results JSON, its markdown table): ``--out`` if given, else ``<run>/eval/step_XXXXXXX.json``
    (a checkpoint outside a run: an ``eval/`` folder next to it)."""
    if out:
        j = Path(out)
        return j, j.with_suffix(".md")
    src = Path(info["source"])
    base = Path(info["run_dir"]) if info.get("run_dir") else (src if src.is_dir() else src.parent)
    stem = f"step_{info['step']:07d}" if isinstance(info.get("step"), int) else src.stem
    return base / "eval" / f"{stem}.json", base / "eval" / f"{stem}.md"


def check_output(json_path: Path, md_path: Path) -> None:
    """Refuse (one line), before any evaluation, to replace a results JSON or its markdown that eslm eval did not
    write: the pair may be replaced only when the JSON is an earlier eslm eval result (the markdown beside it
    is then its table)."""
    if json_path.suffix != ".json":
        raise ConfigError(f"expected --out to name a .json file, found {str(json_path)!r}; the table is written "
                          f"beside it as .md: e.g. --out {json_path.with_suffix('.json')}")
    ours = read_marker(json_path, EVAL_FORMAT) is not None
    for p in (json_path, md_path):
        if (p.exists() or p.is_symlink()) and not ours:
            raise OwnershipError(f"{str(p)!r} exists and is not a result eslm eval wrote ({json_path.name} is not "
                                 f"one); eslm replaces only its own results: choose another --out, or move it away")


def write_results(record: dict, json_path: Path, md_path: Path) -> None:
    """The results JSON and its markdown table, each written whole (``atomic_write``: a link there is replaced,
    never followed); the directory is created, never through a link."""
    ensure_dir(json_path.parent)
    atomic_write(json_path, (json.dumps(record, indent=2) + "\n").encode())
    atomic_write(md_path, checkpoint_table(record).encode())


def write_summary(eval_dir: Path) -> Path | None:
    """``eval/summary.md``: every ``eval/*.json`` of a run in one table (accuracy against FLOPs)."""
    records = [r for f in sorted(eval_dir.glob("*.json")) if (r := read_marker(f, EVAL_FORMAT)) is not None]
    if not records:
        return None
    path = eval_dir / "summary.md"
    atomic_write(path, summary_table(records).encode())
    return path
