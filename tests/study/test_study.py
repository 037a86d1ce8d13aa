"""`eslm study`: finding study files, the equal-FLOPs plan."""

from __future__ import annotations

import json

import pytest

from eslm import study
from eslm.errors import ConfigError, ESLMError
from eslm.files import new_marker
from eslm.study import launch

STUDY = """methods: [clm, eslm-entropy]
seeds: [1]
budget: {steps_of: clm}
config:
  model: {preset: tiny}
  data: {seq_len: 64}
  train: {max_steps: 10}
"""


def test_builtin_demo_is_found_by_name():
    s = study.load_study("demo")
    assert s["name"] == "demo" and "clm" in s["methods"]


def test_installed_without_source_tree_falls_back_to_cwd(tmp_path, monkeypatch):
    # a non-editable install: the package's parents hold no configs/studies; the repository root is the cwd
    monkeypatch.setattr(study.schema, "STUDIES_DIR", tmp_path / "site-packages" / "configs" / "studies")
    (tmp_path / "repo" / "configs" / "studies").mkdir(parents=True)
    (tmp_path / "repo" / "configs" / "studies" / "mine.yaml").write_text(STUDY)
    monkeypatch.chdir(tmp_path / "repo")
    assert study.load_study("mine")["methods"] == ["clm", "eslm-entropy"]
    with pytest.raises(ConfigError, match="one of: mine"):
        study.load_study("nope")


def test_no_study_files_anywhere_gives_a_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(study.schema, "STUDIES_DIR", tmp_path / "nowhere")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"looked in: .*fix: pass a path .*put demo.yaml in ./configs/studies"):
        study.load_study("demo")


def test_a_path_always_works(tmp_path, monkeypatch):
    monkeypatch.setattr(study.schema, "STUDIES_DIR", tmp_path / "nowhere")
    f = tmp_path / "grid.yaml"
    f.write_text(STUDY)
    runs = study.plan(study.load_study(str(f)), tmp_path / "out")
    assert [r.method.name for r in runs] == ["clm", "eslm-entropy"]
    # equal FLOPs: the same budget for every run, and max_steps raised so that the budget binds
    assert len({r.train.max_flops for r in runs}) == 1 and all(r.train.max_steps > 10 for r in runs)
    assert all(r.train.lr_decay_steps == 10 for r in runs)


def test_sigterm_stops_the_study_without_a_report(tmp_path, monkeypatch):
    # a run stopped by SIGTERM (preempted) must not be followed by the next run or by a report of unfinished runs
    import eslm.analysis.report as report
    import eslm.train.trainer as trainer

    f = tmp_path / "grid.yaml"
    f.write_text(STUDY)
    started, reported = [], []

    def fake_train(cfg):
        started.append(cfg.run.name)
        return trainer.RunResult(tmp_path, 3, None, "preempted")

    monkeypatch.setattr(trainer, "train", fake_train)
    monkeypatch.setattr(report, "build_report", lambda *a, **k: reported.append(a) or {})
    assert study.run_study(str(f), tmp_path / "out") == 143
    assert started == ["clm-s1"] and reported == []


SWEEP = """methods:
  - clm
  - eslm-entropy
  - {name: eslm-loss, label: eslm-loss-dom, method.standardize: domain}
seeds: [1, 2]
sweep:
  method.alpha: {values: [0.1, 0.3], methods: [eslm-entropy]}
  train.lr: [0.001, 0.002]
config:
  model: {preset: tiny}
  data: {seq_len: 64}
  train: {max_steps: 10}
report: {baseline: clm-lr0.001}  # two CLM grid points: the report is told which is the baseline
"""


def test_sweep_file_expands_to_the_full_grid_with_readable_names(tmp_path):
    f = tmp_path / "sweep.yaml"
    f.write_text(SWEEP)
    runs = study.plan(study.load_study(str(f)), tmp_path / "out")
    # per seed: clm x 2 lr, eslm-entropy x 2 alpha x 2 lr, eslm-loss-dom x 2 lr = 8; two seeds
    assert len(runs) == 16
    names = [r.run.name for r in runs]
    assert names[:8] == ["clm-lr0.001-s1", "clm-lr0.002-s1", "eslm-entropy-alpha0.1-lr0.001-s1",
                         "eslm-entropy-alpha0.1-lr0.002-s1", "eslm-entropy-alpha0.3-lr0.001-s1",
                         "eslm-entropy-alpha0.3-lr0.002-s1", "eslm-loss-dom-lr0.001-s1", "eslm-loss-dom-lr0.002-s1"]
    assert names[8:] == [n.replace("-s1", "-s2") for n in names[:8]]  # seeds outermost: paired seeds finish together
    by = {r.run.name: r for r in runs}
    assert by["eslm-entropy-alpha0.3-lr0.002-s2"].method.alpha == 0.3
    assert by["eslm-entropy-alpha0.3-lr0.002-s2"].train.lr == 0.002 and by["clm-lr0.001-s1"].method.alpha == 0.1
    assert by["eslm-loss-dom-lr0.001-s1"].method.standardize == "domain"
    assert by["eslm-loss-dom-lr0.001-s1"].method.name == "eslm-loss"


