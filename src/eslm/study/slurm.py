"""The SLURM launcher: a study's runs as one array job, submitted through submitit (the optional extra ``slurm``).
How it runs, requeues and reports each run: docs/study.md, "On a cluster"."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import ClassVar

from eslm.config import is_int, to_yaml
from eslm.errors import ConfigError, ESLMError
from eslm.files import atomic_write, ensure_dir, open_nofollow, read_marker
from eslm.study.launch import FAILED, FINISHED, NOT_STARTED, PREEMPTED, QUEUED, STOPPED, Launched, Outcome, print_status

# sbatch options the launcher sets itself (or takes from a key of the section): refused under launcher.sbatch
_OWN_OPTIONS = {"array": "parallel", "job-name": None, "output": None, "error": None, "signal": None,
                "open-mode": None, "time": "time", "partition": "partition", "cpus-per-task": "cpus_per_run",
                "gpus-per-node": "gpus_per_run", "mem": "mem_gb", "nodes": "nodes", "ntasks-per-node": None}
MAX_REQUEUES = 100  # time-limit requeues of one run (each slice advances the run by at least a step)
SCHEDULER_TIMEOUT_S = 60.0  # the longest one of SLURM's commands (sbatch, squeue, sacct, scontrol) is waited for
SIGNAL_DELAY_S = 90  # USR2 this long before the time limit: time for a step and a checkpoint
_VALUES: dict[str, tuple[Callable[[object], bool], str]] = {  # launcher.KEY: (accepts the value, what it expects)
    "partition": (lambda v: isinstance(v, str) and bool(v.strip()), "a partition name"),
    "time": (lambda v: time_minutes(v) is not None, "a time limit per job as minutes (an integer > 0) or "
             "'[D-]HH:MM:SS'"),
    **{key: (partial(lambda low, v: is_int(v) and v >= low, low), f"an integer >= {low}")
       for key, low in (("nodes", 1), ("cpus_per_run", 1), ("gpus_per_run", 0), ("parallel", 1))},
    "mem_gb": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
               "a positive number of GB"),
}
JOBS_FILE = "jobs.json"
JOBS_FORMAT = "eslm-slurm-jobs"
# scheduler states of a job that is not over (squeue lists it, or sacct has not caught up with its end yet)
_ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "COMPLETING", "CONFIGURING",
           "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "SPECIAL_EXIT"}


# ---------------------------------------------------------------- the study file's launcher section

def time_minutes(value) -> int | None:
    """A time limit as whole minutes (rounded up): an integer of minutes, or ``[D-]HH:MM:SS`` / ``HH:MM``
    text; None when it is neither."""
    if is_int(value):
        return value if value > 0 else None
    if not isinstance(value, str):
        return None
    days, _, clock = value.strip().rpartition("-")
    parts = clock.split(":")
    if not (days == "" or days.isdigit()) or not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    h, m, s = (int(p) for p in parts) if len(parts) == 3 else (*(int(p) for p in parts), 0)
    seconds = ((int(days or 0) * 24 + h) * 60 + m) * 60 + s
    return -(-seconds // 60) if seconds > 0 else None


# ---------------------------------------------------------------- what runs in one array task

_CHILD: subprocess.Popen | None = None  # the training process of this task (RunJob.checkpoint stops it)


def _ignore_usr2() -> None:  # in the training process: the scheduler's USR2 is for submitit, not for the run
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class RunFailed(ESLMError):
    """The training process of an array task exited with an error."""


class SchedulerUnreachable(ESLMError):
    """``squeue`` failed: the study's jobs cannot be seen (nothing is submitted then)."""


class _NoAnswer(Exception):
    """A scheduler command ran past ``SCHEDULER_TIMEOUT_S`` (``_time_limit``)."""


