"""The SLURM launcher (eslm.study.slurm): the study file's ``launcher`` section, and tiny studies on a real
single-node SLURM (the ``slurm_cluster`` fixture, tests/study/conftest.py): the runs equal the local launcher's
for the same seeds (losses, FLOPs), a failing run is reported with its log while the others finish, a run
killed by ``scancel`` is resubmitted by the next invocation and resumes, and a requeued run (pre-emption)
resumes bit-exact."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eslm.errors import ConfigError, ESLMError
from eslm.files import atomic_write, new_marker
from eslm.study import STUDY_FORMAT, STUDY_MARKER, run_study, slurm
from eslm.study.launch import launcher_problems
from eslm.study.slurm import RunJob, SchedulerUnreachable, scheduler_states, time_minutes

THREE = "[clm, eslm-entropy, eslm-loss]"
STEPS = 30  # long enough to interrupt a run after its first steps; a tiny run takes ~10-20 s on 2 loaded cores


def _study(tmp_path: Path, data: Path, methods: str = "[clm, eslm-entropy]", launcher: str = "") -> Path:
    f = tmp_path / "tiny.yaml"
    f.write_text(f"""
methods: {methods}
seeds: [1]
{launcher}
config:
  data: {{dir: {data}, tokenizer: byte, seq_len: 32}}
  model: {{preset: tiny}}
  train: {{micro_batch_size_seqs: 4, grad_accum_steps: 1, max_steps: {STEPS}, warmup_steps: 2, lr: 3.0e-3,
          num_threads: 1}}
  eval: {{interval: 10, tokens_per_domain: 256, batch_size_seqs: 4}}
  checkpoint: {{interval: 5}}
  log: {{interval: 1, tensorboard: false}}
""")
    return f


def _records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's training and evaluation records without the fields that measure time or the machine."""
    skip = ("time", "elapsed", "tok_s", "cpu", "load", "wall", "mem", "_s")
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "step" in r:
            out.append({k: v for k, v in r.items() if not any(s in k for s in skip)})
    return out


def _flops(run_dir: Path) -> dict:
    return {k: v for k, v in json.loads((run_dir / "result.json").read_text()).items()
            if k.startswith("flops") or k in ("step", "val_loss", "stopped_by")}


def _same_as_local(run_dir: Path, local_dir: Path) -> None:
    assert _records(run_dir) == _records(local_dir), f"{run_dir.name}: metrics differ from the local launcher's"
    assert _flops(run_dir) == _flops(local_dir), f"{run_dir.name}: result differs from the local launcher's"


def _wait(what: str, cond, timeout: float = 240.0, every: float = 0.5):
    t0 = time.time()
    while time.time() - t0 < timeout:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _jobs(study_dir: Path) -> dict[str, str]:
    return {k: v["job"] for k, v in json.loads((study_dir / "slurm" / "jobs.json").read_text())["runs"].items()}


def _steps(run_dir: Path) -> int:
    try:
        return sum('"kind": "train"' in line for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _hold(run_dir: Path) -> int:
    """Stops the run's ``eslm train`` process (its PID from the run directory's lock) with SIGSTOP, so that it
    cannot finish before the interruption the test sends reaches it: on an idle machine a tiny run does its 30
    steps in about a second, less than SLURM takes to deliver a signal."""
    pid = json.loads((run_dir / "eslm.lock").read_text())["pid"]
    os.kill(pid, signal.SIGSTOP)
    return pid


def _hold_when_started(*run_dirs: Path, steps: int = 4) -> dict[str, int]:
    """Holds each run (``_hold``) as soon as it has logged ``steps`` training steps, all of them in one polling
    loop: the runs train at the same time, and one left running while another is handled could finish first."""
    held: dict[str, int] = {}

    def all_held():
        for d in run_dirs:
            if d.name not in held and _steps(d) >= steps:
                assert not (d / "result.json").exists(), f"{d.name} finished before it could be held"
                held[d.name] = _hold(d)
        return len(held) == len(run_dirs)

    _wait(f"the first steps of {', '.join(d.name for d in run_dirs)}", all_held, every=0.02)
    return held


def _release_when_signalled(pid: int, timeout: float = 60.0) -> None:
    """Continues a process held by ``_hold`` once SIGTERM is pending for it (or SLURM has continued it itself):
    it then stops after the step it was in, with its checkpoint, as a real pre-emption or cancellation does."""

    def signalled():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return True  # gone: nothing to hold
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
        return bool(pending & (1 << (signal.SIGTERM - 1))) or not fields["State"].strip().startswith("T")

    try:
        _wait(f"SIGTERM pending for PID {pid}", signalled, timeout=timeout, every=0.05)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _squeue_state(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-r", "-o", "%i %T", "-j", job.split("_")[0]], capture_output=True,
                         text=True).stdout
    return next((line.split()[1] for line in out.splitlines() if line.split()[0] == job), "")


def _sacct_state(job: str) -> str:
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", job], capture_output=True,
                         text=True).stdout
    return next((line.split("|")[1] for line in out.splitlines() if line.split("|")[0] == job), "")