def test_sweep_errors_are_one_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(SWEEP.replace("train.lr: [0.001, 0.002]", "train.lr: 0.001"))
    with pytest.raises(ConfigError, match="expected a non-empty list"):
        study.plan(study.load_study(str(f)), tmp_path / "out")
    f.write_text(SWEEP.replace("train.lr: [0.001, 0.002]", "train.lrr: [0.1]"))
    with pytest.raises(ConfigError, match="unknown config key 'train.lrr'"):
        study.plan(study.load_study(str(f)), tmp_path / "out")
    f.write_text("methods: [clm\nseeds: [1]")
    with pytest.raises(ConfigError, match="not valid YAML"):
        study.load_study(str(f))


def test_one_seed_pairs_methods_same_initial_weights_and_batches(tiny_data, tmp_path):
    """For one seed every method starts from the same weights and sees the same batches (paired seeds)."""
    import torch

    from conftest import tiny_overrides
    from eslm.config import build_config
    from eslm.train.trainer import Trainer

    def first(method, **extra):
        cfg = build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{"method.name": method,
                                                                            "run.seed": 7, **extra}))
        tr = Trainer(cfg)
        return tr.raw_model.state_dict(), [tr.loader.next_batch() for _ in range(3)]

    ref_w, ref_b = first("clm")
    for method, extra in (("eslm-entropy", {}), ("random", {"method.alpha": 0.3}),
                          ("ada-eslm-loss", {"method.standardize": "domain"})):
        w, b = first(method, **extra)
        assert all(torch.equal(ref_w[k], w[k]) for k in ref_w), method
        assert all(torch.equal(x.x, y.x) and torch.equal(x.y, y.y) for x, y in zip(ref_b, b)), method
    # GREATS holds out the tail of each domain's training stream (its validation data): its batches are CLM's
    # but for the windows that reach that tail, which are drawn again before it (eslm.data.loader, part "fit")
    w, b = first("greats")
    assert all(torch.equal(ref_w[k], w[k]) for k in ref_w)
    same = _rows_outside_tail_equal(tiny_data, ref_b, b)
    assert same >= len(ref_b) * ref_b[0].x.shape[0] // 2
    other_w, other_b = first("clm", **{"run.seed": 8})
    assert not torch.equal(other_w["transformer.wte.weight"], ref_w["transformer.wte.weight"])
    assert not torch.equal(other_b[0].x, ref_b[0].x)


def _rows_outside_tail_equal(data_dir, ref, got) -> int:
    """Check that each row of ``got`` equals the same row of ``ref`` wherever ``ref``'s window lies before its
    domain's held-out tail; the number of such rows."""
    import torch

    from eslm.data.loader import held_out_start, open_dataset

    ds, same = open_dataset(data_dir), 0
    for a, b in zip(ref, got):
        assert torch.equal(a.domain, b.domain)
        for xa, ya, xb, yb, dom in zip(a.x, a.y, b.x, b.y, a.domain.tolist()):
            stream = ds.tokens("train", ds.domains[dom])
            fit = stream[:held_out_start(stream, ds.eot_id)]
            window = torch.cat([xa, ya[-1:]]).numpy().astype(fit.dtype).tobytes()
            hay, at = fit.tobytes(), -1
            while True:
                at = hay.find(window, at + 1)
                if at < 0 or at % fit.dtype.itemsize == 0:
                    break
            if at >= 0:
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
                same += 1
    return same


# ---------------------------------------------------------------- the study file, checked whole before any run

def _cli_study(tmp_path, text: str, *extra: str) -> tuple[int, str]:
    """``eslm study FILE --out tmp/out ...`` in this process: (exit code, stderr)."""
    import contextlib
    import io

    from eslm.cli import main

    f = tmp_path / "s.yaml"
    f.write_text(text)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["study", str(f), "--out", str(tmp_path / "out"), *extra])
    return code, err.getvalue()


BROKEN = """methods: clm
seeds: 1
config: 5
budget: {steps_of: bogus, counter: bogus}
report: {baseline: 3, target: -1, primary: clm, colour: red}
jobs: 0
typo: 1
"""


def test_every_structural_problem_is_refused_at_once_one_line_each(tmp_path):
    code, err = _cli_study(tmp_path, BROKEN)
    assert code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert "11 problem(s), nothing was run" in lines[0]
    expected = ["unknown key(s) 'typo'", "methods: expected a list, found the text 'clm'; write methods: [clm]",
                "seeds: expected a list of integer seeds, found 1; write seeds: [1]",
                "config: expected a mapping", "budget.steps_of: expected one of the study's methods",
                "budget.counter: expected one of flops_paper, flops_executed, flops_dense, got 'bogus'",
                "report: unknown key(s) 'colour'", "report.baseline: expected a group or method name, found 3",
                "report.target: expected a positive validation loss or 'baseline', found -1",
                "report.primary: expected two different group names", "jobs: expected an integer >= 1, found 0"]
    assert len(lines) == 1 + 11  # the headline and one line per problem
    for text in expected:
        assert sum(text in line for line in lines[1:]) == 1, text
    assert not (tmp_path / "out").exists()  # nothing was created
    assert "--" not in err  # names no command-line flag (eslm study has no --baseline)


STUDY_OK = """methods: [clm, eslm-entropy, {name: eslm-loss, label: loss-dom, method.standardize: domain}]
seeds: [1, 2]
sweep:
  method.alpha: {values: [0.1, 0.3], methods: [eslm-entropy]}
config: {model: {preset: tiny}, data: {seq_len: 64}, train: {max_steps: 10}}
"""