@contextmanager
def _time_limit(seconds: float):
    """Raise ``_NoAnswer`` in this thread after ``seconds`` (SIGALRM; the main thread only, elsewhere no limit):
    around a call into submitit, whose sbatch has no time limit of its own (its stream reader kills sbatch on
    the exception and raises FailedJobError from it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(*_):
        raise _NoAnswer

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass(frozen=True)
class RunJob:
    """One run as a SLURM array task (pickled by submitit): ``eslm train PLAN`` in a child process (under torchrun
    for several GPUs or nodes), resumed when the run directory holds metrics; node N > 0 logs to
    ``<run>.nodeN.log``."""

    name: str
    plan: str
    run_dir: str
    log: str
    gpus: int = 0
    nodes: int = 1

    def command(self, resume: bool, node_rank: int = 0, master: str = "", port: int = 0) -> list[str]:
        train = ["-m", "eslm.cli", "train", self.plan] + (["run.resume=true"] if resume else [])
        if self.nodes > 1:
            return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nodes}",
                    f"--node_rank={node_rank}", f"--nproc_per_node={max(1, self.gpus)}", f"--master_addr={master}",
                    f"--master_port={port}", *train]
        if self.gpus > 1:
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.gpus}",
                    *train]
        return [sys.executable, *train]

    def __call__(self) -> str:
        global _CHILD
        resume = (Path(self.run_dir) / "metrics.jsonl").is_file()
        env = _import_submitit().JobEnvironment()  # job_id: "<array job>_<task>" for an array's task
        # torchrun's static rendezvous: every node of a job computes the same host and port (20000-29999)
        node, master, port = ((env.node, env.hostnames[0], 20000 + zlib.crc32(env.raw_job_id.encode()) % 10000)
                              if self.nodes > 1 else (0, "", 0))
        cmd = self.command(resume, node, master, port)
        job = env.job_id
        path = Path(self.log) if node == 0 else Path(self.log).with_suffix(f".node{node}.log")
        with open_nofollow(path, "a") as log:
            log.write(f"== {time.strftime('%Y-%m-%d %H:%M:%S')} SLURM job {job} on {socket.gethostname()}"
                      f"{f' (node {node} of {self.nodes})' if self.nodes > 1 else ''}"
                      f"{' (resuming)' if resume else ''}: {shlex.join(cmd)}\n")
            log.flush()
            _CHILD = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_ignore_usr2)
            while _CHILD.poll() is None:  # poll, not wait: checkpoint() may run (a signal) while this waits
                time.sleep(0.5)
            code = _CHILD.returncode
        if code == 0:  # eslm train exits 0 when SIGTERM stopped it after a step and its checkpoint
            return FINISHED if (Path(self.run_dir) / "result.json").is_file() else PREEMPTED
        raise RunFailed(f"run {self.name}: eslm train exited with {code}; its log: {self.log}")

    def checkpoint(self, *args, **kwargs):
        """Called by submitit on the scheduler's USR2 (the time limit is near, or a pre-emption): the run stops
        after its current step with a checkpoint, then submitit requeues this task, which resumes the run.
        Returns None (no requeue) when the run has finished."""
        child = _CHILD
        if child is not None and child.returncode is None:
            child.send_signal(signal.SIGTERM)
            try:
                os.waitpid(child.pid, 0)
            except ChildProcessError:  # reaped already
                pass
        if (Path(self.run_dir) / "result.json").is_file():
            return None
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self)


# ---------------------------------------------------------------- the scheduler's view

def _run(cmd: list[str]) -> subprocess.CompletedProcess | str:
    """The finished command (its output decoded as UTF-8, undecodable bytes replaced), or why there is none: it
    did not run, or gave no answer in ``SCHEDULER_TIMEOUT_S`` (then it is killed)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", errors="replace",
                              timeout=SCHEDULER_TIMEOUT_S)
    except OSError:
        return "did not run"
    except subprocess.TimeoutExpired:
        return f"gave no answer in {SCHEDULER_TIMEOUT_S:g} s"


def _base(job: str) -> str:
    return job.split("_")[0]