@pytest.fixture(scope="module")
def local_runs(tiny_data, tmp_path_factory) -> Path:
    """The tiny study trained by the local launcher (in this process): the reference every SLURM run must equal."""
    tmp = tmp_path_factory.mktemp("local")
    assert run_study(str(_study(tmp, tiny_data, methods=THREE)), tmp / "out") == 0
    return tmp / "out" / "tiny"


# ---------------------------------------------------------------- the launcher section (no cluster needed)

def test_time_limits_read_as_minutes():
    assert [time_minutes(v) for v in (90, "01:30:00", "1-00:00:00", "00:00:30", "10:00")] == [90, 90, 1440, 1, 600]
    assert [time_minutes(v) for v in (0, -5, "1h", "1:2:3:4", True, 1.5)] == [None] * 6


def test_launcher_section_mistakes_are_each_one_line():
    assert launcher_problems(None) == [] and launcher_problems({"name": "slurm", "partition": "gpu", "time": "4:00:00",
                                                                "cpus_per_run": 8, "gpus_per_run": 4, "mem_gb": 64,
                                                                "parallel": 2, "sbatch": {"account": "abc"}}) == []
    problems = launcher_problems({"name": "slurm", "time": "1h", "cpus_per_run": 0, "gpus_per_run": -1, "mem_gb": 0,
                                  "parallel": 1.5, "sbatch": {"array": "0-3", "qos": None}, "num_nodes": 2})
    text = "\n".join(problems)
    for part in ("unknown key(s) 'num_nodes' for the slurm launcher",
                 "launcher.time: expected a time limit", "launcher.cpus_per_run: expected an integer >= 1",
                 "launcher.gpus_per_run: expected an integer >= 0", "launcher.mem_gb: expected a positive",
                 "launcher.parallel: expected an integer >= 1", "--array is set by the launcher; set launcher.parallel",
                 "launcher.sbatch.qos: expected a value"):
        assert part in text, part
    assert len(problems) == 8
    assert launcher_problems({"name": "k8s", "time": "1h"}) == ["launcher.name: expected one of local, slurm, "
                                                                "found 'k8s'"]
    assert launcher_problems(["slurm"])[0].startswith("launcher: expected a mapping")


def test_study_file_launcher_problems_refuse_the_study(tmp_path, tiny_data):
    f = _study(tmp_path, tiny_data, launcher="launcher: {name: slurm, time: soon}")
    with pytest.raises(ConfigError, match="launcher.time: expected a time limit"):
        run_study(str(f), tmp_path / "out", dry_run=True)


def test_detach_needs_a_launcher_whose_runs_outlive_the_study(tmp_path, tiny_data):
    f = _study(tmp_path, tiny_data)
    with pytest.raises(ConfigError, match="--detach applies to a launcher whose runs outlive the study's process"):
        run_study(str(f), tmp_path / "out", detach=True)
    with pytest.raises(ConfigError, match="--launcher: expected one of local, slurm, found 'k8s'"):
        run_study(str(f), tmp_path / "out", launcher="k8s")


def _fake_commands(tmp_path: Path, monkeypatch, **scripts: str) -> None:
    """Put shell scripts named after SLURM's commands first on PATH (``sbatch="exec sleep 60"``)."""
    bin_dir = tmp_path / "fake-slurm"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_non_utf8_bytes_from_squeue_are_read_not_a_traceback(tmp_path, monkeypatch):
    _fake_commands(tmp_path, monkeypatch, squeue=r"printf '7_0|RUNNING\n\377\376|PENDING\n'")
    assert scheduler_states(["7_0"]) == {"7_0": "RUNNING"}
    _fake_commands(tmp_path, monkeypatch, squeue=r"printf 'slurm_load_jobs error: \377 down\n' >&2; exit 1")
    with pytest.raises(SchedulerUnreachable, match="squeue: slurm_load_jobs error: \ufffd down"):
        scheduler_states(["7_0"])


def test_a_hanging_squeue_is_stopped_with_one_line(tmp_path, monkeypatch):
    _fake_commands(tmp_path, monkeypatch, squeue="exec sleep 60")
    monkeypatch.setattr(slurm, "SCHEDULER_TIMEOUT_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(SchedulerUnreachable, match=r"could not ask SLURM for the study's jobs \(squeue: gave no "
                                                    r"answer in 1 s\)"):
        scheduler_states(["7_0"])
    assert time.monotonic() - t0 < 30