@pytest.mark.parametrize("change, message", [
    (("seeds: [1, 2]", "seeds: [1, 2, 2]"), "seeds: seed 2 is listed 2 times; list each seed once"),
    (("seeds: [1, 2]", "seeds: []"), "seeds: expected a non-empty list of integer seeds, found []"),
    (("methods: [clm, ", "methods: []\nx: [clm, "), "methods: expected a non-empty list"),
    (("methods: [eslm-entropy]", "methods: [eslm-entrpy]"),
     "sweep 'method.alpha': methods names 'eslm-entrpy', which is no entry of the study's methods"),
    (("methods: [eslm-entropy]", "methods: eslm-entropy"),
     "sweep 'method.alpha': methods: expected a list, found the text 'eslm-entropy'"),
    (("methods: [eslm-entropy]", "methods: []"), "sweep 'method.alpha': methods: expected a non-empty list"),
    (("[0.1, 0.3]", "[0.1, 0.1]"), "sweep 'method.alpha': the value 0.1 is listed twice"),
    (("label: loss-dom", "label: ../elsewhere"), "methods entry 3: label: expected a single path-safe name"),
    (("label: loss-dom", "label: /tmp/x"), "methods entry 3: label: expected a single path-safe name"),
    (("{name: eslm-loss,", "{nam: eslm-loss,"), "methods entry 3: a mapping needs 'name'"),
    (("[clm, eslm-entropy,", "[clm, clm, eslm-entropy,"), "methods: the entry 'clm' is listed 2 times"),
    (("[clm, eslm-entropy,", "[clm, eslm-entropi,"), "methods entry 2: unknown method 'eslm-entropi' (did you mean"),
    (("seeds: [1, 2]", "seeds: [1, 2]\nbudget: {counter: flops_executed}"),
     "budget.counter applies with budget.steps_of only"),
    (("seeds: [1, 2]", "seeds: [1, 2]\nbudget: {steps_of: loss-dom, counter: flops_paper}"), None),
])
def test_study_file_mistakes_are_refused_before_any_run(tmp_path, change, message):
    f = tmp_path / "s.yaml"
    assert change[0] in STUDY_OK
    f.write_text(STUDY_OK.replace(change[0], change[1], 1))
    if message is None:
        study.plan(study.load_study(str(f)), tmp_path / "out")
        return
    with pytest.raises(ConfigError, match="nothing was run") as e:
        study.plan(study.load_study(str(f)), tmp_path / "out")
    assert message in str(e.value)


def test_runs_that_would_train_the_same_thing_are_refused(tmp_path):
    code, err = _cli_study(tmp_path, STUDY_OK.replace("methods: [clm,", "methods: [clm, {name: clm, label: clm2},"),
                           "--dry-run")
    assert code == 2 and "clm and clm2 plan the same runs" in err and err.count("plan the same runs") == 1
    code, err = _cli_study(tmp_path, STUDY_OK, "--seeds", "3", "3", "--dry-run")
    assert code == 2 and "--seeds: seed 3 is listed 2 times" in err
    code, err = _cli_study(tmp_path, STUDY_OK, "--jobs", "0", "--dry-run")
    assert code == 2 and "--jobs: expected an integer >= 1, found 0" in err
    code, err = _cli_study(tmp_path, STUDY_OK.replace("max_steps: 10}", "max_steps: 10, lrr: 1}"), "--dry-run")
    # a config problem every run shares is said once
    assert code == 2 and err.count("unknown config key 'train.lrr'") == 1 and "every run:" in err


def test_report_section_names_groups_of_the_study(tmp_path):
    def problems(report: str) -> str:
        code, err = _cli_study(tmp_path, STUDY_OK + f"report: {report}\n", "--dry-run")
        return "" if code == 0 else err

    # a group is named by its label, its grid point (run names without -s<seed>) or a method with one group
    assert problems("{baseline: clm, primary: [eslm-entropy-alpha0.3, loss-dom], target: baseline}") == ""
    assert problems("{baseline: 'eslm-entropy (method.alpha=0.1)', primary: [eslm-loss, clm]}") == ""
    err = problems("{baseline: eslm-entropy, primary: [loss-dom, nope]}")
    assert "report.baseline: 'eslm-entropy' is the method of 2 groups; name one of 'eslm-entropy-alpha0.1', " \
           "'eslm-entropy-alpha0.3'" in err
    assert "report.primary: no group 'nope' among the runs" in err and "--" not in err
    err = problems("{target: baseline}").replace("\n", " ")
    assert "no group 'clm'" not in err  # clm is in this study: the default baseline exists
    code, err = _cli_study(tmp_path, STUDY_OK.replace("[clm, ", "[") + "report: {target: baseline}\n", "--dry-run")
    assert code == 2 and "no group 'clm' among the runs" in err and "add report.baseline" in err


def test_a_study_file_name_that_is_no_path_safe_name_is_refused(tmp_path):
    f = tmp_path / "-grid.yaml"
    f.write_text(STUDY_OK)
    with pytest.raises(ConfigError, match="the study's name .*: expected a single path-safe name"):
        study.load_study(str(f))


