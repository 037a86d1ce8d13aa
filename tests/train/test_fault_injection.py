"""Fault injection: a short run SIGKILLed at random points (a step, inside a checkpoint write, inside a metrics
line) several times in a row and resumed each time logs bit for bit what an uninterrupted run logs."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from conftest import tiny_overrides
from eslm import metrics as M
from eslm.train.resume import read_resumes
from eslm.train.run_dir import read_metrics

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
    # line per step plus evaluations; kills past what a process does just let it finish
    kills = [rng.choice([f"step:{rng.randint(1, 3)}", f"save:{rng.randint(1, 4)}", f"metrics:{rng.randint(1, 5)}"])
             for _ in range(4)]
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
    assert not [p for p in (run / "checkpoints").iterdir() if ".tmp." in p.name], msg
    assert not (run / "eslm.lock").exists(), msg
    assert len(read_resumes(run)) == len(history) - 1, msg
