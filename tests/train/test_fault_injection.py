"""Fault injection: a short run SIGKILLed at random points (a step, inside a checkpoint write, inside a snapshot
write, inside a metrics line) several times in a row and resumed each time logs bit for bit what an uninterrupted
run logs; so does a run whose disk fills up inside a checkpoint write and inside a snapshot write (a real ENOSPC on
a small tmpfs); a snapshot damaged on disk afterwards is refused in one line that names a good file."""

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import read_metrics, tiny_overrides
from eslm import metrics as M
from eslm.train.resume import read_resumes

RUNNER = Path(__file__).with_name("faulty_eslm.py")
TIME_KEYS = set(M.TIMING_KEYS)  # machine measurements (cpu_s, load average, ...): differ between identical runs
STEPS = 8
COMMON = {"method.name": "ada-eslm-entropy", "train.max_steps": STEPS, "checkpoint.interval": 2,
          "checkpoint.keep_last": 1, "eval.interval": 4, "train.num_threads": 1}


def _run(args, kill: str | None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("ESLM_TEST_KILL", None)
    if kill:
        env["ESLM_TEST_KILL"] = kill
    return subprocess.run([sys.executable, str(RUNNER), "train", *args], env=env, capture_output=True, text=True,
                          timeout=900)


def _comparable(lines):
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in lines]


def test_random_sigkills_then_resumes_log_the_same_run_bit_for_bit(tiny_data, tmp_path):
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    ref = _run(tiny_overrides(tiny_data, tmp_path / "ref", **COMMON), kill=None)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    args = tiny_overrides(tiny_data, tmp_path / "b", **COMMON)
    # each process: at most STEPS steps, 2 atomic writes per checkpoint (the file, then `latest`), ~1 metrics
    # line per step plus evaluations, a snapshot per evaluation; kills past what a process does just let it finish
    kills = [rng.choice([f"step:{rng.randint(1, 3)}", f"save:{rng.randint(1, 4)}", f"metrics:{rng.randint(1, 5)}",
                         f"snap:{rng.randint(1, 2)}"]) for _ in range(4)]
    done, history = False, []
    for i, kill in enumerate(kills + [None]):
        out = _run(args + (["--resume"] if i else []), kill=kill)
        history.append((kill, out.returncode))
        if out.returncode == 0:
            done = True
            break
        assert out.returncode == -9, f"seed {seed}: {history}\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
    msg = f"seed {seed}, kills and exit codes {history}"
    assert done, msg
    run = tmp_path / "b" / "t"
    a, b = read_metrics(tmp_path / "ref" / "t"), read_metrics(run)
    assert _comparable(a) == _comparable(b), msg  # every logged value of every step, train and eval: bitwise
    assert [r[M.STEP] for r in b if r[M.KIND] == M.KIND_TRAIN] == list(range(1, STEPS + 1)), msg
    assert all(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()), msg  # none torn
    assert not [p for d in ("checkpoints", "snapshots") for p in (run / d).iterdir() if ".tmp." in p.name], msg
    assert not (run / "eslm.lock").exists(), msg
    assert len(read_resumes(run)) == len(history) - 1, msg


# Runs inside a private mount namespace: mounts a small tmpfs, trains on it with the disk filled before the
# planned writes (freeing it after each failed process), and copies the run directory out.
_DRIVER = r"""
import json, os, subprocess, sys
mnt, runner, filler, args, plan, out = sys.argv[1], sys.argv[2], sys.argv[3], *map(json.loads, sys.argv[4:6]), sys.argv[6]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", mnt], check=True)
results = []
for i, point in enumerate(plan):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "ESLM_TEST_FILLER": filler}
    env.pop("ESLM_TEST_KILL", None)
    if point:
        env["ESLM_TEST_KILL"] = point
    p = subprocess.run([sys.executable, runner, "train", *args, *(["--resume"] if i else [])], env=env,
                       capture_output=True, text=True, timeout=900)
    results.append([point, p.returncode, p.stderr])
    if os.path.exists(filler):
        os.unlink(filler)
subprocess.run(["cp", "-a", os.path.join(mnt, "runs"), out], check=True)
print(json.dumps(results))
"""


def _private_tmpfs_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