# ---------------------------------------------------------------- the study process and its children

LONG = """methods: [clm, eslm-entropy]
seeds: [1]
report: {{controls: false}}
config:
  model: {{preset: tiny}}
  data: {{dir: {data}, tokenizer: byte, seq_len: 32}}
  train: {{max_steps: 100000, micro_batch_size_seqs: 2, warmup_steps: 2, num_threads: 1}}
  eval: {{interval: 0, tokens_per_domain: 256, batch_size_seqs: 4}}
  checkpoint: {{interval: 0}}
  log: {{interval: 1, tensorboard: false}}
"""


def _start_study(tmp_path, tiny_data):
    """``eslm study`` of two endless runs with --jobs 2 in a subprocess, once both children train: (process,
    {run name: child PID})."""
    import json
    import os
    import subprocess
    import sys
    import time

    f = tmp_path / "long.yaml"
    f.write_text(LONG.format(data=tiny_data))
    cmd = [sys.executable, "-m", "eslm.cli", "study", str(f), "--out", str(tmp_path / "out"), "--jobs", "2"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    runs = {n: tmp_path / "out" / "long" / n for n in ("clm-s1", "eslm-entropy-s1")}
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if all((d / "metrics.jsonl").is_file() and (d / "metrics.jsonl").read_text().count('"train"') >= 2
               for d in runs.values()):
            pids = {n: json.loads((d / "eslm.lock").read_text())["pid"] for n, d in runs.items()}
            return proc, pids, cmd
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("the study's runs did not start training: " + (proc.communicate()[0] or "")[-3000:])


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # an orphan nobody reaps is a zombie: it has ended
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _end(pids) -> None:
    import os
    import signal

    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_second_study_on_one_directory_is_refused_and_sigterm_reports_preempted_runs(tmp_path, tiny_data):
    import signal
    import subprocess

    proc, pids, cmd = _start_study(tmp_path, tiny_data)
    try:
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        err = second.stderr.strip().splitlines()
        assert len(err) == 1 and "is in use by PID" in err[0] and str(proc.pid) in err[0], second.stderr
        assert all(_alive(p) for p in pids.values())  # the first study's runs were left alone
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=180)[0]
    finally:
        proc.kill()
        _end(pids.values())
    assert proc.returncode == 143, out
    for name in pids:
        assert f"== {name} preempted (checkpoint saved" in out, out
        assert list((tmp_path / "out" / "long" / name / "checkpoints").glob("step_*.pt")), name
    assert "exit -15" not in out


def test_children_end_when_the_study_process_is_killed(tmp_path, tiny_data):
    import time

    proc, pids, _ = _start_study(tmp_path, tiny_data)
    try:
        proc.kill()  # SIGKILL: the study cannot pass anything on
        proc.communicate(timeout=60)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(_alive(p) for p in pids.values()):
            time.sleep(0.5)
        alive = [n for n, p in pids.items() if _alive(p)]
    finally:
        _end(pids.values())
    assert alive == [], f"orphaned runs still training: {alive}"
    for name in pids:  # each stopped cleanly, as on SIGTERM: a checkpoint to resume from
        assert list((tmp_path / "out" / "long" / name / "checkpoints").glob("step_*.pt")), name


def test_plan_files_are_replaced_whole_and_a_planted_link_is_not_followed(tmp_path):
    outside = tmp_path / "users-file.yaml"
    outside.write_text("mine\n")
    plan_file = tmp_path / "plan" / "clm-s1.yaml"
    plan_file.parent.mkdir()
    plan_file.symlink_to(outside)
    launch.atomic_write(plan_file, b"run: {name: clm-s1}\n")  # as the launcher writes a plan
    assert outside.read_text() == "mine\n" and not plan_file.is_symlink()
    assert plan_file.read_text() == "run: {name: clm-s1}\n" and [p.name for p in plan_file.parent.iterdir()] == [
        "clm-s1.yaml"]  # no temporary file left


def test_a_report_failing_after_training_says_so_and_names_the_study_files_keys(tmp_path):
    from analysis.test_report import make_run

    runs = [make_run(tmp_path / "r", "clm-s1", "clm", 1), make_run(tmp_path / "r", "eslm-s1", "eslm-entropy", 1)]
    with pytest.raises(ESLMError) as e:
        study.run_report({"name": "grid", "report": {"baseline": "nope"}}, runs, tmp_path / "rep", 0.0)
    msg = str(e.value)
    assert msg.startswith("study grid: every run finished, but the report failed: report.baseline: no group 'nope'")
    assert "finished runs are skipped" in msg and "--" not in msg


def test_continuing_a_study_marks_its_earlier_report_stale(tmp_path, monkeypatch):
    import eslm.train.trainer as trainer
    from analysis.test_report import make_run
    from eslm.analysis import figures
    from eslm.analysis.report import build_report

    monkeypatch.setattr(figures, "available", lambda: False)
    f = tmp_path / "grid.yaml"
    f.write_text(STUDY)
    old = [make_run(tmp_path / "old", "clm-s1", "clm", 1)]
    build_report([str(p) for p in old], tmp_path / "out" / "grid" / "report")
    # the earlier study's directory, as eslm marks it (an unmarked one holding report/ is not eslm's: refused)
    (tmp_path / "out" / "grid" / "eslm-study.json").write_text(json.dumps(new_marker("eslm-study-v1")) + "\n")
    monkeypatch.setattr(trainer, "train", lambda cfg: trainer.RunResult(tmp_path, 3, None, "preempted"))
    assert study.run_study(str(f), tmp_path / "out") == 143
    page = (tmp_path / "out" / "grid" / "report" / "index.html").read_text()
    assert "STALE: written before eslm study grid continued on " in page and "with 2 unfinished run(s)" in page


