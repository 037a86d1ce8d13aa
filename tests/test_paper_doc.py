"""docs/paper.md: every `torchrun ... eslm.cli train ...` line of its bash blocks resolves and validates.

The bash blocks are run as written (variables, loops) with `torchrun` and `eslm` replaced by shell functions
that only record the arguments; the recorded `eslm train` argument lists are then built with build_config,
which is what `eslm train ... --print-config` does.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from eslm.config import build_config

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "paper.md"

STUBS = r"""
record() { local a; for a in "$@"; do printf '%s\037' "$a"; done >> "$ESLM_DOC_OUT"; printf '\n' >> "$ESLM_DOC_OUT"; }
torchrun() { while [ "$#" -gt 0 ] && [ "$1" != "-m" ]; do shift; done; shift 2; record "$@"; }
eslm() { record "$@"; }
pip() { :; }
sbatch() { local ESLM_DOC_OUT="$ESLM_DOC_OUT.sbatch" w=; while [ "$#" -gt 0 ]; do [ "$1" = --wrap ] && w="$2"; shift; done; eval "$w"; }
srun() { "$@"; }
"""


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_every_paper_command_validates(tmp_path):
    out = tmp_path / "calls.txt"
    out.write_text("")
    Path(f"{out}.sbatch").write_text("")  # the runs of sbatch lines (their --wrap is run: srun torchrun ...)
    script = STUBS + "\n".join(_bash_blocks(DOC.read_text()))
    subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, check=True,
                   env={"PATH": "/usr/bin:/bin", "ESLM_DOC_OUT": str(out)})
    calls = [line.split("\x1f")[:-1] for line in out.read_text().splitlines()]
    trains = [c[1:] for c in calls if c and c[0] == "train"]
    # main grid 27, references 3, Rho-1 4, GREATS 3, alpha 12, batch scaling 2, Ada 2, KD 4
    assert len(trains) == 57
    names = set()
    for args in trains:
        files = [a for a in args if a.endswith(".yaml")]
        overrides = [a for a in args if "=" in a]
        assert len(files) + len(overrides) == len(args), args
        assert all((ROOT / f).is_file() for f in files), files
        cfg = build_config(files, overrides)
        assert cfg.train.grad_accum_steps in (5, 10) and cfg.flops.count_per == "micro"
        assert cfg.train.max_flops > 0 or cfg.method.name == "clm"
        key = (cfg.run.out_dir, cfg.run.name or f"{cfg.method.name}-{cfg.model.preset}-s{cfg.run.seed}")
        assert key not in names, f"two commands write the same run directory {key}"
        names.add(key)
    wrapped = [line.split("\x1f")[:-1] for line in Path(f"{out}.sbatch").read_text().splitlines()]
    assert [c[0] for c in wrapped] == ["train"]  # one sbatch line: one run of the main grid on SLURM
    args = wrapped[0][1:]
    cfg = build_config([a for a in args if a.endswith(".yaml")], [a for a in args if "=" in a])
    assert (cfg.run.out_dir, f"{cfg.method.name}-{cfg.model.preset}-s{cfg.run.seed}") in names