def _expand(job_id: str) -> list[str]:
    """``12_[0-2,5%2]`` -> [12_0, 12_1, 12_2, 12_5]; ``12_3`` -> [12_3]; ``12`` -> [12]."""
    base, _, rest = job_id.partition("_")
    if not rest.startswith("["):
        return [job_id]
    out = []
    for part in rest.strip("[]").split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (hi.isdigit() or not hi):
            out += [f"{base}_{i}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def scheduler_states(jobs: Sequence[str]) -> dict[str, str]:
    """{job id: state} for the jobs (``A_i`` array tasks or plain ids) the scheduler knows: ``squeue``, else
    ``sacct`` (with `` exit N`` for a non-zero exit). Raises SchedulerUnreachable when ``squeue`` fails: a job it
    cannot see may still be queued, and must not be submitted twice."""
    wanted = set(jobs)
    if not wanted:
        return {}
    out: dict[str, str] = {}
    q = _run(["squeue", "-h", "-r", "-o", "%i|%T", "-j", ",".join(sorted({_base(j) for j in wanted}))])
    if isinstance(q, str) or (q.returncode != 0 and "Invalid job id" not in q.stderr):  # (all listed are purged)
        why = q if isinstance(q, str) else next((x.strip() for x in q.stderr.splitlines() if x.strip()),
                                                f"exit {q.returncode}")
        raise SchedulerUnreachable(f"could not ask SLURM for the study's jobs (squeue: {why}); check that SLURM's "
                                   "commands reach the controller (SLURM_CONF), then run the same command again")
    for line in (q.stdout.splitlines() if q.returncode == 0 else []):
        jid, _, state = line.strip().partition("|")
        for j in _expand(jid):
            if j in wanted:
                out[j] = state
    rest = wanted - set(out)
    if rest:
        a = _run(["sacct", "-n", "-P", "-X", "-o", "JobID,State,ExitCode", "-j",
                  ",".join(sorted({_base(j) for j in rest}))])
        for line in (a.stdout.splitlines() if not isinstance(a, str) and a.returncode == 0 else []):
            fields = line.strip().split("|")
            if len(fields) < 3:
                continue
            state = fields[1].split()[0] if fields[1] else "UNKNOWN"
            code = fields[2].split(":")[0]
            for j in _expand(fields[0]):
                if j in rest:
                    out[j] = state + (f" exit {code}" if code not in ("", "0") else "")
    return out


# ---------------------------------------------------------------- the launcher

@dataclass(frozen=True)
class SlurmLauncher:
    """Trains a study's runs as one SLURM array job. ``parallel``: the array's concurrency cap (None: every run at
    once); ``time_min``: one job's time limit; ``sbatch``: further (option, value) pairs; ``detach``: return once
    submitted."""

    study: str
    partition: str | None = None
    time_min: int = 60
    nodes: int = 1
    cpus_per_run: int = 1
    gpus_per_run: int = 0
    mem_gb: float | None = None
    parallel: int | None = None
    sbatch: tuple = ()
    detach: bool = False
    poll_s: float = 2.0

    KEYS: ClassVar[tuple[str, ...]] = ("partition", "time", "nodes", "cpus_per_run", "gpus_per_run", "mem_gb",
                                       "parallel", "sbatch")

    @classmethod
    def section_problems(cls, section: dict) -> list[str]:
        """Every problem of the values of the study file's ``launcher`` section (one phrase each)."""
        out = [f"launcher.{key}: expected {what}, found {section[key]!r}"
               for key, (ok, what) in _VALUES.items() if key in section and not ok(section[key])]
        extra = section.get("sbatch")
        if "sbatch" in section:
            if not isinstance(extra, dict):
                out.append(f"launcher.sbatch: expected a mapping of sbatch options without their dashes "
                           f"({{account: ABC, qos: high}}), found {extra!r}")
            else:
                for k, v in extra.items():
                    key = str(k).lstrip("-").replace("_", "-")
                    if key in _OWN_OPTIONS:
                        own = _OWN_OPTIONS[key]
                        fix = f"set launcher.{own}" if own else "eslm sets it"
                        out.append(f"launcher.sbatch: --{key} is set by the launcher; {fix} instead")
                    elif not (isinstance(v, (str, int, float)) and v is not False and str(v).strip()):
                        out.append(f"launcher.sbatch.{k}: expected a value (text or number, or true for a flag), "
                                   f"found {v!r}")
        return out

    @classmethod
    def from_study(cls, study: dict, section: dict, jobs: int | None, *, detach: bool = False) -> SlurmLauncher:
        """From the checked ``launcher`` section; ``jobs`` caps the array when the section sets no ``parallel``."""
        time_min = time_minutes(section.get("time", 60))
        assert time_min is not None, "launcher.time is checked by section_problems"
        same = {k: section[k] for k in ("partition", "nodes", "cpus_per_run", "gpus_per_run", "mem_gb") if k in section}
        return cls(study=study["name"], time_min=time_min, parallel=section.get("parallel", jobs), detach=detach,
                   sbatch=tuple((str(k).lstrip("-").replace("_", "-"), v)
                                for k, v in (section.get("sbatch") or {}).items()), **same)

    def describe(self) -> str:
        per_run = [f"{self.cpus_per_run} CPU(s)"] + ([f"{self.gpus_per_run} GPU(s)"] if self.gpus_per_run else [])
        per_run += [f"{self.mem_gb:g} GB"] if self.mem_gb else []
        bits = [f"partition {self.partition}" if self.partition else "default partition",
                f"{' + '.join(per_run)} and {self.time_min} min per job"]
        bits += [f"{self.parallel} at a time"] if self.parallel else []
        bits += [f"{self.nodes} nodes per run"] if self.nodes > 1 else []
        return "on SLURM: " + ", ".join(bits)

    # ---- the runs' states

    def _jobs_record(self, study_dir: Path) -> dict:
        """``slurm/jobs.json``: {"format", "runs": {run name: {"job", "submitted"}}} (empty when not eslm's)."""
        data = read_marker(study_dir / "slurm" / JOBS_FILE, JOBS_FORMAT)
        return data if data and isinstance(data.get("runs"), dict) else {"format": JOBS_FORMAT, "runs": {}}

    def _record(self, study_dir: Path, submitted: dict[str, str]) -> None:
        data = self._jobs_record(study_dir)
        now = time.strftime("%Y-%m-%dT%H:%M:%S")
        data["runs"].update({k: {"job": v, "submitted": now} for k, v in submitted.items()})
        path = ensure_dir(study_dir / "slurm") / JOBS_FILE
        atomic_write(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())

    def states(self, configs: Sequence, study_dir: Path) -> list[tuple[str, str | None, str | None, Outcome]]:
        """[(run name, job id, scheduler state, outcome)] for ``configs``."""
        jobs = {k: v["job"] for k, v in self._jobs_record(study_dir)["runs"].items()  # the latest per run
                if isinstance(v, dict) and "job" in v}
        names = [c.run.name for c in configs]
        states = scheduler_states([jobs[n] for n in names if n in jobs])
        out = []
        for c, n in zip(configs, names):
            job = jobs.get(n)
            state = states.get(job) if job else None
            out.append((n, job, state, self._outcome(n, Path(c.run.out_dir) / n, job, state, study_dir)))
        return out

    def _outcome(self, name: str, run_dir: Path, job: str | None, state: str | None, study_dir: Path) -> Outcome:
        log = study_dir / "logs" / f"{name}.log"
        if (run_dir / "result.json").is_file():
            return Outcome(name, FINISHED, "finished" + (f" (job {job})" if job else ""))
        if job is None:
            return Outcome(name, NOT_STARTED, "not submitted")
        if state is None:
            return Outcome(name, NOT_STARTED, f"unknown to the scheduler (job {job}: ended long ago, or no "
                                              "accounting); the same command resubmits it")
        kind = state.split()[0]
        if kind in _ACTIVE:
            word = {"RUNNING": "running", "COMPLETING": "ending"}.get(kind, f"queued ({kind.lower()})")
            return Outcome(name, QUEUED, f"{word} (job {job})")
        if kind == "CANCELLED":
            return Outcome(name, STOPPED, f"cancelled (job {job}); the same command resubmits it, and it resumes "
                                          f"from its checkpoint; log: {log}")
        if kind in ("COMPLETED", "PREEMPTED"):
            return Outcome(name, PREEMPTED, f"stopped with a checkpoint (job {job} {state}); the same command "
                                            f"resubmits it; log: {log}")
        return Outcome(name, FAILED, f"failed (job {job} {state}); log: {log}")

    def status(self, configs: Sequence, study_dir: Path) -> int:
        return print_status(self.study, [(c, o) for c, (*_, o) in zip(configs, self.states(configs, study_dir))])

    # ---- launching

    def launch(self, configs: Sequence, study_dir: Path) -> Launched:
        rows = self.states(configs, study_dir)
        queued = {n: job for n, job, _, o in rows if o.state == QUEUED}
        todo = [c for c, (_, _, _, o) in zip(configs, rows) if o.state not in (QUEUED, FINISHED)]
        for n, job in queued.items():
            print(f"== {n}: queued or running already (job {job}), not submitted again", flush=True)
        submitted = self._submit(todo, study_dir) if todo else {}
        if submitted:
            base = _base(next(iter(submitted.values())))
            cap = f", {self.parallel} at a time" if self.parallel and self.parallel < len(submitted) else ""
            print(f"study {self.study}: submitted {len(submitted)} run(s) as SLURM job {base}{cap}; logs in "
                  f"{study_dir / 'logs'}; squeue -j {base} lists them", flush=True)
        jobs = {**queued, **submitted}
        if self.detach:
            return Launched(tuple(o if o.name not in jobs else Outcome(o.name, QUEUED, f"queued (job {jobs[o.name]})")
                                  for *_, o in rows), 0)
        return self._wait(configs, study_dir)

    def _submit(self, configs: Sequence, study_dir: Path) -> dict[str, str]:
        """Plan files, then one array job of ``configs``. Returns {run name: job id}."""
        submitit = _import_submitit()
        try:
            ex = submitit.SlurmExecutor(folder=study_dir.resolve() / "slurm", max_num_timeout=MAX_REQUEUES)
        except RuntimeError as e:  # no srun on PATH
            raise ESLMError(f"the SLURM launcher needs SLURM's commands (sbatch, squeue, srun) on PATH: {e}; run "
                            "on a cluster's login node, or use the local launcher") from None
        for d in ("plan", "logs", "slurm"):
            ensure_dir(study_dir / d)
        threads = max(1, self.cpus_per_run // max(1, self.gpus_per_run))
        tasks = []
        for c in configs:
            if c.train.num_threads == 0:
                c = replace(c, train=replace(c.train, num_threads=threads))
            plan = (study_dir / "plan" / f"{c.run.name}.yaml").resolve()
            atomic_write(plan, to_yaml(c).encode())
            tasks.append(RunJob(c.run.name, str(plan), str((Path(c.run.out_dir) / c.run.name).resolve()),
                                str((study_dir / "logs" / f"{c.run.name}.log").resolve()), self.gpus_per_run,
                                self.nodes))
        # with several nodes: one task per node, each a torchrun of the run's processes on that node
        params = dict(job_name=f"eslm-{self.study}", time=self.time_min, cpus_per_task=self.cpus_per_run,
                      array_parallelism=self.parallel or len(tasks), signal_delay_s=SIGNAL_DELAY_S,
                      stderr_to_stdout=True, additional_parameters=dict(self.sbatch), partition=self.partition,
                      gpus_per_node=self.gpus_per_run, mem=self.mem_gb and f"{int(self.mem_gb * 1024)}M",
                      **(dict(nodes=self.nodes, ntasks_per_node=1) if self.nodes > 1 else {}))
        ex.update_parameters(**{k: v for k, v in params.items() if v})  # an unset option: SLURM's default
        try:
            with _time_limit(SCHEDULER_TIMEOUT_S), ex.batch():
                jobs = [ex.submit(t) for t in tasks]
        except (_NoAnswer, subprocess.CalledProcessError, submitit.core.utils.FailedJobError) as e:
            if isinstance(e, _NoAnswer) or isinstance(e.__cause__, _NoAnswer):
                raise ESLMError(f"study {self.study}: sbatch gave no answer in {SCHEDULER_TIMEOUT_S:g} s and was "
                                f"stopped (a busy or unreachable controller); if squeue -n eslm-{self.study} lists "
                                "a job, it was submitted unrecorded: scancel it, then run the same command again"
                                ) from None
            err = getattr(e, "stderr", None) or getattr(e, "output", None) or str(e)
            err = err.decode(errors="replace") if isinstance(err, bytes) else str(err)
            line = next((x.strip() for x in err.splitlines() if x.strip()), "no message")
            raise ESLMError(f"study {self.study}: sbatch refused the runs' array job ({line}); check the study "
                            "file's launcher section (partition, time, cpus_per_run, gpus_per_run, mem_gb, "
                            "sbatch)") from None
        out = {t.name: j.job_id for t, j in zip(tasks, jobs)}
        for name, job in out.items():  # squeue/sacct show run names (the task leaves the array's pending record)
            if isinstance(_run(["scontrol", "update", f"JobId={job}", f"JobName={name}"]), str):
                break  # no answer: the tasks keep the array's name, eslm-STUDY
        self._record(study_dir, out)
        return out

    def _wait(self, configs: Sequence, study_dir: Path) -> Launched:
        """Poll until no run of ``configs`` is queued or running, printing each change of a run's state."""
        seen: dict[str, str] = {}
        rows: list = []
        unreachable_since = None
        try:
            while True:
                try:
                    rows = self.states(configs, study_dir)
                    unreachable_since = None
                except SchedulerUnreachable:  # a busy controller: try again, give up after a minute or so
                    unreachable_since = unreachable_since or time.monotonic()
                    if time.monotonic() - unreachable_since > 60:
                        raise
                    time.sleep(self.poll_s)
                    continue
                for name, _, _, o in rows:
                    if seen.get(name) != o.words:
                        seen[name] = o.words
                        print(f"== {name} {o.words}", flush=True)
                if not any(o.state == QUEUED for *_, o in rows):
                    break
                time.sleep(self.poll_s)
        except KeyboardInterrupt:
            print(f"study {self.study}: stopped waiting; the runs go on on the cluster (eslm study {self.study} "
                  "--status shows them; the same command waits again and writes the report)", file=sys.stderr)
            return Launched(tuple(o for *_, o in rows), 130)
        outcomes = tuple(o for *_, o in rows)
        if bad := [o for o in outcomes if not o.finished]:
            print(f"study {self.study}: {len(bad)} run(s) did not finish: " + "; ".join(f"{o.name}: {o.words}"
                                                                                     for o in bad), file=sys.stderr)
        return Launched(outcomes, 1 if bad else 0)


def _import_submitit():
    try:
        import submitit
    except ImportError:
        raise ConfigError("the SLURM launcher needs submitit, which is not installed; install it with "
                          "pip install 'eslm[slurm]'") from None
    return submitit