def test_a_study_whose_runs_the_report_could_not_compare_is_refused(tmp_path):
    code, err = _cli_study(tmp_path, STUDY_OK.replace("seeds: [1, 2]", "seeds: [1, 2]\nsweep_model: x").replace(
        "sweep:\n", "sweep:\n  model.preset: [tiny, small]\n").replace("sweep_model: x\n", ""), "--dry-run")
    assert code == 2 and "found 2 sets that differ in model.preset" in err and "run one study per set" in err


# ---------------------------------------------------------------- branched studies (eslm.train.branch)

BRANCHED = """methods: [clm, random]
seeds: [3]
budget: {{steps_of: clm}}
branch: {{from: clm, at_tokens: {at}}}
config:
  model: {{preset: tiny}}
  data: {{dir: {data}, tokenizer: byte, seq_len: 32}}
  train: {{micro_batch_size_seqs: 4, grad_accum_steps: 1, max_steps: 6, warmup_steps: 2, num_threads: 1}}
  method: {{alpha: 0.3}}
  eval: {{interval: 3, tokens_per_domain: 256, batch_size_seqs: 4}}
  checkpoint: {{interval: 0}}
  log: {{interval: 1, tensorboard: false}}
"""


def test_a_branched_study_trains_each_trunk_once_also_when_resumed(tmp_path, tiny_data, monkeypatch):
    import eslm.train.trainer as trainer
    from eslm.analysis import figures

    monkeypatch.setattr(figures, "available", lambda: False)
    real_train, calls, stop_first_arm = trainer.train, [], [True]

    def counting_train(cfg):
        calls.append(cfg.run.name)
        if cfg.run.name != "trunk-clm-s3" and stop_first_arm:  # the study is stopped after its trunk
            stop_first_arm.clear()
            return trainer.RunResult(tmp_path, 0, None, "preempted")
        return real_train(cfg)

    monkeypatch.setattr(trainer, "train", counting_train)
    f = tmp_path / "b.yaml"
    f.write_text(BRANCHED.format(at=2 * 4 * 32, data=tiny_data))
    assert study.run_study(str(f), tmp_path / "out") == 143
    trunk_ckpt = tmp_path / "out" / "b" / "trunk-clm-s3" / "checkpoints" / "step_0000002.pt"
    written = trunk_ckpt.stat().st_mtime_ns
    assert study.run_study(str(f), tmp_path / "out") == 0
    assert calls == ["trunk-clm-s3", "clm-s3", "clm-s3", "random-s3"]  # the trunk once, never again
    assert trunk_ckpt.stat().st_mtime_ns == written
    for arm in ("clm-s3", "random-s3"):
        result = json.loads((tmp_path / "out" / "b" / arm / "result.json").read_text())
        assert result["branch"]["from"] == str(trunk_ckpt) and result["branch"]["step"] == 2
    assert study.run_study(str(f), tmp_path / "out") == 0 and calls.count("trunk-clm-s3") == 1
    # the report: the trunks are not among its runs; each group's costs from the branch point beside its totals
    summary = json.loads((tmp_path / "out" / "b" / "report" / "summary.json").read_text())
    assert sorted(r["name"] for r in summary["runs"]) == ["clm-s3", "random-s3"]
    since = {g["label"]: g["since_branch"] for g in summary["groups"]}
    assert since["random"]["step"]["mean"] == 2
    assert 0 < since["random"]["flops_paper"]["mean"] < summary["groups"][1]["final_flops_paper"]["mean"]


def test_a_changed_branch_setting_is_refused(tmp_path, tiny_data, monkeypatch):
    import eslm.train.trainer as trainer

    monkeypatch.setattr(trainer, "train", lambda cfg: trainer.RunResult(tmp_path, 0, None, "preempted"))
    f = tmp_path / "b.yaml"
    f.write_text(BRANCHED.format(at=256, data=tiny_data))
    assert study.run_study(str(f), tmp_path / "out") == 143  # started: branch recorded
    f.write_text(BRANCHED.format(at=384, data=tiny_data))
    with pytest.raises(ConfigError, match=r"its runs were started with branch from clm at step 2 \(256 tokens\); "
                                          r"the study file now says from clm at step 3 \(384 tokens\)"):
        study.run_study(str(f), tmp_path / "out")
    f.write_text(BRANCHED.format(at=256, data=tiny_data).replace("branch: {from: clm, at_tokens: 256}\n", ""))
    with pytest.raises(ConfigError, match=r"the study file now says none"):
        study.run_study(str(f), tmp_path / "out")
    # runs of a study that did not branch are not continued as a branched one either
    (tmp_path / "out" / "b" / "branch.json").unlink()
    (tmp_path / "out" / "b" / "clm-s3").mkdir()
    f.write_text(BRANCHED.format(at=256, data=tiny_data))
    with pytest.raises(ConfigError, match=r"clm-s3 started without a branch; the study file now says from clm"):
        study.run_study(str(f), tmp_path / "out")


