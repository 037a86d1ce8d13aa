"""A run spanning two hosts, on this machine: two network namespaces joined by a veth pair are the two hosts
(each with its own address; gloo talks over the veth), one process per host; under plain torchrun, and as the
SLURM launcher's tasks of a two-node job (``RunJob`` in each namespace with the environment SLURM gives a task:
node id, node list, job id). Its losses must equal those of the same run as two processes on one host (torchrun
--standalone): the ranks, the data each rank reads and the reduction order are the same, so the numbers are
bit-identical.

Needs root and iproute2's ``ip`` (network namespaces); skipped elsewhere, a failure where ESLM_REQUIRE_NETNS is
set (CI sets it where it runs as root)."""

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from conftest import read_metrics, tiny_overrides, torchrun
from eslm import metrics as M
from eslm.config import build_config, to_yaml

ADDRS = ("10.213.7.1", "10.213.7.2")  # the two test hosts, inside namespaces this test makes and removes
PORT = "29517"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: [(namespace, interface, address), ...]; removed after."""
    why = ("not root" if os.geteuid() != 0 else "no `ip` (iproute2) on PATH" if shutil.which("ip") is None else None)
    tag = uuid.uuid4().hex[:6]
    hosts = [(f"eslm-{tag}-{i}", f"ve{tag}{i}", a) for i, a in enumerate(ADDRS)]
    if why is None:
        steps = [("netns", "add", hosts[0][0]), ("netns", "add", hosts[1][0]),
                 ("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])]
        for ns, dev, addr in hosts:
            steps += [("link", "set", dev, "netns", ns), ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                      ("-n", ns, "link", "set", dev, "up"), ("-n", ns, "link", "set", "lo", "up")]
        for s in steps:
            r = _ip(*s)
            if r.returncode != 0:
                why = f"`ip {' '.join(s)}` failed: {r.stderr.strip()}"
                break
    if why is not None:
        for ns, _, _ in hosts:
            _ip("netns", "del", ns)
        if os.environ.get("ESLM_REQUIRE_NETNS"):
            pytest.fail(f"two network namespaces are required (ESLM_REQUIRE_NETNS): {why}")
        pytest.skip(f"needs two network namespaces: {why}")
    yield hosts
    for ns, _, _ in hosts:
        _ip("netns", "del", ns)


def _node(ns: str, dev: str, rank: int, args: list[str]) -> subprocess.Popen:
    """One host's torchrun: node ``rank`` of 2, one process, the rendezvous at the first host's address."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": dev}
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
           "--node_rank", str(rank), "--nproc_per_node", "1", "--master_addr", ADDRS[0], "--master_port", PORT,
           *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


OVER = {"train.max_steps": 3, "method.name": "eslm-entropy", "method.alpha": 0.3}


@pytest.fixture(scope="module")
def one_host(tiny_data, tmp_path_factory):
    """The run as two processes on one host: its per-step train records. (Module-scoped: it runs before the
    function-scoped autouse fixture that points eslm's cache at a temporary folder, so it does that itself.)"""
    out = tmp_path_factory.mktemp("one")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ESLM_CACHE_DIR", str(out / "cache"))
        mp.setenv("ESLM_HEAD_COSTS", "shipped")
        torchrun(["-m", "eslm.cli", "train", *tiny_overrides(tiny_data, out, **OVER)])
    return read_metrics(out / "t", "train")


def _wait(procs: list[subprocess.Popen]) -> list[str]:
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    return outs


def _same_run(one: list[dict], run_dir) -> None:
    two = read_metrics(run_dir, "train")
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        for key in (M.TRAIN_LOSS, M.TRAIN_LOSS_ALL, M.GRAD_NORM, M.TOKENS_SEEN, M.KEPT_FRAC):
            assert a[key] == b[key], (key, a[key], b[key])
    assert two[-1][M.TOKENS_SEEN] == 3 * 4 * 32 * 2 * 2  # steps x seqs x len x micro-steps x ranks


@pytest.mark.slow
def test_two_hosts_under_torchrun_train_as_one_host_with_two_processes(tiny_data, tmp_path, two_hosts, one_host):
    args = ["-m", "eslm.cli", "train", *tiny_overrides(tiny_data, tmp_path, **OVER)]
    outs = _wait([_node(ns, dev, i, args) for i, (ns, dev, _) in enumerate(two_hosts)])
    assert outs[0].count("step 3/3") == 1 and "step 3/3" not in outs[1]  # global rank 0 (host 0) logs alone
    _same_run(one_host, tmp_path / "t")


TASK = ("import sys; from eslm.study.slurm import RunJob; "
        "print('task:', RunJob('t', sys.argv[1], sys.argv[2], sys.argv[3], gpus=0, nodes=2)())")


@pytest.mark.slow
def test_a_two_node_slurm_task_trains_as_one_host_with_two_processes(tiny_data, tmp_path, two_hosts, one_host):
    """The SLURM launcher's task of a run with ``nodes: 2``, as SLURM starts it on each node of the job."""
    pytest.importorskip("submitit")
    plan = tmp_path / "plan.yaml"
    plan.write_text(to_yaml(build_config(overrides=tiny_overrides(tiny_data, tmp_path, **OVER))))
    log = tmp_path / "logs" / "t.log"
    log.parent.mkdir()
    procs = []
    for i, (ns, dev, _) in enumerate(two_hosts):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": dev,
               "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": str(i),
               "SLURM_PROCID": str(i), "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": ",".join(ADDRS),
               "SUBMITIT_EXECUTOR": "slurm"}  # (submitit's batch script sets it)
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-c", TASK, str(plan), str(tmp_path / "t"), str(log)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = _wait(procs)
    assert "task: finished" in outs[0]
    _same_run(one_host, tmp_path / "t")
    head = log.read_text().splitlines()[0]  # node 0's output is the run's log, node 1's beside it
    assert "SLURM job 4242" in head and "(node 0 of 2)" in head and "--nnodes=2 --node_rank=0" in head
    assert f"--master_addr={ADDRS[0]}" in head
    assert "(node 1 of 2)" in (log.parent / "t.node1.log").read_text().splitlines()[0]
