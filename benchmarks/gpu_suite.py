"""One command that validates, measures and reports the CUDA path (issues 13 and 32), in 17 minutes on one GPU.

    PYTHONPATH=src python benchmarks/gpu_suite.py --out DIR [--device cuda] [--preset gpt2-124m] [--data DIR]
        [--bundle FILE.tar.gz] [--skip STEP ...] [--budget-s SECONDS]

Steps, in order, the measurements first. Every step runs in a child process (group) of its own with its own
time limit (``PRESETS[...]["limits"]``, capped by what is left of ``--budget-s``), so a hang or a crash costs
that step only. Each writes DIR/<n>-<step>.json and .md the moment it ends, and DIR/summary.{json,md} is
rewritten after every step (with ``--bundle``, so is a .tar.gz of DIR), so a time-out leaves what finished:

1. ``env``: GPU name, torch / CUDA versions, the peak bf16 TFLOP/s of a large matmul (8192^3 on CUDA, its
   tensors made on the device); it is the MFU denominator only for a GPU the trainer's peak table lacks (and in
   the CPU smoke mode);
2. ``loss_path``: ``benchmarks/loss_path.py`` at 124M, 12 x 1024 tokens, bf16 autocast: CLM naive / fused,
   ESLM-entropy naive / fused on the chooser's route / fused with each head route forced, ESLM-loss fused at
   alpha 0.1, 0.2, 0.5 (and the triton backend where it is available): step time (CUDA events), peak memory
   (torch.cuda.max_memory_allocated), tokens/s, MFU, selection cost, the route each ran;
3. ``profile``: ``torch.profiler`` over a few real training steps (``Trainer``'s step) of CLM and ESLM-entropy
   at alpha 0.2: the top ops by device time, tables in DIR/3-profile/;
4. ``loss_path_compile``: the loss path with torch.compile, trimmed to what compiling changes (the trunk):
   CLM and ESLM at alpha 0.2 on the chooser's route, no forced routes (on CPU only with --compile yes);
5. ``pytest``: ``pytest -m gpu`` (fused head vs the oracle, one step of every method, no host sync in the
   selection), its output in DIR/5-pytest.log;
6. ``train_clm``, 7. ``train_eslm_entropy``: the real ``eslm train`` command with a config written to DIR
   (a few hundred 124M steps on the built-in corpus, eager, bf16): progress lines with MFU in DIR/<n>-*.log,
   metrics.jsonl and result.json copied into DIR, first / last loss and MFU in the step's JSON.

The summary checks the issue's targets: 124M CLM fused >= 45% MFU; ESLM-entropy fused / CLM fused step time
<= 1.02 at alpha 0.1 and < 1.0 at alpha 0.5; fused / naive peak memory <= 0.5; selection <= 2% of the step.

The GPU machine has no internet, so the built-in corpus travels with the working tree. Here, once:

    ESLM_DATA_DIR= PYTHONPATH=src python -m eslm.cli prepare stdlib --out data/stdlib-gpt2   # ~13 MB

``/data/`` is git-ignored: copy it to the GPU machine beside the working tree, and run there:

    PYTHONPATH=src PYTHONUNBUFFERED=1 python benchmarks/gpu_suite.py --out /tmp/gpu_suite \\
        --bundle $OUT/gpu_suite.tar.gz 2>&1 | tee $OUT/gpu_suite.log

(a bundle is one file to bring back). ``--data`` defaults to data/stdlib-gpt2, then
$ESLM_DATA_DIR/stdlib-gpt2. Smoke mode, seconds on a CPU (the test suite runs it; tiny shapes, few steps, fp32,
no forced head routes in the loss path, no compile unless --compile yes):

    PYTHONPATH=src python benchmarks/gpu_suite.py --out /tmp/smoke --device cpu --preset tiny --data DIR

Without a CUDA device, ``--device cuda`` (the default) exits at once with one line and status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this tree's eslm, as the subprocesses get it (PYTHONPATH below)
STEPS = ("env", "loss_path", "profile", "loss_path_compile", "pytest", "train_clm",
         "train_eslm_entropy")
CHILD_STEPS = ("env", "profile")  # run by this script in a child process of their own

# per preset: shapes, rounds, training length, each step's own time limit and the total (s; the total wins).
# routes: the head routes the loss path forces as extra variants (None: all; the tiny smoke none: the test suite
# runs loss_path.py's forced routes in a smoke of its own, tests/test_benchmarks.py).
# The tiny smoke's limits only guard against a hang: a loaded 2-core CI box can be 20x slower than an idle one.
PRESETS = {
    "gpt2-124m": dict(seq_len=1024, micro_batch=12, matmul_n=8192, bench_steps=10, bench_warmup=3, train_steps=300,
                      log_interval=25, eval_tokens=4096, budget_s=1020, alphas=("0.1", "0.2", "0.5"), memory=True,
                      profile_steps=3, routes=None,
                      limits=dict(env=60, loss_path=150, profile=120, loss_path_compile=180,
                                  pytest=180, train=120)),
    "tiny": dict(seq_len=16, micro_batch=2, matmul_n=256, bench_steps=1, bench_warmup=0, train_steps=8,
                 log_interval=2, eval_tokens=256, budget_s=3600, alphas=("0.1", "0.5"), memory=False,
                 profile_steps=1, routes=(),
                 limits=dict(env=600, loss_path=600, profile=600, loss_path_compile=900,
                             pytest=600, train=600)),
}

TARGETS = {  # issue 13's targets on an H100 / H200
    "clm_fused_mfu": (">=", 0.45), "eslm_entropy_vs_clm_fused_time@0.1": ("<=", 1.02),
    "eslm_entropy_vs_clm_fused_time@0.5": ("<", 1.0), "fused_vs_naive_peak_memory": ("<=", 0.5),
    "selection_fraction_of_step": ("<=", 0.02),
    # the same targets on the triton backend, what train.loss_impl=auto runs on CUDA (issue 32's backend)
    "clm_triton_mfu": (">=", 0.45), "eslm_entropy_vs_clm_triton_time@0.1": ("<=", 1.02),
    "eslm_entropy_vs_clm_triton_time@0.5": ("<", 1.0), "triton_vs_naive_peak_memory": ("<=", 0.5),
}


class SuiteError(Exception):
    """A user mistake found before any step ran: one line, exit status 2."""


# ----------------------------------------------------------------------------------------------- output


class Report:
    """DIR/<n>-<step>.{json,md} per step, DIR/summary.{json,md} after each, and the optional bundle."""

    def __init__(self, out: Path, bundle: Path | None, argv: list[str]):
        self.out, self.bundle = out, bundle
        self.summary = {"command": "python benchmarks/gpu_suite.py " + " ".join(argv), "steps": []}

    def path(self, n: int, step: str, suffix: str) -> Path:
        return self.out / f"{n}-{step}{suffix}"

    def write_step(self, n: int, step: str, record: dict, md: list[str]) -> None:
        self.path(n, step, ".json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        self.path(n, step, ".md").write_text("\n".join([f"# {n}. {step}: {record['status']}", ""] + md) + "\n")
        self.summary["steps"].append({k: v for k, v in record.items() if k in ("step", "status", "wall_s", "note")})
        for key in ("environment", "targets"):
            if key in record:
                self.summary.setdefault(key, {}).update(record[key])
        self.flush()

    def flush(self) -> None:
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=2, default=str) + "\n")
        (self.out / "summary.md").write_text("\n".join(summary_md(self.summary)) + "\n")
        if self.bundle is not None:
            tmp = self.bundle.with_name(self.bundle.name + ".tmp")
            with tarfile.open(tmp, "w:gz") as tar:
                tar.add(self.out, arcname=self.out.name)
            os.replace(tmp, self.bundle)


def summary_md(s: dict) -> list[str]:
    lines = ["# GPU suite summary", "", f"Command: `{s['command']}`", "", "| step | status | wall s | note |",
             "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['status']} | {r.get('wall_s', 0):.1f} | {r.get('note', '')} |" for r in s["steps"]]
    if s.get("environment"):
        lines += ["", "Environment: " + ", ".join(f"{k} {v}" for k, v in s["environment"].items())]
    if s.get("targets"):
        lines += ["", "| target | value | goal | met |", "|---|---|---|---|"]
        for name, t in s["targets"].items():
            value = "n/a" if t["value"] is None else f"{t['value']:.4g}"
            lines.append(f"| {name} | {value} | {t['goal']} | {t['met']} |")
    return lines


# ----------------------------------------------------------------------------------------------- subprocesses


_CHILD: list = []  # the running step's process: its group is killed if the suite itself is stopped


def _stop(signum, frame):
    for proc in _CHILD:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(128 + signum)


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int | None, float]:
    """Run ``cmd`` in ROOT with its stdout + stderr in ``log``, in its own process group (in this session), which
    is killed after ``timeout`` seconds, compile workers included. Returns (exit status, None on time-out;
    wall seconds)."""
    t0 = time.perf_counter()
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=f, stderr=subprocess.STDOUT,
                                preexec_fn=os.setpgrp)
        _CHILD.append(proc)
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        finally:
            _CHILD.remove(proc)
    return rc, time.perf_counter() - t0


def status_of(rc: int | None) -> str:
    return "ok" if rc == 0 else ("timeout" if rc is None else f"failed (exit {rc})")


def tail(path: Path, n: int = 15) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-n:] if path.exists() else []


# ----------------------------------------------------------------------------------------------- steps


def child_env(a) -> dict:
    """(In the child.) Versions, the device, and the peak matmul rate in the suite's precision (bf16 on CUDA)."""
    import platform

    import torch

    dev = torch.device(a.device)
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "device": a.device}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   sms=p.multi_processor_count, cudnn=torch.backends.cudnn.version())
        smi = shutil.which("nvidia-smi")
        if smi:
            q = subprocess.run([smi, "--query-gpu=driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            env["nvidia_smi"] = q.stdout.strip()
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    tflops = matmul_tflops(dev, a.matmul_n, a.dtype)
    env.update(matmul_tflops=float(f"{tflops:.4g}"), matmul=f"{a.matmul_n}^3 {a.dtype}")
    return env


def run_child(ctx, step: str, args: list[str], env: dict | None = None) -> tuple[dict, int | None, float, Path]:
    """This script's ``--child STEP`` in its own process (group) with the step's time limit: (what it wrote,
    exit status or None on time-out, wall seconds, its log)."""
    out = ctx.report.path(ctx.n, step, "-child.json")
    log = ctx.report.path(ctx.n, step, ".log")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", step, "--child-out", str(out),
           "--device", ctx.device, "--dtype", ctx.dtype, *args]
    rc, wall = run_logged(cmd, log, ctx.limit(step), env=env)
    got = json.loads(out.read_text()) if rc == 0 and out.exists() else {}
    out.unlink(missing_ok=True)
    return got, rc, wall, log


def step_env(ctx) -> tuple[dict, list[str]]:
    env, rc, wall, log = run_child(ctx, "env", ["--matmul-n", str(ctx.cfg["matmul_n"])])
    if rc != 0:
        return {"status": status_of(rc), "returncode": rc, "log": log.name}, ["```", *tail(log), "```"]
    ctx.matmul_peak = env["matmul_tflops"] * 1e12
    return {"environment": env}, [f"- {k}: {v}" for k, v in env.items()] + [f"({wall:.0f} s)"]


def matmul_tflops(dev, n: int, dtype: str, reps: int = 10) -> float:
    """TFLOP/s of an (n x n) @ (n x n) product in ``dtype`` (bf16 | fp32) on ``dev`` (random data; 2 n^3 FLOPs
    each), the median of ``reps`` after 3 warm-ups."""
    import torch

    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    a, b = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
    times = []
    for i in range(3 + reps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        a @ b
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e12


_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)")


def step_pytest(ctx) -> tuple[dict, list[str]]:
    log = ctx.report.path(ctx.n, "pytest", ".log")
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", *ctx.tests]
    rc, wall = run_logged(cmd, log, ctx.limit("pytest"))
    last = tail(log, 1)
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(k)
              for k, kind in _PYTEST_COUNT.findall(last[0] if last else "")}
    rec = {"status": status_of(rc) if rc != 5 else "no tests collected", "returncode": rc, "counts": counts,
           "command": " ".join(cmd[1:]), "log": log.name, "note": ", ".join(f"{v} {k}" for k, v in counts.items())}
    if ctx.device.startswith("cuda") and counts.get("skipped"):
        rec["note"] += " (skips on a CUDA machine: see the log)"
    return rec, [f"`python {rec['command']}` (exit {rc}, {wall:.0f} s), output in {log.name}:", "", "```",
                 *tail(log), "```"]