def test_branch_section_mistakes_are_refused(tmp_path, tiny_data):
    text = BRANCHED.format(at=256, data=tiny_data)
    code, err = _cli_study(tmp_path, text.replace("{from: clm, at_tokens: 256}", "{from: clmm, at_tokens: -5, x: 1}"),
                           "--dry-run")
    assert code == 2 and "branch: unknown key(s) 'x'" in err and "branch.from: unknown method 'clmm'" in err
    assert "branch.at_tokens: expected a positive number of training tokens, found -5" in err
    code, err = _cli_study(tmp_path, text.replace("at_tokens: 256", "at_tokens: 128"), "--dry-run")
    assert code == 2 and "branch.at_tokens: 128 tokens is step 1, inside the warmup (2 steps)" in err
    code, err = _cli_study(tmp_path, text.replace("at_tokens: 256", "at_tokens: 100000"), "--dry-run")
    assert code == 2 and "at or past the end of the schedule (6 steps)" in err
    # issue 47: every arm must be able to continue its seed's trunk, checked by the dry run (not at branch_from)
    code, err = _cli_study(tmp_path, text.replace("seeds: [3]", "seeds: [3]\nsweep: {train.lr: [0.001, 0.002]}"),
                           "--dry-run")
    assert code == 2 and "branch: clm-lr0.002-s3, random-lr0.002-s3 set train.lr otherwise than their seed's first" \
        in err, err
    code, err = _cli_study(tmp_path, text.replace("methods: [clm, random]", "methods: [clm, {name: random, "
                                                  "train.micro_batch_size_seqs: 2}]"), "--dry-run")
    assert code == 2 and "branch: random-micro_batch_size_seqs2-s3 set train.micro_batch_size_seqs otherwise" in err, err
    assert _cli_study(tmp_path, text, "--dry-run")[0] == 0


# ---------------------------------------------------------------- issue 47: kill -9 loop over a study

KD_BRANCH = """methods: [clm, dense-kd]
seeds: [1]
models:
  teacher: {{method: clm, train.max_steps: 2}}
branch: {{from: clm, at_tokens: 256}}
report: {{controls: false}}
config:
  model: {{preset: tiny}}
  data: {{dir: {data}, tokenizer: byte, seq_len: 32}}
  train: {{micro_batch_size_seqs: 4, grad_accum_steps: 1, max_steps: 4, warmup_steps: 2, num_threads: 1}}
  method: {{alpha: 0.5, kd: {{teacher: teacher}}}}
  eval: {{interval: 2, tokens_per_domain: 128, batch_size_seqs: 4}}
  checkpoint: {{interval: 2}}
  log: {{interval: 1, tensorboard: false}}
"""


