"""The confirmatory GPU study's window: its corpus (benchmarks/confirm_corpus.py) is refused, in one line, when it
differs from the pinned content hash (its build from the pinned downloads needs the network: run it by hand, see
its docstring); the window script (benchmarks/gpu_window.sh -> benchmarks/confirm_window.py): its CPU smoke on a
2-arm 1-seed mini study (tiny model, fp32), a window killed mid-run, the import of what came back, the study's
status, and the study file's corpus hash against the corpus builder's."""

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import confirm_corpus  # noqa: E402
import confirm_window  # noqa: E402
from eslm.data import manifest as mf  # noqa: E402


def test_check_accepts_the_pinned_hash_and_refuses_another_in_one_line(tiny_data, capsys):
    want = mf.read_manifest(tiny_data)["content_hash"]
    assert confirm_corpus.check(tiny_data, want)["content_hash"] == want
    assert confirm_corpus.main(["check", str(tiny_data)]) == 1  # the tiny corpus is not the pinned one
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and confirm_corpus.CONTENT_HASH in err and want in err


def test_check_refuses_a_changed_shard(tiny_data, tmp_path, capsys):
    import shutil

    copy = tmp_path / "c"
    shutil.copytree(tiny_data, copy)
    shard = next(copy.glob("train-*.bin"))
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    want = mf.read_manifest(tiny_data)["content_hash"]
    try:
        confirm_corpus.check(copy, want)
    except confirm_corpus.CorpusError as e:
        assert "sha256" in str(e) and "\n" not in str(e)
    else:
        raise AssertionError("a changed shard was accepted")


def test_the_pins_are_complete():
    assert len(confirm_corpus.CONTENT_HASH) == 64 and len(confirm_corpus.DEB[2]) == 64
    assert all(len(sha) == 64 for _, _, sha in confirm_corpus.WHEELS)

MINI = """# a 2-arm 1-seed mini study for the window script's CPU smoke
# corpus content_hash: {hash}
description: "mini"
methods: [eslm-entropy, random]
seeds: [7]
report: {{baseline: random, primary: [eslm-entropy, random]}}
config:
  model: {{preset: tiny}}
  data: {{dir: {data}, tokenizer: byte, seq_len: 32}}
  train: {{device: cpu, dtype: fp32, micro_batch_size_seqs: 4, grad_accum_steps: 1, max_steps: {steps},
          warmup_steps: 2, lr: 3.0e-3, num_threads: 1}}
  method: {{alpha: 0.2}}
  eval: {{interval: {steps}, tokens_per_domain: 256, batch_size_seqs: 4}}
  checkpoint: {{interval: 0}}
  log: {{interval: 2, tensorboard: false}}
"""