def test_a_hanging_sbatch_is_stopped_with_one_line(tmp_path, tiny_data, monkeypatch):
    pytest.importorskip("submitit")
    _fake_commands(tmp_path, monkeypatch, srun="exit 0", sbatch="exec sleep 60")
    monkeypatch.setattr(slurm, "SCHEDULER_TIMEOUT_S", 2.0)
    t0 = time.monotonic()
    with pytest.raises(ESLMError, match=r"study tiny: sbatch gave no answer in 2 s and was stopped .* if squeue -n "
                                        r"eslm-tiny lists a job, it was submitted unrecorded: scancel it"):
        run_study(str(_study(tmp_path, tiny_data)), tmp_path / "out", launcher="slurm")
    assert time.monotonic() - t0 < 60
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # the alarm is off again
    assert not (tmp_path / "out" / "tiny" / "slurm" / "jobs.json").exists()  # nothing recorded as submitted


def test_without_submitit_or_slurm_commands_one_line_says_what_is_missing(tmp_path, tiny_data, monkeypatch):
    f = _study(tmp_path, tiny_data)
    monkeypatch.setitem(sys.modules, "submitit", None)  # not installed
    with pytest.raises(ConfigError, match=r"needs submitit, which is not installed; install it with pip install "
                                          r"'eslm\[slurm\]'"):
        run_study(str(f), tmp_path / "out", launcher="slurm")
    monkeypatch.delitem(sys.modules, "submitit")
    pytest.importorskip("submitit")
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    with pytest.raises(ESLMError, match=r"needs SLURM's commands \(sbatch, squeue, srun\) on PATH"):
        run_study(str(f), tmp_path / "out", launcher="slurm")
    # a study with a job on record whose state squeue cannot tell is not submitted again
    jobs = tmp_path / "out" / "tiny" / "slurm" / "jobs.json"
    jobs.parent.mkdir()
    jobs.write_text(json.dumps({"format": "eslm-slurm-jobs", "runs": {"clm-s1": {"job": "7_0"}}}))
    with pytest.raises(ESLMError, match=r"could not ask SLURM for the study's jobs \(squeue: did not run\)"):
        run_study(str(f), tmp_path / "out", launcher="slurm")
    assert not (tmp_path / "out" / "tiny" / "plan" / "clm-s1.yaml").exists()  # nothing was submitted


def test_a_run_of_several_gpus_runs_under_torchrun_one_process_per_gpu():
    job = RunJob("r", "/s/plan/r.yaml", "/s/r", "/s/logs/r.log", gpus=4)
    assert job.command(resume=True)[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m",
                                            "eslm.cli", "train", "/s/plan/r.yaml", "run.resume=true"]
    assert RunJob("r", "/s/plan/r.yaml", "/s/r", "/s/logs/r.log", gpus=1).command(False)[1:] == [
        "-m", "eslm.cli", "train", "/s/plan/r.yaml"]


def test_a_run_of_several_nodes_runs_torchrun_as_one_node_of_the_job():
    job = RunJob("r", "/s/plan/r.yaml", "/s/r", "/s/logs/r.log", gpus=8, nodes=4)
    assert job.command(False, node_rank=2, master="gpu-a17", port=23456)[1:] == [
        "-m", "torch.distributed.run", "--nnodes=4", "--node_rank=2", "--nproc_per_node=8", "--master_addr=gpu-a17",
        "--master_port=23456", "-m", "eslm.cli", "train", "/s/plan/r.yaml"]
    cpu = RunJob("r", "/s/plan/r.yaml", "/s/r", "/s/logs/r.log", gpus=0, nodes=2).command(True, 1, "h", 1)
    assert "--nproc_per_node=1" in cpu and cpu[-1] == "run.resume=true"
    assert launcher_problems({"name": "slurm", "nodes": 0}) == ["launcher.nodes: expected an integer >= 1, found 0"]
    assert launcher_problems({"name": "slurm", "nodes": 2}) == []
    assert "ntasks-per-node" in launcher_problems({"name": "slurm", "sbatch": {"ntasks-per-node": 2}})[0]


# ---------------------------------------------------------------- on a real single-node SLURM