@pytest.mark.slow  # 7 study processes: 44 min on this 2-core machine at load 13-19 (one study took 50 s at load 4)
def test_a_study_with_a_teacher_and_a_branch_killed_again_and_again_ends_bit_for_bit(tmp_path, tiny_data):
    """``eslm study`` of a shared teacher, a trunk and two arms (one the teacher's student), its process group
    SIGKILLed in five processes in a row: at the teacher's first step, inside the teacher's first checkpoint
    write, inside the trunk's, inside the first arm's (after the branch point) and after the second arm's first
    checkpoint took its name; each time the same command is run again. The study ends as an uninterrupted one:
    every run's per-step metrics and final weights and optimizer state bit for bit, the teacher and the trunk
    never trained again once finished (their directories untouched), no temporary or lock file left."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import read_metrics
    from train.test_fault_injection import RUNNER, _comparable, _final_state, _same_tensors

    f = tmp_path / "kd.yaml"
    f.write_text(KD_BRANCH.format(data=tiny_data))

    def eslm_study(out, kill):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        env.pop("ESLM_TEST_KILL", None)
        if kill:
            env["ESLM_TEST_KILL"] = kill
        proc = subprocess.Popen([sys.executable, str(RUNNER), "study", str(f), "--out", str(out)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        text = proc.communicate(timeout=900)[0]
        try:  # the runner killed its whole group: nothing of it may be left
            os.killpg(proc.pid, 0)
            left = True
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            left = False
        return proc.returncode, text, left

    code, text, _ = eslm_study(tmp_path / "ref", None)
    assert code == 0, text[-3000:]
    ref, study_dir = tmp_path / "ref" / "kd", tmp_path / "b" / "kd"
    runs = ["models/teacher", "trunk-clm-s1", "clm-s1", "dense-kd-s1"]

    def files(run):
        return sorted(p.name for p in (study_dir / run / "checkpoints").iterdir())

    def temporary_and(run, *others):  # one temporary file of the run's step 2 checkpoint, and the others
        tmp = [n for n in files(run) if n.startswith(".step_0000002.pt.tmp.")]
        return len(tmp) == 1 and sorted(files(run)) == sorted([*tmp, *others])

    def finished(run):
        return (study_dir / run / "result.json").is_file()

    # (kill, what it leaves): the N-th training step or atomic checkpoint write of the process; a run writes its
    # checkpoint file and `latest` at step 2 (4 for an arm), then both again at its end (the same step)
    loop = [
        ("step:1", lambda: not finished("models/teacher") and not (study_dir / "trunk-clm-s1").exists()),
        ("savefull:1", lambda: temporary_and("models/teacher")),  # the teacher's first checkpoint (file, `latest`)
        ("savesum:5", lambda: finished("models/teacher") and temporary_and("trunk-clm-s1", "step_0000002.pt.sha256")),
        ("save:5", lambda: finished("trunk-clm-s1") and [n[:18] for n in files("clm-s1")] == [".step_0000004.pt.t"]),
        ("saved:5", lambda: finished("clm-s1") and files("dense-kd-s1") == ["step_0000004.pt",
                                                                           "step_0000004.pt.sha256"]),
    ]
    outputs, untouched = [], {}
    for kill, leaves in loop:
        code, text, left = eslm_study(tmp_path / "b", kill)
        outputs.append(text)
        assert code == -9 and not left, (kill, code, left, text[-3000:])
        assert leaves(), (kill, {r: files(r) for r in runs if (study_dir / r / "checkpoints").is_dir()})
        for run in ("models/teacher", "trunk-clm-s1"):  # finished: its files as they are from now on
            if finished(run) and run not in untouched:
                untouched[run] = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (study_dir / run).rglob("*")
                                  if p.is_file()}
    code, last, left = eslm_study(tmp_path / "b", None)
    assert code == 0 and not left, last[-3000:]
    for i, text in enumerate([*outputs, last]):  # each skipped from the process after the one that finished it
        assert ("== teacher: finished earlier, skipped" in text) == (i >= 3), (i, text[-3000:])
        assert ("== trunk-clm-s1: finished earlier, skipped" in text) == (i >= 4), (i, text[-3000:])
    for run, before in untouched.items():  # trained once: never again, not even resumed
        assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (study_dir / run).rglob("*")
                if p.is_file()} == before, run
    for run in runs:
        assert _comparable(read_metrics(ref / run)) == _comparable(read_metrics(study_dir / run)), run
        a, b = _final_state(ref / run), _final_state(study_dir / run)
        assert a["step"] == b["step"] and _same_tensors(a, b), run  # the final weights and optimizer state
    record, ref_record = (json.loads((d / "models" / "models.json").read_text())["teacher"] for d in (study_dir, ref))
    assert (record["step"], os.path.basename(record["checkpoint"]), sorted(record["used_by"])) == (
        ref_record["step"], os.path.basename(ref_record["checkpoint"]), sorted(ref_record["used_by"]))
    assert not [p for p in study_dir.rglob("*") if ".tmp." in p.name or p.name == "eslm.lock"]
    assert (study_dir / "report" / "index.html").is_file()


# ---------------------------------------------------------------- issue 47: a study file changed after its runs

CHANGED = """methods: [clm, eslm-entropy]
seeds: [1, 2]
report: {controls: false}
config: {model: {preset: tiny}, data: {seq_len: 64}, train: {max_steps: 10, warmup_steps: 2, lr: 0.001},
         method: {alpha: 0.2}}