def test_a_full_disk_inside_checkpoint_and_snapshot_writes_then_resume_logs_the_same_run(tiny_data, tmp_path):
    if not _private_tmpfs_works():
        pytest.skip("needs `unshare -Urm` and tmpfs (user namespaces) to give the run a small disk")
    ref = _run(tiny_overrides(tiny_data, tmp_path / "ref", **COMMON), kill=None)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    # process 1: the 3rd atomic write (step 4's checkpoint file, after step 2's file and `latest`) meets the full
    # disk inside torch's zip writer; process 2 (from step 2): its first snapshot (step 4) inside safetensors
    plan = ["fullsave:3", "fullsnap:1", None]
    driver = subprocess.run(["unshare", "-Urm", sys.executable, "-c", _DRIVER, str(mnt), str(RUNNER),
                             str(mnt / "filler"), json.dumps(tiny_overrides(tiny_data, mnt / "runs", **COMMON)),
                             json.dumps(plan), str(tmp_path / "b")], capture_output=True, text=True, timeout=1800)
    assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]
    (full_ckpt, full_snap, last) = json.loads(driver.stdout.strip().splitlines()[-1])
    for (point, code, err), what in ((full_ckpt, "could not write checkpoint"), (full_snap, "could not write snapshot")):
        err = err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (point, err)
        assert what in err and "No space left on device" in err and "free disk space" in err, (point, err)
    assert "step_0000004.pt (No space" in full_ckpt[2] and "step_0000004.safetensors (No space" in full_snap[2]
    assert last[1] == 0, last
    run = tmp_path / "b" / "t"
    assert _comparable(read_metrics(tmp_path / "ref" / "t")) == _comparable(read_metrics(run))
    assert not [p for d in ("checkpoints", "snapshots") for p in (run / d).iterdir() if ".tmp." in p.name]

    # a snapshot damaged on disk afterwards (bit rot, a bad copy): refused in one line naming a good file
    from eslm.cli import main as cli_main

    snap = run / "snapshots" / "step_0000004.safetensors"
    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0x01
    snap.write_bytes(bytes(data))
    for cmd in (["export-hf", str(snap), "--out", str(tmp_path / "hf")], ["sample", str(snap), "--max-new-tokens", "2"]):
        p = subprocess.run([sys.executable, "-m", "eslm.cli", *cmd], capture_output=True, text=True, timeout=600)
        err = p.stderr.strip()
        assert p.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert "step_0000004.safetensors does not match its checksum" in err and "step_0000008" in err, err
    assert cli_main(["sample", str(run), "--max-new-tokens", "2"]) == 0  # the run itself: its latest checkpoint


# ---------------------------------------------------------------- issue 35: what a kill or a damaged file leaves


