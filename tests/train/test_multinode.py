"""A run spanning two hosts under plain torchrun, on this machine: two network namespaces joined by a veth pair
are the two hosts (each with its own address; gloo talks over the veth), one process per host. Its losses must
equal those of the same run as two processes on one host (torchrun --standalone): the ranks, the data each rank
reads and the reduction order are the same, so the numbers are bit-identical.

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


@pytest.mark.slow
def test_two_hosts_train_as_one_host_with_two_processes(tiny_data, tmp_path, two_hosts):
    over = {"train.max_steps": 3, "method.name": "eslm-entropy", "method.alpha": 0.3}
    torchrun(["-m", "eslm.cli", "train", *tiny_overrides(tiny_data, tmp_path / "one", **over)])
    args = ["-m", "eslm.cli", "train", *tiny_overrides(tiny_data, tmp_path / "two", **over)]
    procs = [_node(ns, dev, i, args) for i, (ns, dev, _) in enumerate(two_hosts)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert outs[0].count("step 3/3") == 1 and "step 3/3" not in outs[1]  # global rank 0 (host 0) logs alone
    one, two = read_metrics(tmp_path / "one" / "t", "train"), read_metrics(tmp_path / "two" / "t", "train")
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        for key in (M.TRAIN_LOSS, M.TRAIN_LOSS_ALL, M.GRAD_NORM, M.TOKENS_SEEN, M.KEPT_FRAC):
            assert a[key] == b[key], (key, a[key], b[key])
    assert two[-1][M.TOKENS_SEEN] == 3 * 4 * 32 * 2 * 2  # steps x seqs x len x micro-steps x ranks