def step_loss_path(ctx, compile: bool) -> tuple[dict, list[str]]:
    name = "loss_path_compile" if compile else "loss_path"
    c = ctx.cfg
    # compiled, only the trunk differs (the head's code is the same): CLM and ESLM at alpha 0.2 on the chooser's
    # route, no forced routes and one alpha
    alphas, routes = (["0.2"], ["--routes"]) if compile else (
        list(c["alphas"]), [] if c["routes"] is None else ["--routes", *c["routes"]])
    cmd = [sys.executable, "benchmarks/loss_path.py", "--preset", ctx.preset, "--seq-len", str(c["seq_len"]),
           "--micro-batch", str(c["micro_batch"]), "--device", ctx.device, "--dtype", ctx.dtype,
           "--steps", str(c["bench_steps"]), "--warmup", str(c["bench_warmup"] + (1 if compile else 0)),
           "--alphas", *alphas, *routes, "--name", f"{ctx.n}-{name}"]
    if not c["memory"]:
        cmd.append("--no-cpu-memory")
    if compile:
        cmd.append("--compile")
    if ctx.peak_flops_arg():
        cmd += ["--peak-flops", str(ctx.peak_flops_arg())]
    log = ctx.report.path(ctx.n, name, ".log")
    rc, wall = run_logged(cmd, log, ctx.limit(name), env={"ESLM_BENCH_RESULTS": str(ctx.out)})
    rec = {"status": status_of(rc), "returncode": rc, "command": " ".join(cmd[1:]), "log": log.name}
    result = ctx.report.path(ctx.n, name, ".json")  # written by loss_path.py; this step's record goes beside it
    if rc == 0 and result.exists():
        bench = json.loads(result.read_text())
        result.rename(ctx.report.path(ctx.n, name, "-bench.json"))
        ctx.report.path(ctx.n, name, ".md").rename(ctx.report.path(ctx.n, name, "-bench.md"))
        rec["targets"] = {f"{k}{' (compile)' if compile else ''}": v for k, v in loss_path_targets(bench).items()}
        rec["rows"] = {r["variant"]: {k: r[k] for k in ("step_s", "tokens_per_s", "mfu", "peak_bytes",
                                                         "time_vs_clm_fused", "mem_vs_naive_twin")}
                       for r in bench["rows"]}
        rec["note"] = ", ".join(f"{k} {fmt(v['value'])}" for k, v in list(rec["targets"].items())[:3])
    md = [f"`python {rec['command']}` (exit {rc}, {wall:.0f} s); full table in {ctx.n}-{name}-bench.md", ""]
    md += [f"- {k}: {fmt(v['value'])} (goal {v['goal']}: {v['met']})" for k, v in rec.get("targets", {}).items()]
    return rec, md + ["", "```", *tail(log), "```"]


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def loss_path_targets(bench: dict) -> dict:
    """The issue's targets from one loss_path result (ratios measured in that one run)."""
    rows = {r["variant"]: r for r in bench["rows"]}
    over = bench["selection_overhead"]
    time_at = lambda a: rows.get(f"eslm-entropy-fused@{a}", {}).get("time_vs_clm_fused")  # noqa: E731
    values = {
        "clm_fused_mfu": rows["clm-fused"]["mfu"],
        "eslm_entropy_vs_clm_fused_time@0.1": time_at(0.1),  # None where the step ran another alpha (compile)
        "eslm_entropy_vs_clm_fused_time@0.5": time_at(0.5),
        # the worst of the fused methods against their naive twins (CLM, ESLM-entropy at every alpha)
        "fused_vs_naive_peak_memory": _max([rows["clm-fused"]["mem_vs_clm_naive"]] +
                                           [r["mem_vs_naive_twin"] for v, r in rows.items()
                                            if v.startswith("eslm-entropy-fused@")]),
        "selection_fraction_of_step": _max([o["fraction_of_clm_fused_step"] for o in over.values()]),
    }
    if "clm-triton" in rows:  # a CUDA device with the gpu extra: the backend that auto picks there
        clm = rows["clm-triton"]
        ratio = lambda a: (rows[f"eslm-entropy-triton@{a}"]["step_s"] / clm["step_s"]  # noqa: E731
                           if f"eslm-entropy-triton@{a}" in rows else None)
        values.update({
            "clm_triton_mfu": clm["mfu"],
            "eslm_entropy_vs_clm_triton_time@0.1": ratio(0.1), "eslm_entropy_vs_clm_triton_time@0.5": ratio(0.5),
            "triton_vs_naive_peak_memory": _max([clm["mem_vs_clm_naive"]] + [
                r["peak_bytes"] / rows[v.replace("-triton@", "-naive@")]["peak_bytes"] for v, r in rows.items()
                if v.startswith("eslm-entropy-triton@") and v.replace("-triton@", "-naive@") in rows]),
        })
    return {k: check(k, v) for k, v in values.items()}


