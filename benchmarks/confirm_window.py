"""The confirmatory GPU study across lent windows (configs/studies/confirm-124m-gpu.yaml; issue 42): run the next
runs of a window, import what came back, and say how far the study is.

    python benchmarks/confirm_window.py run --out OUT --deadline EPOCH [--study FILE] [--records DIR] [--set K=V ...]
    python benchmarks/confirm_window.py import ARCHIVE [--study FILE] [--records DIR]
    python benchmarks/confirm_window.py status [--study FILE] [--records DIR]

``run`` (what benchmarks/gpu_window.sh calls on the GPU machine) checks the corpus against the content hash the
study file names (its ``# corpus content_hash:`` line), plans the study's runs with eslm's own planner, skips
every run whose records are already in the records folder (default benchmarks/results/<study>/, committed after
each window), and trains the next runs in priority order until ``--deadline`` (seconds since the epoch) less a
margin: first the primary pairs (``report.primary``, both arms of a seed one after the other, so in one window),
seed by seed, then each other method of the study in the file's order, seed by seed. A unit (a pair, or one
secondary run) starts only when the time it needs (the longest run of this window so far, or ``--first-run-s``)
fits before the deadline; a run still going at the deadline is stopped and dropped (it is run again whole in a
later window). After each finished run, its small records (config.yaml, env.json, metrics.jsonl, result.json,
eslm-run.json, its log) join ONE archive, ``OUT/records.tar.gz``, rewritten whole and renamed into place, with
``window.json`` (the device, the study file's SHA-256, what ran and what was skipped): a window cut at any moment
returns every run that finished before the cut.

``import`` unpacks such an archive into the records folder: it refuses an archive of another study file (by its
SHA-256) and never overwrites a record that differs; a primary pair whose second arm did not finish is not
imported (both arms of a seed come from one window). ``status`` prints "k of n pairs run, no result read" until
every primary pair is in; it never computes a difference.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from eslm.config import to_yaml  # noqa: E402
from eslm.data import manifest as mf  # noqa: E402
from eslm.errors import ESLMError  # noqa: E402
from eslm.study.grid import plan  # noqa: E402
from eslm.study.schema import load_study  # noqa: E402

STUDY = ROOT / "configs" / "studies" / "confirm-124m-gpu.yaml"
RECORDS = ROOT / "benchmarks" / "results"
RECORD_FILES = ("config.yaml", "env.json", "metrics.jsonl", "result.json", "eslm-run.json", "train.log")
ARCHIVE = "records.tar.gz"
HASH_LINE = re.compile(r"^# corpus content_hash: ([0-9a-f]{64})\s*$", re.M)


class WindowError(Exception):
    """One line for the user."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def records_dir(study: dict, records: Path | None) -> Path:
    return records if records is not None else RECORDS / study["name"]


def corpus_hash(study_file: Path) -> str:
    m = HASH_LINE.search(study_file.read_text())
    if m is None:
        raise WindowError(f"expected a line '# corpus content_hash: <64 hex digits>' in {study_file}; found none; "
                          "fix: the study file names the corpus it was registered with")
    return m.group(1)


def check_corpus(data_dir: Path, want: str) -> dict:
    """The prepared corpus verified whole (every shard's SHA-256, then the content hash) before any run."""
    try:
        manifest = mf.read_manifest(data_dir)
        mf.verify_shards(data_dir, manifest, verify="hash")
    except ESLMError as e:
        raise WindowError(f"corpus: {e}") from None
    if manifest.get("content_hash") != want:
        raise WindowError(f"expected the corpus {data_dir} with content hash {want} (the study file's); found "
                          f"{manifest.get('content_hash')}; fix: carry the corpus that benchmarks/confirm_corpus.py "
                          "builds")
    return manifest


def units(study: dict, configs: list) -> list[list]:
    """The runs in priority order, grouped in units that run together: the primary pairs seed by seed, then
    every other method of the study in the file's order, seed by seed."""
    by = {(c.run.name.removesuffix(f"-s{c.run.seed}"), c.run.seed): c for c in configs}
    seeds = list(dict.fromkeys(c.run.seed for c in configs))
    groups = list(dict.fromkeys(g for g, _ in by))
    primary = list((study.get("report") or {}).get("primary") or [])
    out = [[by[(g, s)] for g in primary] for s in seeds] if primary else []
    for g in groups:
        if g not in primary:
            out += [[by[(g, s)]] for s in seeds]
    return out


def is_recorded(records: Path, name: str) -> bool:
    return (records / name / "result.json").is_file()


