"""benchmarks/gpu_suite.py: its CPU smoke mode runs every step and writes each step's files and figures (so the
script cannot rot between GPU sessions); user mistakes end at once with one line and status 2."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _suite(args: list[str], timeout: int = 3600) -> subprocess.CompletedProcess:  # a hang guard (seconds idle)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def _json(path: Path) -> dict:
    assert path.is_file(), f"missing {path.name}"
    return json.loads(path.read_text())


@pytest.mark.slow  # the whole suite in child processes (.ci/lowest leaves it out)
def test_smoke_mode_runs_every_step(tiny_data, tmp_path):
    out, bundle = tmp_path / "suite", tmp_path / "suite.tar.gz"
    gpu_tests = "tests/test_gpu.py::test_fused_head_matches_the_oracle"  # collected by -m gpu, skipped on a CPU
    proc = _suite(["--out", str(out), "--device", "cpu", "--preset", "tiny", "--data", str(tiny_data),
                   "--tests", gpu_tests, "--bundle", str(bundle)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    env = _json(out / "1-env.json")
    assert env["status"] == "ok" and env["environment"]["torch"] == torch.__version__
    assert env["environment"]["matmul_tflops"] > 0 and env["environment"]["matmul"] == "256^3 fp32"
    assert (out / "1-env.log").is_file()  # measured in a child process of its own

    lp = _json(out / "2-loss_path.json")
    assert lp["status"] == "ok", lp
    assert set(lp["targets"]) == {"clm_fused_mfu", "eslm_entropy_vs_clm_fused_time@0.1",
                                  "eslm_entropy_vs_clm_fused_time@0.5", "fused_vs_naive_peak_memory",
                                  "selection_fraction_of_step"}
    assert lp["targets"]["clm_fused_mfu"]["value"] > 0  # against the matmul rate measured in step 1
    assert all(t["met"] in (True, False) for t in lp["targets"].values() if t["value"] is not None)
    for v in ("clm-naive", "clm-fused", "eslm-entropy-fused@0.1", "eslm-loss-fused@0.5"):
        assert lp["rows"][v]["step_s"] > 0 and lp["rows"][v]["tokens_per_s"] > 0
    assert "eslm-entropy-fused@0.2" not in lp["rows"]  # the smoke runs alphas 0.1 and 0.5 only
    bench = _json(out / "2-loss_path-bench.json")
    assert bench["settings"]["dtype"] == "fp32" and bench["settings"]["preset"] == "tiny"
    assert (out / "2-loss_path-bench.md").is_file()

    prof = _json(out / "3-profile.json")
    assert prof["status"] == "ok", prof
    assert set(prof["profiles"]) == {"clm", "eslm-entropy@0.2"}
    for label, p in prof["profiles"].items():
        assert p["step_s_profiled"] > 0 and p["top"] and p["top"][0]["total_ms"] > 0
        assert "Name" in (out / "3-profile" / f"{label}.txt").read_text()  # the profiler's own table
    assert "aten::" in (out / "3-profile.md").read_text()

    assert _json(out / "4-loss_path_compile.json")["status"] == "skipped"  # no compile on a CPU unless asked

    pt = _json(out / "5-pytest.json")  # after the measurements
    assert pt["status"] == "ok" and pt["counts"].get("skipped", 0) > 0 and "-m gpu" in pt["command"]
    assert "skipped" in (out / "5-pytest.log").read_text()

    for n, step, kept in ((6, "train_clm", 1.0), (7, "train_eslm_entropy", 0.9)):
        rec = _json(out / f"{n}-{step}.json")
        assert rec["status"] == "ok", rec
        assert rec["steps_logged"] >= 2 and rec["first_loss"] > 0 and rec["last_loss"] > 0
        assert isinstance(rec["loss_fell"], bool) and rec["mfu_median"] is None  # MFU: GPU only
        metrics = [json.loads(line) for line in (out / f"{n}-{step}-metrics.jsonl").read_text().splitlines()]
        assert [r["kept_frac"] for r in metrics if r["kind"] == "train"][-1] == pytest.approx(kept, abs=0.05)
        assert _json(out / f"{n}-{step}-result.json")["step"] == 8
        assert "train:" in (out / f"{n}-{step}.yaml").read_text()

    summary = _json(out / "summary.json")
    assert [s["step"] for s in summary["steps"]] == ["env", "loss_path", "profile",
                                                     "loss_path_compile", "pytest", "train_clm",
                                                     "train_eslm_entropy"]
    assert "clm_fused_mfu" in summary["targets"] and (out / "summary.md").is_file()
    with tarfile.open(bundle) as tar:
        assert "suite/summary.md" in tar.getnames() and "suite/7-train_eslm_entropy.json" in tar.getnames()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_and_missing_data_are_one_line_errors(tmp_path):
    proc = _suite(["--out", str(tmp_path / "a")])
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("gpu_suite: error: --device cuda: no CUDA device here")
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "a").exists()
    proc = _suite(["--out", str(tmp_path / "b"), "--device", "cpu", "--data", str(tmp_path / "none")])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "expected a prepared corpus" in proc.stderr and not (tmp_path / "b").exists()


def test_the_pilot_corpus_builder_dedupes_and_splits_by_package(tmp_path):
    """benchmarks/site_corpus.py on a made-up site-packages: a vendored copy kept once, tests, caches,
    dist-info and non-UTF-8 files left out, packages in their domains, then prepared by `eslm prepare text`."""
    site = tmp_path / "site"
    files = {"torch/nn/mod.py": "import math\n\ndef f(x):\n    return math.sqrt(x)\n" * 20,
             "numpy/core.py": "def add(a, b):\n    return a + b\n" * 20,
             "foo/__init__.py": "VALUE = 1\n" * 30,
             "foo/_vendor/core.py": "def add(a, b):\n    return a + b\n" * 20,  # numpy/core.py's bytes again
             "foo/tests/test_foo.py": "def test():\n    pass\n", "foo/__pycache__/x.py": "x = 1\n",
             "foo-1.0.dist-info/x.py": "y = 2\n", "single.py": "Z = 3\n" * 30}
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    (site / "foo" / "latin.py").write_bytes(b"# caf\xe9\n")
    out = tmp_path / "corpus"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "site_corpus.py"), "--out", str(out),
                           "--roots", str(site), "--tokenizer", "byte"], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    src = tmp_path / "corpus.src"
    got = sorted(str(p.relative_to(src)) for p in src.rglob("*.py"))
    assert got == ["science/numpy/core.py", "tools/foo/__init__.py", "tools/single.py", "torch/torch/nn/mod.py"]
    info = json.loads((src / "corpus.json").read_text())
    assert info["domains"]["tools"]["duplicates"] == 1 and info["domains"]["tools"]["not_utf8"] == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["domains"]) == ["science", "tools", "torch"]


def test_the_triton_backend_is_checked_against_the_targets_where_it_ran(monkeypatch):
    """On CUDA the loss path also times the triton backend (what train.loss_impl=auto runs there): the targets
    are checked on it too, each ratio within that backend (ESLM-entropy triton over CLM triton; triton over the
    naive twin's memory), from a result that has the rows; none where it did not run (a CPU)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_suite

    def row(variant, step_s, peak, mfu=0.3):
        return {"variant": variant, "step_s": step_s, "peak_bytes": peak, "mfu": mfu, "mem_vs_clm_naive": peak / 10.0,
                "time_vs_clm_fused": step_s / 4.0, "mem_vs_naive_twin": 0.6}
    rows = [row("clm-naive", 3.5, 10.0), row("clm-fused", 4.0, 5.0), row("clm-triton", 3.0, 4.5, mfu=0.37)]
    for a, t in ((0.1, 3.03), (0.5, 2.85)):
        rows += [row(f"eslm-entropy-naive@{a}", 4.8, 12.0), row(f"eslm-entropy-fused@{a}", 4.3, 7.0),
                 row(f"eslm-entropy-triton@{a}", t, 6.6)]
    bench = {"rows": rows, "selection_overhead": {"0.1": {"fraction_of_clm_fused_step": 0.1}}}
    got = gpu_suite.loss_path_targets(bench)
    assert got["clm_triton_mfu"] == {"value": 0.37, "goal": ">= 0.45", "met": False}
    assert got["eslm_entropy_vs_clm_triton_time@0.1"]["value"] == pytest.approx(1.01)
    assert got["eslm_entropy_vs_clm_triton_time@0.1"]["met"] is True
    assert got["eslm_entropy_vs_clm_triton_time@0.5"]["value"] == pytest.approx(0.95)
    assert got["triton_vs_naive_peak_memory"]["value"] == pytest.approx(0.55)  # 6.6 / 12.0 beats 4.5 / 10.0
    assert got["triton_vs_naive_peak_memory"]["met"] is False
    cpu = gpu_suite.loss_path_targets({**bench, "rows": [r for r in rows if "triton" not in r["variant"]]})
    assert not any("triton" in k for k in cpu)