def test_a_kill_inside_a_snapshot_write_leaves_nothing_after_the_next_start(tiny_data, tmp_path):
    """The process is killed by SIGXFSZ (its default action) when the snapshot it writes outgrows the file-size
    limit: a kill in the middle of the write. The next start removes what it left; nothing but snapshots
    remains (safetensors' own save_file left a .tmpXXXXXX there that no start removed)."""
    import resource
    import signal

    from eslm.model.loading import SNAPSHOT_FILE

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    # Python ignores SIGXFSZ at startup: the child restores its default action (terminate) before eslm runs
    dying = ("import signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_DFL); from eslm.cli import main; "
             "sys.exit(main(sys.argv[1:]))")
    args = tiny_overrides(tiny_data, tmp_path, **{"method.name": "clm", "train.max_steps": 2, "eval.interval": 1,
                                                  "checkpoint.interval": 0, "train.num_threads": 1})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", dying, "train", *args], capture_output=True, text=True,
                            preexec_fn=limit, env=env, timeout=600)
    assert killed.returncode == -signal.SIGXFSZ, killed.stderr[-2000:]
    snaps = tmp_path / "t" / "snapshots"
    assert [p for p in snaps.iterdir() if not SNAPSHOT_FILE.match(p.name)]  # the kill left a partial file
    again = subprocess.run([sys.executable, "-m", "eslm.cli", "train", *args, "--resume"], capture_output=True,
                           text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert sorted(p.name for p in snaps.iterdir()) == ["step_0000001.safetensors", "step_0000002.safetensors"]


def test_eval_all_checkpoints_skips_a_damaged_snapshot_and_evaluates_the_rest(tiny_data, tmp_path, monkeypatch,
                                                                              capsys):
    pytest.importorskip("lm_eval")  # eslm.eval reads lm-eval's version; .ci/lowest installs no eval extra
    from eslm.cli import main as cli_main
    from eslm.config import build_config
    from eslm.eval import command
    from eslm.train.trainer import train

    run = train(build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{
        "method.name": "clm", "train.max_steps": 3, "eval.interval": 1, "checkpoint.interval": 0}))).run_dir
    snap = run / "snapshots" / "step_0000002.safetensors"
    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0x01
    snap.write_bytes(bytes(data))
    monkeypatch.setattr(command, "evaluate", lambda *a, **k: {"t": {
        "num_fewshot": 0, "metric": "acc", "value": 0.5, "stderr": 0.1, "n_samples": 4, "metrics": {}}})
    capsys.readouterr()
    assert cli_main(["eval", str(run), "--all-checkpoints", "--tasks", "t", "--device", "cpu"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "skipped" in err[0] and "step_0000002.safetensors does not match its checksum" in err[0]
    assert sorted(p.name for p in (run / "eval").glob("*.json")) == ["step_0000001.json", "step_0000003.json"]


# ---------------------------------------------------------------- issue 47: no complete checkpoint yet

FIRST = {**COMMON, "train.max_steps": 4, "checkpoint.interval": 2, "eval.interval": 2}  # a snapshot, then a save


def _leftovers(run: Path) -> list[str]:
    return [p.name for d in ("checkpoints", "snapshots") if (run / d).is_dir() for p in (run / d).iterdir()
            if ".tmp." in p.name]


def _final_state(run: Path) -> dict:
    from eslm.train.checkpoint import latest_checkpoint, load_checkpoint

    state = load_checkpoint(latest_checkpoint(run))
    return {"step": state["step"], "model": state["model"], "optimizer": state["optimizer"]["state"]}


def _same_tensors(a, b) -> bool:
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.slow  # 8 processes: 2 min 43 s on this 2-core machine at load 4-8
def test_kills_at_every_point_of_the_first_checkpoint_write_then_resumes_end_bit_for_bit(tiny_data, tmp_path):
    """SIGKILL inside the first checkpoint's write, one process after another, each at another point of it (its
    temporary file empty, half written, complete before its checksum, checksummed before the rename, renamed
    with `latest` half written), then once after the second checkpoint's rename: each --resume starts the run
    again while no checkpoint is complete (removing the temporary files) and continues from the newest complete
    one after; the run ends with the per-step losses and the final weights and optimizer state of an
    uninterrupted run, bit for bit, no temporary file left."""
    ref = _run(tiny_overrides(tiny_data, tmp_path / "ref", **FIRST), kill=None)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    args = tiny_overrides(tiny_data, tmp_path / "b", **FIRST)
    run = tmp_path / "b" / "t"
    ckpts = run / "checkpoints"

    def names():
        return sorted(p.name for p in ckpts.iterdir())

    def tmp_of(name):
        return [n for n in names() if n.startswith(f".{name}.tmp.")]

    # (kill, what it leaves in checkpoints/, its last logged step); the first five inside step 2's checkpoint, the
    # run's first: none leaves a complete checkpoint but the last (the file renamed, `latest` half written)
    first = "step_0000002.pt"
    loop = [
        ("saveopen:1", lambda: names() == tmp_of(first) and (ckpts / tmp_of(first)[0]).stat().st_size == 0, 2),
        ("save:1", lambda: names() == tmp_of(first), 2),
        ("savefull:1", lambda: names() == tmp_of(first), 2),
        ("savesum:1", lambda: set(names()) == {*tmp_of(first), f"{first}.sha256"}, 2),
        ("save:2", lambda: set(names()) == {first, f"{first}.sha256", *tmp_of("latest")} and tmp_of("latest"), 2),
        # resumed from step 2: step 4's file renamed, `latest` not written (the scan finds the newest file)
        ("saved:1", lambda: names() == [first, f"{first}.sha256", "step_0000004.pt", "step_0000004.pt.sha256"], 4),
    ]
    outputs = []
    for i, (kill, leaves, step) in enumerate(loop):
        killed = _run(args + (["--resume"] if i else []), kill=kill)
        outputs.append(killed.stdout)
        assert killed.returncode == -9, (kill, killed.stdout[-2000:] + killed.stderr[-2000:])
        assert leaves(), (kill, names())
        assert max(r[M.STEP] for r in read_metrics(run)) == step, kill
    for out in outputs[1:5]:  # no complete checkpoint: started again, the temporary files removed
        assert "no checkpoint" in out and "starting from step 0" in out and "temporary file(s) of interrupted writes" in out, out
    assert f"checkpoints/{first} at step 2" in outputs[5], outputs[5][-2000:]
    again = _run(args + ["--resume"], kill=None)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "step_0000004.pt at step 4" in again.stdout, again.stdout[-2000:]
    assert _comparable(read_metrics(tmp_path / "ref" / "t")) == _comparable(read_metrics(run))
    assert [r[M.STEP] for r in read_metrics(run, "train")] == [1, 2, 3, 4]
    a, b = _final_state(tmp_path / "ref" / "t"), _final_state(run)
    assert a["step"] == b["step"] == 4 and _same_tensors(a, b)  # the final weights and optimizer state: bitwise
    assert not _leftovers(run), _leftovers(run)
    assert len(read_resumes(run)) == len(loop)


def test_a_full_disk_at_the_first_snapshot_then_resume_starts_again(tiny_data, tmp_path, monkeypatch, capsys):
    """ENOSPC at the first snapshot (before any checkpoint): one line saying to free space and --resume; that
    resume starts the run again and ends as an uninterrupted run."""
    import errno

    import eslm.train.snapshots as snaps
    from eslm.cli import main as cli_main

    args = tiny_overrides(tiny_data, tmp_path / "b", **FIRST)
    real = snaps.atomic_write

    def full(path, write):
        with open(path.with_name(f".{path.name}.tmp.{os.getpid()}"), "wb") as f:
            f.write(b"partial")  # what a real write leaves before ENOSPC; eslm's own temporary name
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snaps, "atomic_write", full)
    assert cli_main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "could not write snapshot" in err and "free disk space" in err and "--resume" in err, err
    run = tmp_path / "b" / "t"
    assert not list((run / "checkpoints").glob("step_*")) and read_metrics(run)
    monkeypatch.setattr(snaps, "atomic_write", real)
    assert cli_main(["train", *args, "--resume"]) == 0, capsys.readouterr().err
    assert max(r[M.STEP] for r in read_metrics(run, "train")) == 4 and (run / "result.json").is_file()
    assert not [p for d in ("checkpoints", "snapshots") for p in (run / d).iterdir() if ".tmp." in p.name]


def test_a_branch_killed_inside_its_first_checkpoint_write_resumes_from_its_branch_point(tiny_data, tmp_path):
    """The same for a branched run (a study's arm): its first save is the first on its interval after the branch
    point; killed inside it, --resume starts the arm again from the trunk's checkpoint, bit for bit."""
    common = {**FIRST, "method.name": "clm", "train.lr_decay_steps": 4, "train.lr_schedule": "steps"}
    trunk = _run(tiny_overrides(tiny_data, tmp_path / "trunk", **{**common, "train.max_steps": 2}), kill=None)
    assert trunk.returncode == 0, trunk.stdout + trunk.stderr
    arm = {**common, "method.name": "eslm-entropy",
           "train.branch_from": str(tmp_path / "trunk" / "t" / "checkpoints" / "step_0000002.pt")}
    ref = _run(tiny_overrides(tiny_data, tmp_path / "ref", **arm), kill=None)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    args = tiny_overrides(tiny_data, tmp_path / "b", **arm)
    killed = _run(args, kill="save:1")  # step 4's checkpoint, the arm's first
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    run = tmp_path / "b" / "t"
    assert max(r[M.STEP] for r in read_metrics(run)) == 4 and not list((run / "checkpoints").glob("step_*"))
    again = _run(args + ["--resume"], kill=None)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "branched from" in again.stdout
    assert _comparable(read_metrics(tmp_path / "ref" / "t")) == _comparable(read_metrics(run))
    assert not [p for p in (run / "checkpoints").iterdir() if ".tmp." in p.name]