def _study(tmp_path, tiny_data, steps, name="mini-window"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(MINI.format(hash=mf.read_manifest(tiny_data)["content_hash"], data=tiny_data, steps=steps))
    return path


def _window(study, records, out, seconds, work, **kw):
    cmd = ["bash", str(ROOT / "benchmarks" / "gpu_window.sh"), str(seconds), str(out), "--mfu-s", "0", "--",
           "--study", str(study), "--records", str(records), "--work", str(work), "--first-run-s", "1",
           "--margin-s", "2"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kw)


def _archived(out: Path) -> set[str]:
    with tarfile.open(out / "records.tar.gz") as tar:
        return {Path(n).parts[1] for n in tar.getnames() if n.endswith("/result.json")}


def _finished(work: Path) -> set[str]:
    return {p.parent.name for p in work.glob("*/*/result.json")}


def test_window_smoke_runs_the_primary_pair_then_skips_recorded_runs(tiny_data, tmp_path):
    study, records = _study(tmp_path, tiny_data, steps=4), tmp_path / "records"
    proc = _window(study, records, tmp_path / "out", 300, tmp_path / "work")
    log = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, log
    assert _archived(tmp_path / "out") == {"eslm-entropy-s7", "random-s7"}
    assert log.index("eslm-entropy-s7 started") < log.index("random-s7 started")
    # import: records land in the folder, then the next window skips them all
    assert confirm_window.main(["import", str(tmp_path / "out" / "records.tar.gz"), "--study", str(study),
                                "--records", str(records)]) == 0
    for run in ("eslm-entropy-s7", "random-s7"):
        assert {"config.yaml", "metrics.jsonl", "result.json", "env.json"} <= {p.name for p in (records / run).iterdir()}
    mini = confirm_window.load_study(str(study))
    assert confirm_window.status_line(mini, confirm_window.plan(mini, tmp_path / "p"), records) == (
        f"mini-window: all 1 pairs run; the primary is read by `eslm report {records}/*-s* --baseline random "
        "--primary eslm-entropy random`")
    proc = _window(study, records, tmp_path / "out2", 300, tmp_path / "work2")
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and "started" not in log, log
    window = json.loads(next((records / "windows").iterdir()).read_text())
    assert window["finished"] == ["eslm-entropy-s7", "random-s7"]


def test_a_killed_window_returns_every_finished_run(tiny_data, tmp_path):
    """Kill the whole window (its process group, SIGKILL) while a run is training: every run that finished before
    is in the archive, and the archive is readable."""
    study, work, out = _study(tmp_path, tiny_data, steps=20), tmp_path / "work", tmp_path / "out"
    proc = _window(study, tmp_path / "records", out, 300, work)
    t0 = time.time()
    while time.time() - t0 < 200:
        if (out / "records.tar.gz").is_file() and _archived(out):
            break
        time.sleep(0.2)
    time.sleep(1.0)  # the next run is training now
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished, archived = _finished(work), _archived(out)
    assert finished and len(finished) < 2, finished  # killed mid-study
    assert finished <= archived


def test_the_deadline_stops_before_a_unit_that_does_not_fit(tiny_data, tmp_path):
    study = _study(tmp_path, tiny_data, steps=4)
    out = tmp_path / "out"
    code = confirm_window.main(["run", "--study", str(study), "--records", str(tmp_path / "r"), "--out", str(out),
                                "--deadline", str(time.time() + 30), "--first-run-s", "100", "--work",
                                str(tmp_path / "w")])
    assert code == 0 and _archived(out) == set()
    assert json.loads(tarfile.open(out / "records.tar.gz").extractfile(
        "mini-window/windows/" + next(n for n in tarfile.open(out / "records.tar.gz").getnames()
                                      if "/windows/" in n).split("/windows/")[1]).read())["finished"] == []


def test_a_wrong_corpus_is_refused_in_one_line(tiny_data, tmp_path, capsys):
    study = tmp_path / "mini-window.yaml"
    study.write_text(MINI.format(hash="0" * 64, data=tiny_data, steps=4))
    code = confirm_window.main(["run", "--study", str(study), "--records", str(tmp_path / "r"), "--out",
                                str(tmp_path / "o"), "--deadline", str(time.time() + 60)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "content hash" in err and "0" * 64 in err


def test_import_takes_a_pair_whole_or_not_at_all(tiny_data, tmp_path):
    """An archive whose window finished one arm of a pair: that arm is not imported (its twin runs with it later)."""
    study, records = _study(tmp_path, tiny_data, steps=4), tmp_path / "records"
    sha = confirm_window.sha256_bytes(study.read_bytes())
    window = {"id": "w1", "study_sha256": sha, "overrides": [], "finished": ["eslm-entropy-s7"]}
    out = tmp_path / "a.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        for name, blob in {"mini-window/windows/w1.json": json.dumps(window).encode(),
                           "mini-window/eslm-entropy-s7/result.json": b"{}"}.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    assert confirm_window.main(["import", str(out), "--study", str(study), "--records", str(records)]) == 0
    assert not (records / "eslm-entropy-s7").exists()
    # the status line reads records only
    configs = confirm_window.plan(confirm_window.load_study(str(study)), tmp_path / "p")
    line = confirm_window.status_line(confirm_window.load_study(str(study)), configs, records)
    assert line == "mini-window: 0 of 1 pairs run, no result read"


def test_the_confirmatory_study_runs_its_pairs_then_each_secondary_seed_by_seed(tmp_path):
    study = confirm_window.load_study(str(confirm_window.STUDY))
    got = [[c.run.name for c in u] for u in confirm_window.units(study, confirm_window.plan(study, tmp_path))]
    seeds = range(101, 117)
    assert got == ([[f"eslm-entropy-s{s}", f"random-s{s}"] for s in seeds] + [[f"random-domain-s{s}"] for s in seeds]
                   + [[f"clm-s{s}"] for s in seeds])


def test_the_study_file_names_the_corpus_builders_hash():
    assert confirm_window.corpus_hash(confirm_window.STUDY) == confirm_corpus.CONTENT_HASH


def test_readme_says_how_far_the_confirmatory_study_is(tmp_path):
    study = confirm_window.load_study(str(confirm_window.STUDY))
    configs = confirm_window.plan(study, tmp_path)
    line = confirm_window.status_line(study, configs, confirm_window.records_dir(study, None))
    assert line in (ROOT / "README.md").read_text()


def test_the_registered_study_file_is_unchanged():
    """configs/studies/confirm-124m-gpu.yaml was registered in fd946d6 before any run of it and is never edited:
    its SHA-256 is pinned here, and every window records it (window.json), which import checks."""
    assert confirm_window.sha256_bytes(confirm_window.STUDY.read_bytes()) == (
        "5dafd1266aace36f3ebcdbcebb6f5ddd985dde30cf52971986b56091f3c624c7")
