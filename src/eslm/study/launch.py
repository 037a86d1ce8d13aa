"""Launching a study's runs: the ``Launcher`` seam and the local launcher. A launcher trains the unfinished runs
of one stage and answers each run's ``Outcome``; it never plans, skips finished runs or writes the report
(``eslm.study.run_study`` does)."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, Protocol

from eslm.config import to_yaml
from eslm.errors import ConfigError
from eslm.files import atomic_write, ensure_dir, open_nofollow
from eslm.train import trainer
from eslm.train.records import fmt_time

FINISHED, PREEMPTED, STOPPED, FAILED, NOT_STARTED = "finished", "preempted", "stopped", "failed", "not started"
# The launchers by the name ``eslm study --launcher`` and the study file's ``launcher.name`` take: "module:class" of
# a class with the ``Launcher`` protocol (``launcher_class``). A new launcher is a module and its line here.
LAUNCHERS = {"local": "eslm.study.launch:LocalLauncher", "slurm": "eslm.study.slurm:SlurmLauncher"}
QUEUED = "queued"  # submitted to a scheduler and not over yet: a detached launch (``eslm study --detach``)


@dataclass(frozen=True)
class Outcome:
    """What became of one run: ``state`` (FINISHED, PREEMPTED: stopped after a step with a checkpoint, STOPPED:
    before its first step, FAILED, NOT_STARTED, QUEUED); ``words`` says it to the user."""

    name: str
    state: str
    words: str

    @property
    def finished(self) -> bool:
        return self.state == FINISHED


@dataclass(frozen=True)
class Launched:
    """Each run's outcome and the study's exit code (0, 143 when stopped by SIGTERM, else a failure's)."""

    outcomes: tuple[Outcome, ...]
    code: int


class Launcher(Protocol):
    """Trains the runs ``configs`` of one stage under ``study_dir``. The class owns its section of the study file:
    a new launcher is a module and its line in ``LAUNCHERS``."""

    KEYS: ClassVar[tuple[str, ...]]  # the keys of its ``launcher`` section besides ``name``

    @classmethod
    def section_problems(cls, section: dict) -> list[str]:
        """Every problem of the values of its section (a mapping of some of ``KEYS``), one phrase each."""

    @classmethod
    def from_study(cls, study: dict, section: dict, jobs: int | None, *, detach: bool = False) -> Launcher:
        """From its checked section; ``jobs`` runs at once; ``detach``: return once the runs are handed over."""

    def launch(self, configs: Sequence, study_dir: Path) -> Launched: ...

    def status(self, configs: Sequence, study_dir: Path) -> int:
        """``eslm study NAME --status``: print each run's state; trains nothing. Returns the exit code."""


def launcher_class(name: str) -> type[Launcher]:
    """The class of the launcher ``name`` (a key of ``LAUNCHERS``), its module imported."""
    module, _, cls = LAUNCHERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def launcher_problems(section, name: str | None = None) -> list[str]:
    """Every problem of a study file's ``launcher`` section (one phrase each), checked by the launcher it names
    (else ``name``, the one ``--launcher`` picks; None: not yet)."""
    if section is None:
        return []
    if not isinstance(section, dict):
        return [f"launcher: expected a mapping {{name: {' | '.join(LAUNCHERS)}, ...its keys}}, found {section!r}"]
    name = section.get("name", name)
    if name is None:
        return []
    if name not in LAUNCHERS:
        return [f"launcher.name: expected one of {', '.join(LAUNCHERS)}, found {name!r}"]
    cls = launcher_class(name)
    own = {k: v for k, v in section.items() if k != "name"}
    unknown = [k for k in own if k not in cls.KEYS]
    out = [f"launcher: unknown key(s) {', '.join(map(repr, unknown))} for the {name} launcher; expected some of "
           f"{', '.join(map(repr, ('name', *cls.KEYS)))}"] if unknown else []
    return out + cls.section_problems({k: v for k, v in own.items() if k in cls.KEYS})


def last_step(run_dir: Path) -> int | None:
    """The last training step logged in the run's metrics.jsonl (None without one)."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    return None


def print_status(study: str, rows: Sequence[tuple]) -> int:
    """A launcher's ``status``: one line per (Config, Outcome) with its last logged step, then the counts."""
    width = max((len(c.run.name) for c, _ in rows), default=0)
    counts = Counter(o.words.split(" (")[0].split(";")[0] for _, o in rows)  # finished, running, queued, ...
    for c, o in rows:
        step = last_step(Path(c.run.out_dir) / c.run.name)
        print(f"  {c.run.name:<{width}}  {f'step {step}' if step else '-':<10}  {o.words}")
    print(f"study {study}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return 0


def with_resume_flag(c):
    """(``c`` with ``run.resume`` set when its run directory already holds metrics, whether it resumes)."""
    resume = (Path(c.run.out_dir) / c.run.name / "metrics.jsonl").is_file()
    return replace(c, run=replace(c.run, resume=resume)), resume


@dataclass(frozen=True)
class LocalLauncher:
    """Runs on this machine, ``jobs`` at a time (1: in this process); its section has no keys of its own."""

    jobs: int = 1
    study: str = ""

    KEYS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def section_problems(cls, section: dict) -> list[str]:
        return []

    @classmethod
    def from_study(cls, study: dict, section: dict, jobs: int | None, *, detach: bool = False) -> LocalLauncher:
        if detach:
            raise ConfigError("--detach applies to a launcher whose runs outlive the study's process (--launcher "
                              "slurm, or launcher: {name: slurm} in the study file); the local launcher's runs end "
                              "with the study's process")
        return cls(jobs or 1, study.get("name", ""))

    def launch(self, configs: Sequence, study_dir: Path) -> Launched:
        if self.jobs == 1:
            return _run_serial(list(configs))
        return _Pool(list(configs), self.jobs, study_dir).run()

    def status(self, configs: Sequence, study_dir: Path) -> int:
        rows = []
        for c in configs:
            run_dir = Path(c.run.out_dir) / c.run.name
            if (run_dir / "result.json").is_file():
                rows.append((c, Outcome(c.run.name, FINISHED, "finished")))
            elif (run_dir / "metrics.jsonl").is_file():
                rows.append((c, Outcome(c.run.name, PREEMPTED, "unfinished (the same command resumes it)")))
            else:
                rows.append((c, Outcome(c.run.name, NOT_STARTED, "not started")))
        return print_status(self.study, rows)


class Progress:
    """Runs done, time elapsed, and the time left estimated as the mean wall time per finished run times the runs
    left."""

    def __init__(self, total: int, clock=time.monotonic):
        self.total, self.done, self.clock = total, 0, clock
        self.t0 = clock()

    def one_done(self) -> str:
        self.done += 1
        elapsed = self.clock() - self.t0
        left = self.total - self.done
        eta = f", about {fmt_time(elapsed / self.done * left)} left" if left else ""
        return f"[{self.done}/{self.total} runs done, {fmt_time(elapsed)} elapsed{eta}]"


def _run_serial(configs: list) -> Launched:
    outcomes = []
    progress = Progress(len(configs))
    for i, c in enumerate(configs):
        c, resume = with_resume_flag(c)
        print(f"== [{i + 1}/{len(configs)}] {c.run.name}{' (resuming)' if resume else ''}", flush=True)
        if trainer.train(c).stopped_by == "preempted":  # SIGTERM: the run saved a checkpoint; stop here, no report
            outcomes.append(Outcome(c.run.name, PREEMPTED, "preempted (checkpoint saved; the same command "
                                                           "resumes it)"))
            outcomes += [Outcome(x.run.name, NOT_STARTED, "not started") for x in configs[i + 1:]]
            return Launched(tuple(outcomes), 143)
        outcomes.append(Outcome(c.run.name, FINISHED, "finished"))
        print(f"== {c.run.name} finished {progress.one_done()}", flush=True)
    return Launched(tuple(outcomes), 0)


# The study parent's lifeline: its children inherit the read end of a pipe whose write end only the parent holds.
# When the parent ends, however it ends (SIGKILL included), the kernel closes the write end, the child reads EOF
# and stops as on SIGTERM: after its current step, with a checkpoint (``watch_parent``).
PARENT_FD_ENV = "ESLM_STUDY_PARENT_FD"


def watch_parent() -> None:
    """In a study's child (``eslm train`` started by ``eslm study``): SIGTERM this process when the study's
    process is gone. Does nothing in a process the study did not start."""
    fd = os.environ.pop(PARENT_FD_ENV, None)  # popped: the run's own subprocesses are not study children
    if fd is None or not fd.isdigit():
        return

    def wait() -> None:
        try:
            while os.read(int(fd), 1):
                pass
        except OSError:
            pass
        print("eslm study: the study process is gone: this run stops after its current step (checkpoint saved)",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="eslm-study-parent", daemon=True).start()


def _child_outcome(name: str, code: int, finished: bool, sent_term: bool) -> Outcome:
    """The outcome of a child that exited with ``code``."""
    if code == 0 and finished:
        return Outcome(name, FINISHED, "finished")
    if code == 0:  # eslm train exits 0 when SIGTERM stopped it after a step and its checkpoint
        return Outcome(name, PREEMPTED, "preempted (checkpoint saved; the same command resumes it)")
    if code in (-signal.SIGTERM, 128 + signal.SIGTERM) and sent_term:
        return Outcome(name, STOPPED, "stopped by SIGTERM before its first step (the same command starts it again)")
    return Outcome(name, FAILED, f"failed (exit {code})")


class _Pool:
    """Train up to ``jobs`` runs at once, each as ``python -m eslm.cli train PLAN.yaml`` with its resolved
    config. The children run in their own sessions, so a terminal's Ctrl-C or a signal to the study's process
    group reaches the study only, which passes SIGTERM on once to each child (each saves a checkpoint and
    exits) and waits for them; they also stop by themselves if the study's process dies (``watch_parent``)."""

    def __init__(self, configs: list, jobs: int, study_dir: Path):
        self.queue, self.jobs, self.study_dir = list(configs), jobs, study_dir
        self.threads = max(1, (os.cpu_count() or 1) // jobs)
        self.running: dict[str, tuple] = {}  # run name -> (process, log file, SIGTERM sent)
        self.run_dirs = {c.run.name: Path(c.run.out_dir) / c.run.name for c in configs}  # a shared model: models/
        self.outcomes: list[Outcome] = []
        self.stop = False
        self.progress = Progress(len(configs))

    def _on_sigterm(self, *_) -> None:
        self.stop = True

    def start(self, c, lifeline_r: int, env: dict) -> None:
        c, resume = with_resume_flag(c)
        if c.train.num_threads == 0:
            c = replace(c, train=replace(c.train, num_threads=self.threads))
        plan_file = self.study_dir / "plan" / f"{c.run.name}.yaml"
        atomic_write(plan_file, to_yaml(c).encode())  # whole: a child never reads half a plan; a link is replaced
        log = open_nofollow(self.study_dir / "logs" / f"{c.run.name}.log", "a")  # a planted link is refused
        cmd = [sys.executable, "-m", "eslm.cli", "train", str(plan_file)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(lifeline_r,),
                                start_new_session=True)
        self.running[c.run.name] = (proc, log, False)
        print(f"== {c.run.name}{' (resuming)' if resume else ''} started", flush=True)

    def terminate_all(self) -> None:
        for name, (proc, log, sent) in self.running.items():
            if not sent and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                self.running[name] = (proc, log, True)

    def reap(self) -> None:
        for name, (proc, log, sent) in list(self.running.items()):
            if proc.poll() is not None:
                log.close()
                del self.running[name]
                outcome = _child_outcome(name, proc.returncode, (self.run_dirs[name] / "result.json").is_file(),
                                         sent)
                print(f"== {name} {outcome.words} {self.progress.one_done()}", flush=True)
                self.outcomes.append(outcome)

    def run(self) -> Launched:
        ensure_dir(self.study_dir / "plan")  # never through a link
        ensure_dir(self.study_dir / "logs")
        main = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGTERM, self._on_sigterm) if main else None
        lifeline_r, lifeline_w = os.pipe()  # not inheritable: a child gets the read end only, through pass_fds
        env = {**os.environ, PARENT_FD_ENV: str(lifeline_r)}
        try:
            while self.queue or self.running:
                while self.queue and len(self.running) < self.jobs and not self.stop:
                    self.start(self.queue.pop(0), lifeline_r, env)
                if self.stop:
                    self.terminate_all()
                time.sleep(0.5)
                self.reap()
                if self.stop and not self.running:
                    rest = [Outcome(c.run.name, NOT_STARTED, "not started") for c in self.queue]
                    return Launched(tuple(self.outcomes + rest), 143)
        finally:
            if self.running:  # an exception or Ctrl-C in the study: its children stop cleanly before it goes
                self.terminate_all()
                for proc, log, _ in self.running.values():
                    proc.wait()
                    log.close()
            os.close(lifeline_r)
            os.close(lifeline_w)
            if old is not None:
                signal.signal(signal.SIGTERM, old)
        if failed := [o.name for o in self.outcomes if not o.finished]:
            print(f"study: {len(failed)} run(s) did not finish: {', '.join(failed)}; see {self.study_dir / 'logs'}",
                  file=sys.stderr)
        return Launched(tuple(self.outcomes), 1 if failed else 0)