def _device() -> dict:
    info = {"host": platform.node(), "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception as e:  # the record says what it could not learn; the runs' env.json say it again
        info["device_error"] = repr(e)
    return info


class Archive:
    """``OUT/records.tar.gz``: every finished run's records and window.json, rewritten whole after each run and
    renamed into place, so the file on disk is always a complete archive."""

    def __init__(self, out: Path, study: dict, window: dict):
        self.path = out / ARCHIVE
        self.study, self.window = study, window
        self.members: dict[str, bytes] = {}

    def add_run(self, run_dir: Path, log: Path | None) -> None:
        name = run_dir.name
        for f in RECORD_FILES:
            src = log if f == "train.log" else run_dir / f
            if src is not None and src.is_file():
                self.members[f"{self.study['name']}/{name}/{f}"] = src.read_bytes()
        self.window["finished"].append(name)
        self.write()

    def write(self) -> None:
        self.window["written"] = time.time()
        data = dict(self.members)
        data[f"{self.study['name']}/windows/{self.window['id']}.json"] = (json.dumps(self.window, indent=1)
                                                                         + "\n").encode()
        tmp = self.path.with_name(f".{ARCHIVE}.tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for arc, blob in sorted(data.items()):
                info = tarfile.TarInfo(arc)
                info.size, info.mtime = len(blob), int(time.time())
                tar.addfile(info, io.BytesIO(blob))
        os.replace(tmp, self.path)


def _train(plan_file: Path, log: Path, until: float) -> int | None:
    """``eslm train PLAN`` in a child process (same process group: a killed window takes it along); SIGTERM at
    ``until`` (the run saves and stops, unfinished). Returns its exit code, None when stopped."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "eslm.cli", "train", str(plan_file)], stdout=f,
                                stderr=subprocess.STDOUT, env=env)
        try:
            return proc.wait(timeout=max(1.0, until - time.time()))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return None


def run_window(args) -> int:
    study_file = Path(args.study).resolve()
    study = load_study(str(study_file))
    records = records_dir(study, args.records)
    work = Path(args.work or tempfile.mkdtemp(prefix="confirm-window-"))
    configs = plan(study, work, overrides=list(args.set))
    manifest = check_corpus(Path(configs[0].data.dir), args.corpus_hash or corpus_hash(study_file))
    print(f"window: corpus {configs[0].data.dir} verified ({manifest['content_hash'][:12]}...)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    window = {"id": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), "study": study["name"],
              "study_sha256": sha256_bytes(study_file.read_bytes()), "overrides": list(args.set),
              "corpus_content_hash": manifest["content_hash"], "device": _device(), "started": time.time(),
              "deadline": args.deadline, "skipped_recorded": [], "finished": [], "stopped": [], "failed": []}
    archive = Archive(args.out, study, window)
    archive.write()
    longest = args.first_run_s
    for unit in units(study, configs):
        todo = [c for c in unit if not is_recorded(records, c.run.name)]
        window["skipped_recorded"] += [c.run.name for c in unit if c not in todo]
        if not todo:
            continue
        need = longest * len(todo)
        left = args.deadline - args.margin_s - time.time()
        if need > left:
            print(f"window: {left:.0f} s left before the margin, the next unit ({', '.join(c.run.name for c in todo)})"
                  f" needs about {need:.0f} s; stopping here", flush=True)
            break
        for c in todo:
            plan_file = work / "plan" / f"{c.run.name}.yaml"
            plan_file.parent.mkdir(parents=True, exist_ok=True)
            plan_file.write_text(to_yaml(c))
            log = work / "logs" / f"{c.run.name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            print(f"window: {c.run.name} started", flush=True)
            code = _train(plan_file, log, args.deadline - args.margin_s / 2)
            run_dir = Path(c.run.out_dir) / c.run.name
            wall = time.time() - t0
            if code == 0 and (run_dir / "result.json").is_file():
                archive.add_run(run_dir, log)
                longest = max(longest, wall) if window["finished"][1:] else wall
                print(f"window: {c.run.name} finished in {wall:.0f} s, archived", flush=True)
            else:
                window["stopped" if code is None else "failed"].append(c.run.name)
                archive.write()
                print(f"window: {c.run.name} {'stopped at the deadline' if code is None else f'failed ({code})'}"
                      f"; see {log}", flush=True)
                if code is None:
                    return 0
    print(f"window: {len(window['finished'])} run(s) finished and archived in {archive.path}", flush=True)
    return 0


def _read_archive(path: Path) -> dict[str, bytes]:
    try:
        with tarfile.open(path, "r:gz") as tar:
            return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    except (OSError, tarfile.TarError) as e:
        raise WindowError(f"expected a records archive at {path}; could not read it ({e})") from None


def import_archive(args) -> int:
    study_file = Path(args.study).resolve()
    study = load_study(str(study_file))
    records = records_dir(study, args.records)
    members = _read_archive(Path(args.archive))
    windows = [json.loads(b) for n, b in members.items() if n.startswith(f"{study['name']}/windows/")]
    if len(windows) != 1:
        raise WindowError(f"expected one window.json of study {study['name']} in {args.archive}; found "
                          f"{len(windows)}; fix: pass the records.tar.gz a window of this study returned")
    window = windows[0]
    if window["study_sha256"] != sha256_bytes(study_file.read_bytes()):
        raise WindowError(f"expected an archive of the study file {study_file} (sha256 "
                          f"{sha256_bytes(study_file.read_bytes())[:12]}...); found one of {window['study_sha256'][:12]}"
                          "...; fix: import it into the checkout of the commit that window ran")
    configs = plan(study, Path(tempfile.mkdtemp(prefix="confirm-import-")), overrides=window.get("overrides", []))
    finished = set(window["finished"])
    take, dropped = [], []
    for unit in units(study, configs):
        names = [c.run.name for c in unit]
        new = [n for n in names if n in finished]
        if new and len(unit) > 1 and not all(n in finished or is_recorded(records, n) for n in names):
            dropped += new  # a pair's lone arm: both arms of a seed come from one window
        else:
            take += new
    for name in take:
        files = {n.rsplit("/", 1)[1]: b for n, b in members.items() if n.startswith(f"{study['name']}/{name}/")}
        dest = records / name
        for f, blob in files.items():
            if (dest / f).is_file() and (dest / f).read_bytes() != blob:
                raise WindowError(f"expected {dest / f} to be absent or equal to the archive's; found a different "
                                  "file; nothing of this run was written; fix: check which window it came from")
    for name in take:
        dest = records / name
        dest.mkdir(parents=True, exist_ok=True)
        for n, blob in members.items():
            if n.startswith(f"{study['name']}/{name}/"):
                (dest / n.rsplit("/", 1)[1]).write_bytes(blob)
    wdir = records / "windows"
    wdir.mkdir(parents=True, exist_ok=True)
    (wdir / f"{window['id']}.json").write_text(json.dumps(window, indent=1) + "\n")
    print(f"imported {len(take)} run(s) into {records}" + (f"; not imported (a pair's lone arm, to be run again with "
                                                          f"its twin): {', '.join(dropped)}" if dropped else ""))
    print(status_line(study, configs, records))
    return 0


def status_line(study: dict, configs: list, records: Path) -> str:
    """How far the study is, without reading any result: complete primary pairs, then each secondary's runs."""
    us = units(study, configs)
    primary = [u for u in us if len(u) > 1]
    pairs = sum(all(is_recorded(records, c.run.name) for c in u) for u in primary)
    rest: dict[str, list[int]] = {}
    for u in us:
        if len(u) == 1:
            g = u[0].run.name.removesuffix(f"-s{u[0].run.seed}")
            rest.setdefault(g, [0, 0])
            rest[g][0] += is_recorded(records, u[0].run.name)
            rest[g][1] += 1
    more = "".join(f"; {g} {k} of {n} runs" for g, (k, n) in rest.items())
    if pairs < len(primary):
        return f"{study['name']}: {pairs} of {len(primary)} pairs run, no result read{more}"
    rep = study.get("report") or {}
    flags = "".join(f" --{k} {v}" for k, v in rep.items() if k in ("baseline", "target"))
    flags += f" --primary {' '.join(rep['primary'])}" if rep.get("primary") else ""
    return (f"{study['name']}: all {len(primary)} pairs run{more}; the primary is read by `eslm report "
            f"{records}/*-s*{flags}`")


def status(args) -> int:
    study = load_study(str(Path(args.study).resolve()))
    configs = plan(study, Path(tempfile.mkdtemp(prefix="confirm-status-")), overrides=list(args.set))
    print(status_line(study, configs, records_dir(study, args.records)))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "import", "status"):
        p = sub.add_parser(name)
        p.add_argument("--study", default=str(STUDY), help="the study file (default: the confirmatory 124M study)")
        p.add_argument("--records", type=Path, default=None, help="records folder (default benchmarks/results/STUDY)")
        if name != "import":
            p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                           help="config overrides for every run (the CPU smoke's tiny model); none in a real window")
    r = sub.choices["run"]
    r.add_argument("--out", type=Path, required=True, help="where records.tar.gz goes (the window's $OUT)")
    r.add_argument("--deadline", type=float, required=True, help="seconds since the epoch when the window ends")
    r.add_argument("--margin-s", type=float, default=20.0, help="kept free before the deadline")
    r.add_argument("--first-run-s", type=float, default=75.0, help="a run's time until one has run in this window")
    r.add_argument("--work", type=Path, default=None, help="run directories (default: a temporary folder)")
    r.add_argument("--corpus-hash", default="", help="the corpus content hash (default: the study file's line)")
    sub.choices["import"].add_argument("archive", type=Path)
    args = ap.parse_args(argv)
    try:
        return {"run": run_window, "import": import_archive, "status": status}[args.cmd](args)
    except (WindowError, ESLMError) as e:
        print(f"confirm_window: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
