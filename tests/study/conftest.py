"""``slurm_cluster``: a single-node SLURM for the tests of the SLURM launcher (tests/study/test_slurm.py).

Skipped, with one line, where ``slurmctld`` is not installed, the user is not root, or submitit is missing
(with ``ESLM_REQUIRE_SLURM=1``, which CI sets after installing SLURM, the first two fail instead).
A running cluster is used as it is (``SLURM_CONF`` set and answering, or the one .ci/slurm-setup started in
``$ESLM_SLURM_DIR``); otherwise the fixture starts one with ``.ci/slurm-setup start`` and stops what it started
at the end of the session (``.ci/slurm-setup stop``: the daemons, by PID)."""

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[2] / ".ci" / "slurm-setup"


@dataclass(frozen=True)
class SlurmCluster:
    conf: str  # SLURM_CONF of the cluster (exported to this process for the session)
    started: bool  # whether this session started it (and stops it)

    def run(self, *cmd: str, check: bool = True) -> str:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if check and out.returncode:
            raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
        return out.stdout


def _answers(conf: str) -> bool:
    env = {**os.environ, "SLURM_CONF": conf}
    try:
        ping = subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return ping.returncode == 0 and "UP" in ping.stdout


@pytest.fixture(scope="session")
def slurm_cluster():
    skip = pytest.fail if os.environ.get("ESLM_REQUIRE_SLURM") == "1" else pytest.skip
    if shutil.which("slurmctld") is None:
        skip("SLURM is not installed (no slurmctld on PATH); bash .ci/slurm-setup install installs it")
    if os.geteuid() != 0:
        skip(f"the single-node SLURM is started as root; this user is uid {os.geteuid()}")
    pytest.importorskip("submitit", reason="the SLURM launcher needs submitit: pip install 'eslm[slurm]'")
    own = str(Path(os.environ.get("ESLM_SLURM_DIR", "/tmp/eslm-slurm")) / "slurm.conf")
    given = os.environ.get("SLURM_CONF")
    conf, started = next(((c, False) for c in (given, own) if c and _answers(c)), (own, True))
    if started:
        out = subprocess.run(["bash", str(SETUP), "start"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f".ci/slurm-setup start failed:\n{out.stdout}\n{out.stderr}"
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield SlurmCluster(conf, started)
    finally:
        if started:
            subprocess.run(["bash", str(SETUP), "stop"], capture_output=True, text=True, timeout=300)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
