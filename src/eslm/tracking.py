"""Experiment trackers beyond metrics.jsonl: Weights & Biases (``log.wandb=true``, the ``wandb`` extra). A tracker
is a sink of ``MetricsWriter``: it logs every record's numbers under their metrics.jsonl names at its ``step``. The
W&B run id is kept in ``<run>/wandb_run_id`` so that ``--resume`` continues the same W&B run."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

from eslm import metrics as M
from eslm.errors import ConfigError
from eslm.files import atomic_write


def warn_missing(option: str, package: str, extra: str) -> None:
    """The one line printed when a requested logger's package is not installed."""
    print(f"eslm: warning: {option}=true but {package} is not installed (pip install 'eslm[{extra}]', "
          f"or set {option}=false); not logging to it", file=sys.stderr)


class WandbSink:
    """Logs metrics.jsonl records to one W&B run."""

    def __init__(self, wandb, run):
        self.wandb, self.run = wandb, run

    def log(self, record: dict) -> None:
        nums = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                and k != M.STEP}
        if nums:
            self.run.log(nums, step=int(record.get(M.STEP, 0)))

    def close(self) -> None:
        self.run.finish()


def open_trackers(cfg, run_dir: Path, env: dict) -> list:
    """The sinks the config asks for (main process only); a missing package is one warning line, not an error."""
    if not cfg.log.wandb:
        return []
    try:
        import wandb
    except ImportError:
        warn_missing("log.wandb", "wandb", "wandb")
        return []
    id_file = Path(run_dir) / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(8)

    atomic_write(id_file, (run_id + "\n").encode())
    try:
        run = wandb.init(project=cfg.log.wandb_project, name=cfg.log.wandb_run_name or Path(run_dir).name,
                         id=run_id, resume="allow", dir=str(run_dir), config={**cfg.to_dict(), "env": env})
    except Exception as e:  # not logged in, no network, bad project name: one line, not W&B's traceback
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"expected W&B to start a run (log.wandb=true), found {type(e).__name__}: {first}; "
                          "run 'wandb login', set WANDB_MODE=offline, or set log.wandb=false") from None
    return [WandbSink(wandb, run)]