"""


def _trained_as_planned(tmp_path, text: str) -> list:
    """Run directories as if the study had trained them: each holds the config.yaml the plan gives it (and
    result.json: finished)."""
    from eslm.config import to_yaml

    f = tmp_path / "grid.yaml"
    f.write_text(text)
    configs = study.plan(study.load_study(str(f)), tmp_path / "out")
    for c in configs:
        d = tmp_path / "out" / "grid" / c.run.name
        d.mkdir(parents=True)
        (d / "config.yaml").write_text(to_yaml(c))
        (d / "result.json").write_text("{}")
    return configs


def test_a_study_rerun_after_its_settings_changed_is_refused_naming_runs_and_keys(tmp_path, capsys):
    from eslm.cli import main

    _trained_as_planned(tmp_path, CHANGED)
    f, out = tmp_path / "grid.yaml", str(tmp_path / "out")
    assert main(["study", str(f), "--out", out, "--dry-run"]) == 0  # the same plan: nothing to say
    f.write_text(CHANGED.replace("alpha: 0.2", "alpha: 0.4"))
    assert main(["study", str(f), "--out", out, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert "4 run(s) already trained with settings other than the plan's" in err, err
    assert "eslm-entropy-s1 (method.alpha: 0.2 -> 0.4)" in err and "eslm-entropy-s2" in err, err
    f.write_text(CHANGED)
    assert main(["study", str(f), "--out", out, "--dry-run", "train.lr=0.05"]) == 2  # an override counts too
    err = capsys.readouterr().err
    assert "4 run(s)" in err and "clm-s1 (train.lr: 0.001 -> 0.05)" in err, err
    # settings that do not change results (thread count, logging) are not a change
    assert main(["study", str(f), "--out", out, "--dry-run", "train.num_threads=1", "log.interval=5"]) == 0


def test_a_huge_grid_or_seed_list_is_refused_with_its_numbers_before_anything_is_expanded(tmp_path):
    import time

    axis = "[" + ", ".join(str(i) for i in range(1000)) + "]"
    huge = STUDY_OK.replace("sweep:\n", f"sweep:\n  train.lr: {axis}\n  train.warmup_steps: {axis}\n"
                                        f"  train.min_lr: {axis}\n")
    t0 = time.perf_counter()
    code, err = _cli_study(tmp_path, huge, "--dry-run")
    assert code == 2 and "expected at most 10000 runs, found 4000000000 grid points x 2 seed(s)" in err, err
    f = tmp_path / "ok.yaml"
    f.write_text(STUDY_OK)
    with pytest.raises(ConfigError, match="--seeds: expected at most 1000 seeds, found 1000000"):
        study.run_study(str(f), tmp_path / "out", seeds=list(range(10**6)), dry_run=True)
    assert time.perf_counter() - t0 < 30  # seconds on a loaded machine; the refusals themselves take milliseconds


def test_two_baseline_groups_without_a_report_baseline_are_refused_by_the_dry_run(tmp_path):
    """issue 47: two CLM labels and no report section: the report could not choose its baseline; refused before
    anything trains, not by the report after all the training."""
    two = STUDY_OK.replace("methods: [clm, ", "methods: [{name: clm, label: clm-a, train.weight_decay: 0.0}, "
                                              "{name: clm, label: clm-b, train.weight_decay: 0.2}, ")
    code, err = _cli_study(tmp_path, two, "--dry-run")
    assert code == 2 and "report.baseline (not set: the default): 'clm' is the method of 2 groups" in err, err
    assert "add report.baseline naming one of them" in err
    assert _cli_study(tmp_path, two + "report: {baseline: clm-b}\n", "--dry-run")[0] == 0


@pytest.mark.parametrize("entry", ["clm-s1", "models", "models/teacher", "report", "plan", "logs", "slurm"])
def test_a_link_inside_a_marked_study_directory_is_refused_before_anything_trains(tmp_path, monkeypatch, entry):
    # issue 47: a run directory (or models/, plan/, logs/, ...) of a marked study that is a link into a user's
    # directory was trained through; every entry eslm writes into is refused in one line before any training
    import eslm.train.trainer as trainer
    from eslm.files import atomic_write, new_marker

    f = tmp_path / "grid.yaml"
    f.write_text(STUDY.replace("config:\n", "models:\n  teacher: {method: clm}\nconfig:\n"))
    d = tmp_path / "out" / "grid"
    d.mkdir(parents=True)
    atomic_write(d / study.STUDY_MARKER, (json.dumps(new_marker(study.STUDY_FORMAT)) + "\n").encode())
    users = tmp_path / "users-dir"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    (d / entry).parent.mkdir(parents=True, exist_ok=True)
    (d / entry).symlink_to(users, target_is_directory=True)
    started = []
    monkeypatch.setattr(trainer, "train", lambda cfg: started.append(cfg.run.name))
    with pytest.raises(ESLMError, match="is a symbolic link") as e:
        study.run_study(str(f), tmp_path / "out")
    assert "\n" not in str(e.value) and repr(str(d / entry)) in str(e.value)
    assert started == [] and [p.name for p in users.iterdir()] == ["notes.txt"]
    assert (users / "notes.txt").read_text() == "mine"


def test_a_study_file_of_a_million_seeds_is_refused_with_the_count_fast(tmp_path):
    # issue 47: 10^6 seeds in the file were refused after 73 s and 1 GB, with a message about aliases the file
    # does not have; the seeds are counted from libyaml's events before any value is built
    import time

    f = tmp_path / "grid.yaml"
    f.write_text(STUDY.replace("seeds: [1]", "seeds: [" + ", ".join(str(i) for i in range(1, 10**6 + 1)) + "]"))
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        study.load_study(str(f))
    took = time.monotonic() - t0
    assert "expected at most 1000 seeds, found 1000000" in str(e.value) and "alias" not in str(e.value)
    assert took < 20, took  # about 2.4 s on a loaded 2-core machine (the count is libyaml's parse); 73 s before


def test_the_dry_run_says_when_a_group_has_no_control_at_its_alpha(tmp_path):
    """issue 47: the report compares a selection method with its registry control (random at the same alpha);
    a study without it reported silently without that comparison. The dry run says so in one warning line, not
    when the control is planned at that alpha, nor when report.controls: false says the report goes without."""
    one = STUDY_OK.replace("methods: [clm, eslm-entropy, ", "methods: [clm, eslm-entropy, random, ")
    one = one.replace("methods: [eslm-entropy]}", "methods: [eslm-entropy, random]}").replace(
        "method.standardize: domain}", "method.standardize: domain, method.alpha: 0.2}")
    code, err = _cli_study(tmp_path, one, "--dry-run")
    lines = [x for x in err.splitlines() if "no control" in x]
    assert code == 0 and len(lines) == 1, err
    assert "warning: report: 1 group(s) have no control" in lines[0] and "loss-dom (no random at method.alpha=0.2)" \
        in lines[0] and "eslm-entropy" not in lines[0] and "report.controls: false" in lines[0], lines
    code, err = _cli_study(tmp_path, STUDY_OK, "--dry-run")  # no random at all: three groups lack it
    assert code == 0 and "report: 3 group(s) have no control" in err and "(no random at method.alpha=0.3)" in err
    assert "no control" not in _cli_study(tmp_path, STUDY_OK + "report: {controls: false}\n", "--dry-run")[1]
    code, err = _cli_study(tmp_path, STUDY_OK + "report: {controls: no-thanks}\n", "--dry-run")
    assert code == 2 and "report.controls: expected true or false" in err, err