@pytest.mark.slow
def test_slurm_runs_equal_local_runs_and_a_failing_run_is_reported(slurm_cluster, tiny_data, local_runs, tmp_path,
                                                                   capsys):
    # the failing run first: it fails within seconds and frees its slot (the node runs 2 one-CPU runs at once)
    f = _study(tmp_path, tiny_data, methods="[eslm-loss, clm, eslm-entropy]", launcher="launcher: {parallel: 2}")
    # an earlier study of eslm's (its marker) whose eslm-loss-s1 is not a run directory eslm can resume: that run fails
    study_dir = tmp_path / "out" / "tiny"
    study_dir.mkdir(parents=True)
    atomic_write(study_dir / STUDY_MARKER, (json.dumps(new_marker(STUDY_FORMAT)) + "\n").encode())
    broken = study_dir / "eslm-loss-s1"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text("not json\n")
    code = run_study(str(f), tmp_path / "out", launcher="slurm")
    out, err = capsys.readouterr()
    assert code == 1
    log = tmp_path / "out" / "tiny" / "logs" / "eslm-loss-s1.log"
    assert "eslm-loss-s1: failed (job " in err and f"log: {log.resolve()}" in err, err
    assert log.is_file() and "SLURM job" in log.read_text()
    study_dir = tmp_path / "out" / "tiny"
    jobs = _jobs(study_dir)
    assert len({j.split("_")[0] for j in jobs.values()}) == 1, f"expected one array job, found {jobs}"
    names = subprocess.run(["sacct", "-n", "-P", "-X", "-o", "JobID,JobName", "-j", jobs["clm-s1"].split("_")[0]],
                           capture_output=True, text=True).stdout
    assert f"{jobs['clm-s1']}|clm-s1" in names.splitlines(), names  # squeue and sacct show run names
    for name in ("clm-s1", "eslm-entropy-s1"):
        _same_as_local(study_dir / name, local_runs / name)
    assert not (study_dir / "report").exists()


@pytest.mark.slow
def test_scancel_requeue_and_time_limit_resume_bit_exact_and_the_same_command_resubmits_only_the_cancelled(
        slurm_cluster, tiny_data, local_runs, tmp_path, capsys):
    f = _study(tmp_path, tiny_data, methods=THREE, launcher="launcher: {parallel: 2}")
    study_dir = tmp_path / "out" / "tiny"
    assert run_study(str(f), tmp_path / "out", launcher="slurm", detach=True) == 0
    jobs = _jobs(study_dir)
    cancelled, requeued, timed = jobs["clm-s1"], jobs["eslm-entropy-s1"], jobs["eslm-loss-s1"]
    # each run is interrupted after its first steps (SIGTERM reaches it: a checkpoint after the step), held
    # still from its 4th step until the signal is pending (_hold), so that it cannot finish first, by
    pids = _hold_when_started(study_dir / "clm-s1", study_dir / "eslm-entropy-s1")  # the first two, together
    slurm_cluster.run("scancel", cancelled)  # ... scancel: it stays stopped
    _release_when_signalled(pids["clm-s1"])
    slurm_cluster.run("scontrol", "requeue", requeued)  # ... a pre-emption (PreemptMode=REQUEUE does this)
    _release_when_signalled(pids["eslm-entropy-s1"])
    pids = _hold_when_started(study_dir / "eslm-loss-s1")  # it starts in clm-s1's slot
    slurm_cluster.run("scancel", "--signal=USR2", timed)  # ... the time limit's warning (--signal=USR2@90)
    _release_when_signalled(pids["eslm-loss-s1"])
    for job in (requeued, timed):  # requeued, each held back by SLURM (BeginTime, 120 s)
        _wait(f"job {job} requeued, pending", lambda job=job: _squeue_state(job) == "PENDING")
    _wait("the cancelled job over", lambda: not _squeue_state(cancelled)
          and _sacct_state(cancelled).startswith("CANCELLED"))
    capsys.readouterr()

    assert run_study(str(f), tmp_path / "out", launcher="slurm", status=True) == 0
    out = capsys.readouterr().out
    assert re.search(rf"clm-s1 +step \d+ +cancelled \(job {cancelled}\); the same command resubmits it", out), out
    for name, job in (("eslm-entropy-s1", requeued), ("eslm-loss-s1", timed)):
        assert re.search(rf"{name} +step \d+ +queued \(pending\) \(job {job}\)", out), out

    def release():  # once the command below has seen them queued: start them now, not in 120 s
        for job in (requeued, timed):
            slurm_cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")

    timer = threading.Timer(3.0, release)
    timer.start()
    try:
        assert run_study(str(f), tmp_path / "out", launcher="slurm") == 0
    finally:
        timer.join()
    out = capsys.readouterr().out
    assert "submitted 1 run(s)" in out, out
    for name, job in (("eslm-entropy-s1", requeued), ("eslm-loss-s1", timed)):
        assert f"{name}: queued or running already (job {job}), not submitted again" in out, out
    assert _jobs(study_dir)["clm-s1"] != cancelled
    assert (_jobs(study_dir)["eslm-entropy-s1"], _jobs(study_dir)["eslm-loss-s1"]) == (requeued, timed)
    for name in ("clm-s1", "eslm-entropy-s1", "eslm-loss-s1"):
        log = (study_dir / "logs" / f"{name}.log").read_text()
        assert "SIGTERM: saving a checkpoint" in log and "(resuming)" in log, f"{name} did not resume:\n{log[-2000:]}"
        _same_as_local(study_dir / name, local_runs / name)  # bit-exact after the interruption
    assert (study_dir / "report" / "summary.json").is_file()