def _max(xs):
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def check(name: str, value) -> dict:
    op, goal = TARGETS[name]
    met = None if value is None else {">=": value >= goal, "<=": value <= goal, "<": value < goal}[op]
    return {"value": value, "goal": f"{op} {goal}", "met": met}


def train_config(ctx, method: str, run_dir: Path) -> dict:
    c = ctx.cfg
    tokenizer = json.loads((ctx.data / "manifest.json").read_text())["tokenizer"]["name"]
    return {
        "run": {"out_dir": str(run_dir.parent), "name": run_dir.name},
        "model": {"preset": ctx.preset},
        "data": {"dir": str(ctx.data), "tokenizer": tokenizer, "seq_len": c["seq_len"]},
        "train": {"device": ctx.device, "dtype": ctx.dtype, "micro_batch_size_seqs": c["micro_batch"],
                  "grad_accum_steps": 1, "max_steps": c["train_steps"], "lr": 6e-4, "min_lr": 6e-5,
                  "warmup_steps": max(1, c["train_steps"] // 10), "compile": ctx.train_compile},
        "method": {"name": method, "alpha": 0.1},
        "eval": {"interval": 0, "tokens_per_domain": c["eval_tokens"], "batch_size_seqs": 4},
        "log": {"interval": c["log_interval"], "tensorboard": False},
        "checkpoint": {"interval": 0},
    }


def step_train(ctx, method: str) -> tuple[dict, list[str]]:
    import yaml

    name = "train_" + method.replace("-", "_")
    run_dir = ctx.scratch / method
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg_path = ctx.report.path(ctx.n, name, ".yaml")
    cfg_path.write_text(yaml.safe_dump(train_config(ctx, method, run_dir), sort_keys=False))
    log = ctx.report.path(ctx.n, name, ".log")
    cmd = [sys.executable, "-m", "eslm.cli", "train", str(cfg_path)]
    rc, wall = run_logged(cmd, log, ctx.limit("train"))
    for src in ("metrics.jsonl", "result.json"):  # what exists so far, even after a time-out
        if (run_dir / src).exists():
            shutil.copy(run_dir / src, ctx.report.path(ctx.n, name, "-" + src))
    rec = {"status": status_of(rc), "returncode": rc, "command": f"eslm train {cfg_path.name}", "log": log.name,
           **train_figures(ctx.report.path(ctx.n, name, "-metrics.jsonl"))}
    if rec.get("first_loss") is not None:
        rec["note"] = (f"loss {rec['first_loss']:.3f} -> {rec['last_loss']:.3f}, "
                       f"MFU {fmt(rec['mfu_median'])}, {fmt(rec['tokens_per_s_median'])} tok/s")
    progress = [line for line in tail(log, 400) if line.startswith("step ")]
    md = [f"`{rec['command']}` (exit {rc}, {wall:.0f} s), metrics in {name}-metrics.jsonl", "", "```",
          *(progress[:2] + progress[-4:] if len(progress) > 6 else progress), *tail(log, 3), "```"]
    return rec, md


PROFILED = (("clm", "clm"), ("eslm-entropy@0.2", "eslm-entropy"))  # (label, method): at alpha 0.2


def child_profile(a) -> dict:
    """(In the child.) ``torch.profiler`` over ``a.steps`` optimizer steps of each config in ``a.configs``
    (LABEL=FILE, the real trainer's step), after two warm-up steps: each label's table of the top ops by device
    time (CPU time on a CPU) into ``a.table_dir``/LABEL.txt, and its step time and top ops returned."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from eslm.config import build_config
    from eslm.train.trainer import Trainer

    out = {}
    for item in a.configs:
        label, path = item.split("=", 1)
        trainer = Trainer(build_config([path]))
        for _ in range(2):
            trainer._train_one_step()
        cuda = trainer.device.type == "cuda"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        sort = "device_time_total" if cuda else "cpu_time_total"
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            for _ in range(a.steps):
                trainer._train_one_step()
        wall = (time.perf_counter() - t0) / a.steps
        table = prof.key_averages().table(sort_by=sort, row_limit=30)
        (Path(a.table_dir) / f"{label}.txt").write_text(table + "\n")
        attr = "device_time_total" if cuda else "cpu_time_total"
        top = sorted(prof.key_averages(), key=lambda e: getattr(e, attr, 0.0), reverse=True)[:12]
        out[label] = {"step_s_profiled": wall, "sorted_by": sort,
                      "top": [{"op": e.key, "total_ms": getattr(e, attr, 0.0) / 1e3 / a.steps, "calls": e.count}
                              for e in top]}
        del trainer
        if cuda:
            torch.cuda.empty_cache()
    return out


def step_profile(ctx) -> tuple[dict, list[str]]:
    import yaml

    tables = ctx.out / f"{ctx.n}-profile"
    tables.mkdir(exist_ok=True)
    configs = []
    for label, method in PROFILED:
        cfg = train_config(ctx, method, ctx.scratch / "profile" / label)
        cfg["method"]["alpha"] = 0.2
        path = ctx.report.path(ctx.n, "profile", f"-{label}.yaml")
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        configs.append(f"{label}={path}")
    got, rc, wall, log = run_child(ctx, "profile", ["--steps", str(ctx.cfg["profile_steps"]), "--table-dir",
                                                    str(tables), "--configs", *configs])
    rec = {"status": status_of(rc), "returncode": rc, "log": log.name, "profiles": got}
    if got:
        rec["note"] = ", ".join(f"{k} {v['step_s_profiled'] * 1e3:.1f} ms/step" for k, v in got.items())
    md = [f"torch.profiler over {ctx.cfg['profile_steps']} step(s) each after 2 warm-up steps ({wall:.0f} s); "
          f"tables in {tables.name}/", ""]
    for label, prof in got.items():
        md += [f"## {label}: {prof['step_s_profiled'] * 1e3:.1f} ms per step under the profiler", "",
               "| op | ms per step | calls |", "|---|---:|---:|"]
        md += [f"| `{t['op']}` | {t['total_ms']:.3f} | {t['calls']} |" for t in prof["top"]] + [""]
    return rec, md + ([] if rc == 0 else ["```", *tail(log), "```"])


def train_figures(metrics: Path) -> dict:
    """First / last training loss, whether it fell, median MFU and tokens/s over the second half, val loss."""
    if not metrics.exists():
        return {}
    from eslm import metrics as M

    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in recs if r.get(M.KIND) == M.KIND_TRAIN]
    evals = [r for r in recs if r.get(M.KIND) == M.KIND_EVAL]
    if not train:
        return {}
    late = train[len(train) // 2:]
    mfus = [r[M.MFU] for r in late if r.get(M.MFU) is not None]
    first, last = train[0][M.TRAIN_LOSS_ALL], train[-1][M.TRAIN_LOSS_ALL]  # CE over all tokens, any method
    return {"steps_logged": len(train), "first_loss": first, "last_loss": last, "loss_fell": last < first,
            "mfu_median": statistics.median(mfus) if mfus else None,
            "tokens_per_s_median": statistics.median(r[M.TOKENS_PER_S] for r in late),
            "step_time_s_median": statistics.median(r[M.STEP_TIME_S] for r in late),
            "val_loss": evals[-1][M.VAL_LOSS] if evals else None}


# ----------------------------------------------------------------------------------------------- driver


class Context:
    def __init__(self, a, report: Report):
        self.device, self.preset, self.report, self.out = a.device, a.preset, report, a.out
        self.cfg = {**PRESETS[a.preset], **{k: v for k, v in (("seq_len", a.seq_len), ("micro_batch", a.micro_batch),
                                                                ("train_steps", a.train_steps)) if v}}
        self.data, self.tests = a.data, a.tests
        self.compile = a.compile == "yes" or (a.compile == "auto" and a.device.startswith("cuda"))
        self.train_compile = a.train_compile
        self.dtype = a.dtype if a.dtype != "auto" else ("bf16" if a.device.startswith("cuda") else "fp32")
        # run directories (with a checkpoint of GBs at 124M) stay out of --out and the bundle
        self.scratch = a.scratch or Path(tempfile.mkdtemp(prefix="gpu_suite_runs_"))
        self.deadline = time.monotonic() + (a.budget_s or self.cfg["budget_s"])
        self.matmul_peak, self.n = None, 0

    def limit(self, kind: str) -> float:
        return min(self.cfg["limits"][kind], self.deadline - time.monotonic())

    def peak_flops_arg(self) -> float | None:
        """MFU's peak for the benchmark: the trainer's table by GPU name where it knows the GPU, else (a CPU, or
        an unknown GPU) the matmul rate measured in step 1."""
        if self.device.startswith("cuda"):
            import torch

            from eslm.train.timing import PEAK_FLOPS

            if any(k in torch.cuda.get_device_name(self.device) for k in PEAK_FLOPS):
                return None
        return self.matmul_peak


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="results directory (created)")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for the smoke mode")
    p.add_argument("--preset", default="gpt2-124m", choices=sorted(PRESETS))
    p.add_argument("--data", type=Path, default=None, help="prepared corpus (default data/stdlib-gpt2, then "
                   "$ESLM_DATA_DIR/stdlib-gpt2)")
    p.add_argument("--tests", nargs="+", default=["tests"], help="what `pytest -m gpu` collects")
    p.add_argument("--skip", nargs="+", default=[], choices=STEPS, metavar="STEP", help=f"of {', '.join(STEPS)}")
    p.add_argument("--compile", default="auto", choices=["auto", "yes", "no"],
                   help="the torch.compile benchmark step (auto: on CUDA only)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="benchmark and training precision (auto: bf16 autocast on CUDA, fp32 on CPU, where bf16 "
                   "matmuls are emulated and slow; the unit tests cover CPU bf16)")
    p.add_argument("--train-compile", action="store_true", help="torch.compile the two training runs")
    p.add_argument("--seq-len", type=int, default=0)
    p.add_argument("--micro-batch", type=int, default=0)
    p.add_argument("--train-steps", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="total seconds, later steps get what is left (default: 530 at 124M, under 9 minutes)")
    p.add_argument("--bundle", type=Path, default=None, help="a .tar.gz of --out, rewritten after every step")
    p.add_argument("--scratch", type=Path, default=None,
                   help="parent of the training run directories, kept (default: a temporary one, removed)")
    p.add_argument("--force", action="store_true", help="write into an --out that holds an earlier summary")
    # internal: one step run by the suite in a child process of its own
    p.add_argument("--child", choices=CHILD_STEPS, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--matmul-n", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--table-dir", help=argparse.SUPPRESS)
    p.add_argument("--configs", nargs="*", default=[], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is None and a.out is None:
        p.error("the following arguments are required: --out")
    return a


def check_args(a) -> None:
    """Every user mistake, before anything runs: one line each."""
    import torch

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SuiteError(f"--device {a.device}: no CUDA device here (torch {torch.__version__}, built for CUDA "
                         f"{torch.version.cuda}); run it on a GPU machine, or use --device cpu --preset tiny "
                         "for the smoke mode")
    if not {"train_clm", "train_eslm_entropy"} <= set(a.skip):
        if a.data is None:
            cands = [ROOT / "data" / "stdlib-gpt2"] + ([Path(os.environ["ESLM_DATA_DIR"]) / "stdlib-gpt2"]
                                                       if os.environ.get("ESLM_DATA_DIR") else [])
            a.data = next((c for c in cands if (c / "manifest.json").is_file()), cands[0])
        if not (a.data / "manifest.json").is_file():
            raise SuiteError(f"--data: expected a prepared corpus (manifest.json) in {a.data}, found none; prepare "
                             f"it with `eslm prepare stdlib --out {a.data}` (and carry it to the GPU machine), or "
                             "--skip train_clm train_eslm_entropy")
        a.data = a.data.resolve()
    if (a.out / "summary.json").exists() and not a.force:
        raise SuiteError(f"--out {a.out} already holds a suite's results (summary.json); choose another "
                         "directory or pass --force to overwrite them")
    a.out = a.out.resolve()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    if a.child:  # one step's work in this process (the parent holds its time limit)
        fn = {"env": child_env, "profile": child_profile}[a.child]
        Path(a.child_out).write_text(json.dumps(fn(a), indent=2, default=str) + "\n")
        return 0
    try:
        check_args(a)
        a.out.mkdir(parents=True, exist_ok=True)
    except (SuiteError, OSError) as e:
        print(f"gpu_suite: error: {e}", file=sys.stderr)
        return 2
    report = Report(a.out, a.bundle, argv)
    signal.signal(signal.SIGTERM, _stop)
    ctx = Context(a, report)
    runners = {"env": step_env, "profile": step_profile, "pytest": step_pytest,
               "loss_path": lambda c: step_loss_path(c, False),
               "loss_path_compile": lambda c: step_loss_path(c, True),
               "train_clm": lambda c: step_train(c, "clm"),
               "train_eslm_entropy": lambda c: step_train(c, "eslm-entropy")}
    failed = False
    for n, step in enumerate(STEPS, start=1):
        ctx.n = n
        skip = ("--skip" if step in a.skip else "no torch.compile step (--compile)"
                if step == "loss_path_compile" and not ctx.compile
                else "out of time (--budget-s)" if ctx.deadline - time.monotonic() < 5 else None)
        t0 = time.perf_counter()
        if skip:
            rec, md = {"status": "skipped", "note": skip}, [skip]
        else:
            print(f"== gpu_suite step {n}/{len(STEPS)}: {step}", flush=True)
            try:
                rec, md = runners[step](ctx)
                rec.setdefault("status", "ok")
            except Exception as e:  # one step's failure must not lose the others' results
                rec, md = {"status": f"failed ({type(e).__name__})", "note": str(e)[:300]}, [repr(e)]
        rec = {"step": step, **rec, "wall_s": time.perf_counter() - t0}
        failed |= rec["status"] not in ("ok", "skipped")
        report.write_step(n, step, rec, md)
        print(f"== {step}: {rec['status']} ({rec['wall_s']:.1f} s) {rec.get('note', '')}", flush=True)
    if a.scratch is None:
        shutil.rmtree(ctx.scratch, ignore_errors=True)
    report.flush()
    print(f"results in {a.out} (summary.md)" + (f", bundled in {a.bundle}" if a.bundle else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
