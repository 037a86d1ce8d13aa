"""Every command: writes only what it can prove it wrote, checks what it loads before it builds anything, and
answers a mistake in one line (issue 35).

Outputs: ``tokens --out`` and ``eval`` replace only their own earlier outputs and never write through a link;
``prepare --force`` refuses a link as --out; two report / export-hf / tokens writing one --out at the same time:
the second is refused (it used to delete the first one's live temporary directory). Loaders: a snapshot whose
header declares a model its tensors do not hold is refused before the model is built; a manifest's shard paths
stay inside the data directory; an HF directory's error never advises unsafe loading. Values: optimizer betas,
dropout, seeds, huge numbers, num_items_in_batch, sampler and eval options, study seeds; a missing extra is one
line naming it."""

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from eslm.cli import main as cli_main
from eslm.errors import CheckpointError, ConfigError, DataError
from eslm.files import new_marker


def _one_line(capsys, code, expected_code=2):
    err = capsys.readouterr().err.strip()
    assert code == expected_code and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory) -> Path:
    """A 2-step clm run with a snapshot and a checkpoint of step 2."""
    from eslm.config import build_config
    from eslm.train.trainer import train

    out = tmp_path_factory.mktemp("run")
    return train(build_config(overrides=tiny_overrides(tiny_data, out, **{
        "method.name": "clm", "train.max_steps": 2, "eval.interval": 1, "checkpoint.interval": 1,
        "checkpoint.keep_last": 2}))).run_dir


@pytest.fixture
def text_file(tmp_path) -> Path:
    p = tmp_path / "passages.txt"
    p.write_text("The first paragraph of plain text.\n\nA second one, a little longer than the first.\n")
    return p


# ---------------------------------------------------------------- outputs: tokens, eval, prepare, concurrency


def test_tokens_out_refuses_a_run_directory_and_a_foreign_one(run, text_file, tmp_path, capsys):
    before = sorted(p.name for p in run.iterdir())
    err = _one_line(capsys, cli_main(["tokens", str(run), "--text", str(text_file), "--out", str(run)]))
    assert "found other files" in err and "replaces only what it wrote" in err
    assert sorted(p.name for p in run.iterdir()) == before
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "tokens.json").write_text("my notes")
    (foreign / "notes.txt").write_text("keep")
    _one_line(capsys, cli_main(["tokens", str(run), "--text", str(text_file), "--out", str(foreign)]))
    assert (foreign / "tokens.json").read_text() == "my notes"


def test_tokens_out_replaces_its_own_earlier_view_and_refuses_a_link(run, text_file, tmp_path, capsys):
    out = tmp_path / "view"
    for _ in range(2):  # the second replaces the first
        assert cli_main(["tokens", str(run), "--text", str(text_file), "--out", str(out)]) == 0
    assert json.loads((out / "tokens.json").read_text())["format"] == "eslm-token-view-v1"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".view.")]  # no temporary left
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    err = _one_line(capsys, cli_main(["tokens", str(run), "--text", str(text_file), "--out", str(tmp_path / "link")]))
    assert "is a symbolic link" in err and not any(target.iterdir())


def _fake_results(*args, **kwargs):
    return {"t": {"num_fewshot": 0, "metric": "acc", "value": 0.5, "stderr": 0.1, "n_samples": 4,
                  "metrics": {"acc,none": 0.5}}}


@pytest.fixture
def fake_eval(monkeypatch):
    """eslm eval without running lm-eval's tasks: every other step (loading, checking, writing) is real. Needs
    lm-eval installed (eslm.eval reads its version and imports its task manager); .ci/lowest installs no eval extra."""
    pytest.importorskip("lm_eval")
    from eslm.eval import command

    monkeypatch.setattr(command, "evaluate", _fake_results)


def test_eval_never_writes_through_links_planted_in_the_run(run, tmp_path, fake_eval):
    run_copy = tmp_path / "r"
    shutil.copytree(run, run_copy, symlinks=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (run_copy / "eval").mkdir(exist_ok=True)
    for name in ("step_0000002.json", "step_0000002.md", "summary.md"):
        (run_copy / "eval" / name).unlink(missing_ok=True)
        (run_copy / "eval" / name).symlink_to(victim)
    assert cli_main(["eval", str(run_copy), "--tasks", "t", "--device", "cpu"]) == 0
    assert victim.read_text() == "precious"
    for name in ("step_0000002.json", "step_0000002.md", "summary.md"):
        assert not (run_copy / "eval" / name).is_symlink()
    assert json.loads((run_copy / "eval" / "step_0000002.json").read_text())["format"] == "eslm-eval-v1"


def test_eval_out_never_replaces_a_file_it_did_not_write(run, tmp_path, fake_eval, capsys):
    res = tmp_path / "res.json"
    (tmp_path / "res.md").write_text("my notes")
    err = _one_line(capsys, cli_main(["eval", str(run), "--tasks", "t", "--device", "cpu", "--out", str(res)]))
    assert "res.md' exists and is not a result eslm eval wrote" in err
    assert (tmp_path / "res.md").read_text() == "my notes" and not res.exists()
    (tmp_path / "res.md").unlink()
    res.write_text('{"mine": 1}')
    _one_line(capsys, cli_main(["eval", str(run), "--tasks", "t", "--device", "cpu", "--out", str(res)]))
    assert res.read_text() == '{"mine": 1}'
    res.unlink()
    for _ in range(2):  # its own earlier result pair is replaced
        assert cli_main(["eval", str(run), "--tasks", "t", "--device", "cpu", "--out", str(res)]) == 0
    assert json.loads(res.read_text())["format"] == "eslm-eval-v1" and "| t | 0 | acc |" in (tmp_path / "res.md").read_text()


def test_prepare_force_refuses_a_link_as_out(tiny_data, tmp_path, capsys):
    target = tmp_path / "prepared"
    shutil.copytree(tiny_data, target)
    before = sorted(p.name for p in target.iterdir())
    (tmp_path / "link").symlink_to(target)
    text = tmp_path / "t.txt"
    text.write_text("some text to tokenize " * 50)
    err = _one_line(capsys, cli_main(["prepare", "text", str(text), "--tokenizer", "byte", "--force", "--no-progress",
                                      "--out", str(tmp_path / "link")]))
    assert "is a symbolic link" in err
    assert sorted(p.name for p in target.iterdir()) == before and (tmp_path / "link").is_symlink()
    assert not [p for p in tmp_path.iterdir() if ".old" in p.name or ".tmp" in p.name]


@pytest.mark.parametrize("command", ["report", "export-hf", "tokens"])
def test_a_second_writer_of_one_out_is_refused_and_the_first_ones_files_kept(command, run, text_file, tmp_path,
                                                                              capsys):
    from eslm.files import DIR_MARKER, output_lock

    out = tmp_path / "out"
    live = {"report": tmp_path / ".out.tmp.999999", "export-hf": tmp_path / ".out.tmp.999999",
            "tokens": tmp_path / ".out.tmp.999999"}[command]
    live.mkdir()  # the first writer's temporary directory, being filled
    (live / DIR_MARKER).write_text("")
    (live / "model.safetensors").write_text("half written")
    args = {"report": ["report", str(run), "--out", str(out)],
            "export-hf": ["export-hf", str(run), "--out", str(out)],
            "tokens": ["tokens", str(run), "--text", str(text_file), "--out", str(out)]}[command]
    with output_lock(out, "output").acquire():  # held by the first writer
        err = _one_line(capsys, cli_main(args))
    assert "is in use by PID" in err
    assert (live / "model.safetensors").read_text() == "half written"


# ---------------------------------------------------------------- loaders check before they build


def _rewrite_snapshot(path: Path, dest: Path, **config_changes) -> None:
    """A copy of the snapshot with its header's model_config changed and its sha256 recomputed (a forged file)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from eslm.model.loading import snapshot_digest

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        state = {k: f.get_tensor(k) for k in f.keys()}
    meta["model_config"] = json.dumps({**json.loads(meta["model_config"]), **config_changes})
    meta["sha256"] = snapshot_digest(state, meta)
    save_file(state, str(dest), metadata=meta)


@pytest.mark.parametrize("changes, expected", [
    ({"vocab_size": 50_000_000, "n_embd": 4096}, "declares a model of about"),
    ({"n_layer": 10_000_000}, "declares a model of about"),
    ({"n_head": 3}, "expected n_embd to be a multiple of n_head"),
    ({"n_layer": -1}, "expected positive integer sizes"),
    ({"n_layer": 3}, "expected tensor transformer.h.2"),
])
def test_a_snapshot_header_is_checked_before_the_model_is_built(run, tmp_path, monkeypatch, capsys, changes, expected):
    from eslm.model import state as model_state

    built = []
    real = model_state.GPT

    def counting(cfg):
        if torch.empty(0).device.type != "meta":
            built.append(cfg)
        return real(cfg)

    monkeypatch.setattr(model_state, "GPT", counting)
    forged = tmp_path / "step_0000002.safetensors"
    _rewrite_snapshot(run / "snapshots" / "step_0000002.safetensors", forged, **changes)
    t0 = time.monotonic()
    err = _one_line(capsys, cli_main(["sample", str(forged), "--max-new-tokens", "2"]))
    assert expected in err and time.monotonic() - t0 < 30, err
    assert built == []  # refused before any model was allocated


def test_manifest_paths_stay_inside_the_data_directory(tiny_data, tmp_path):
    from eslm.data.manifest import read_manifest

    for bad in ("../outside.bin", str(tmp_path / "abs.bin"), ".hidden.bin"):
        d = tmp_path / "data"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(tiny_data, d)
        m = json.loads((d / "manifest.json").read_text())
        m["files"][0]["path"] = bad
        (d / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(DataError, match="files\\[\\].path: expected a single path-safe name.*a shard must be "
                                            "a file of the data directory itself"):
            read_manifest(d)


def test_an_hf_directory_error_never_advises_unsafe_loading(tmp_path):
    pytest.importorskip("transformers")
    from eslm.model.loading import load_model

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_head": 1, "n_embd": 8,
                                               "vocab_size": 10, "n_positions": 8}))

    class Evil:
        def __reduce__(self):
            return (print, ("ran code",))

    torch.save({"transformer.wte.weight": torch.zeros(10, 8), "x": Evil()}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    msg = str(e.value)
    assert "weights_only" not in msg and "likely succeed" not in msg and "\n" not in msg, msg


@pytest.mark.parametrize("module, cmd", [
    ("lm_eval", ["eval", "RUN", "--tasks", "t", "--device", "cpu"]),
    ("transformers", ["export-hf", "RUN", "--out", "OUT"]),
    ("transformers", ["sample", "HF", "--max-new-tokens", "1"]),
])
def test_a_missing_extra_is_one_line_naming_it(run, tmp_path, monkeypatch, capsys, module, cmd):
    hf = tmp_path / "hf"
    if "HF" in cmd:
        pytest.importorskip("transformers")
        assert cli_main(["export-hf", str(run), "--out", str(hf)]) == 0
    for name in list(sys.modules):
        if name == module or name.startswith(module + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # import fails as when it is not installed
    capsys.readouterr()
    args = [{"RUN": str(run), "OUT": str(tmp_path / "out"), "HF": str(hf)}.get(a, a) for a in cmd]
    err = _one_line(capsys, cli_main(args))
    extra = {"lm_eval": "eval", "transformers": "hf"}[module]
    assert f"pip install 'eslm[{extra}]'" in err, err


# ---------------------------------------------------------------- values checked up front


@pytest.mark.parametrize("override, expected", [
    ("train.beta2=1.5", "train.beta2: expected 0 <= beta2 < 1"),
    ("train.beta1=-1", "train.beta1: expected 0 <= beta1 < 1"),
    ("model.dropout=-0.5", "model.dropout: expected 0 <= dropout < 1"),
    ("run.seed=-1", "run.seed: expected an integer in [0, "),
    ("run.seed=1e20", "run.seed: expected an integer below 2**53"),
    ("train.max_steps=1e400", "train.max_steps: expected an integer, found '1e400'"),
])
def test_config_values_are_checked_in_one_line(capsys, override, expected):
    err = _one_line(capsys, cli_main(["train", "--print-config", override]))
    assert expected in err, err


def test_a_yaml_file_with_a_huge_number_is_one_line(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  max_steps: 1e400\n")
    assert "train.max_steps: expected an integer" in _one_line(capsys, cli_main(["train", "--print-config", str(p)]))


def test_study_seeds_are_checked_in_dry_run(tmp_path, capsys):
    p = tmp_path / "s.yaml"
    p.write_text("methods: [clm]\nseeds: [-1, 2]\nconfig: {}\n")
    code = cli_main(["study", str(p), "--dry-run", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err  # the study lists each of its problems on a line of its own
    assert code == 2 and "Traceback" not in err and "seeds: expected seeds in [0, " in err and "found -1" in err


@pytest.mark.parametrize("args, expected", [
    (["--tokenizer", "gpt2"], "expected a tokenizer with at most"),
    (["--temperature", "nan"], "a finite --temperature"),
    (["--seed", "100000000000000000000"], "--seed: expected an integer in"),
    (["--device", "bogus"], "--device: expected cpu, cuda, cuda:N or mps, found 'bogus'"),
] + ([(["--device", "cuda"], "CUDA is not available")] if not torch.cuda.is_available() else []))
def test_sample_options_are_one_line(run, capsys, args, expected):
    err = _one_line(capsys, cli_main(["sample", str(run), "--max-new-tokens", "2", *args]))
    assert expected in err, err


@pytest.mark.parametrize("args, expected", [
    (["--device", "bogus"], "--device: expected cpu, cuda, cuda:N or mps"),
    (["--limit", "-5"], "--limit: expected a positive number"),
    (["--limit", "nan"], "--limit: expected a positive number"),
])
def test_eval_options_are_one_line(run, capsys, args, expected):
    err = _one_line(capsys, cli_main(["eval", str(run), "--tasks", "t", *args]))
    assert expected in err, err


@pytest.mark.parametrize("n", [-3, 0, float("nan"), torch.tensor(0), torch.tensor([1, 2])])
def test_num_items_in_batch_must_be_a_positive_count(n):
    from eslm.api.loss import selective_loss

    targets = torch.randint(0, 11, (2, 6))
    logits = torch.randn(2, 6, 11)
    with pytest.raises(ConfigError, match="num_items_in_batch: expected"):
        selective_loss(targets, logits=logits, alpha=0.5, num_items_in_batch=n)
    loss, _ = selective_loss(targets, logits=logits, alpha=0.5, num_items_in_batch=torch.tensor(7))
    assert math.isfinite(float(loss)) and float(loss) > 0


# ---------------------------------------------------------------- a full disk names the file


def _with_file_size_limit(args, limit_bytes):
    import resource
    import signal

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return subprocess.run([sys.executable, "-m", "eslm.cli", *args], capture_output=True, text=True,
                          preexec_fn=limit, timeout=600)


@pytest.mark.parametrize("what", ["train-metrics", "prepare", "report", "tokens"])
def test_a_write_error_in_every_writer_names_its_file(what, run, tiny_data, text_file, tmp_path):
    if what == "train-metrics":
        args = ["train", *tiny_overrides(tiny_data, tmp_path, **{
            "train.max_steps": 40, "eval.interval": 0, "checkpoint.interval": 0, "checkpoint.snapshot_interval": -1})]
        limit, name = 6000, "metrics.jsonl"
    elif what == "prepare":
        big = tmp_path / "big.txt"
        big.write_text("tokens to write " * 20000)
        args, limit, name = ["prepare", "text", str(big), "--tokenizer", "byte", "--no-progress", "--out",
                             str(tmp_path / "p")], 50_000, "train-text.bin"
    elif what == "report":
        args, limit, name = ["report", str(run), "--out", str(tmp_path / "rep")], 3000, "rep"
    else:
        args, limit, name = ["tokens", str(run), "--text", str(text_file), "--out", str(tmp_path / "v")], 3000, "'"
    out = _with_file_size_limit(args, limit)
    err = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "File too large" in err and "(no file named)" not in err and name in err, err


# ---------------------------------------------------------------- every command that writes uses the one writer

_WRITER_MODULES = ("eslm/files.py", "eslm/lock.py")  # atomic_write, open_nofollow, replace_dir; the lock file
_TEMP_DIR = r"^\.[^/]+\.(tmp|old)(-export)?[.-]\d+$"  # a directory writer's temporary or set-aside directory


def test_every_command_that_writes_uses_the_one_writer(run, tiny_data, text_file, tmp_path, fake_eval, capsys):
    """Each command that writes runs under an audit hook that records every file opened for writing; each must be
    opened by eslm's writer (eslm/files.py: atomic_write, open_nofollow; eslm/lock.py: the lock file), or lie
    inside the temporary directory of a directory writer (replace_dir, prepare's, export's), which is renamed
    into place whole. Any other write (a plain open(..., "w"), write_text) is listed."""
    import os
    import re
    import traceback

    work = tmp_path / "w"
    shutil.copytree(run, work / "r", symlinks=True)
    study = tmp_path / "s.yaml"
    study.write_text("methods: [clm]\nseeds: [1]\nconfig:\n" + "".join(
        f"  {o.split('=', 1)[0]}: {o.split('=', 1)[1]}\n" for o in tiny_overrides(
            tiny_data, work, **{"train.max_steps": 1, "eval.interval": 1})
        if not o.startswith(("run.out_dir", "run.name"))))
    commands = {
        "train": ["train", *tiny_overrides(tiny_data, work, **{"run.name": "n", "train.max_steps": 2,
                                                               "eval.interval": 1, "checkpoint.interval": 1})],
        "train --resume": ["train", "--resume", str(work / "r"), "train.max_steps=3"],
        "prepare": ["prepare", "text", str(text_file), "--tokenizer", "byte", "--no-progress", "--out",
                    str(work / "p")],
        "export-hf": ["export-hf", str(run), "--out", str(work / "hf")],
        "eval": ["eval", str(work / "r"), "--tasks", "t", "--device", "cpu"],
        "report": ["report", str(work / "r"), "--out", str(work / "rep")],
        "tokens": ["tokens", str(run), "--text", str(text_file), "--out", str(work / "v")],
        "study": ["study", str(study), "--out", str(work / "st")],
    }
    import importlib.util
    if importlib.util.find_spec("transformers") is None:  # the hf extra is absent (CI's lowest-versions run)
        del commands["export-hf"]
    active, writes = [None], []

    def hook(event, args):
        if active[0] is None or event != "open":
            return
        path, mode, flags = (list(args) + [None, 0])[:3]
        if isinstance(path, int) or not str(path).startswith(str(work)):
            return
        writing = (any(c in mode for c in "wax+") if isinstance(mode, str)
                   else bool((flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
        if writing:
            files = [f.filename.replace(os.sep, "/") for f in traceback.extract_stack()[:-1]]
            writes.append((active[0], str(path), files))

    sys.addaudithook(hook)  # cannot be removed: gated by active[0]
    try:
        for name, args in commands.items():
            active[0] = name
            code = cli_main(args)
            active[0] = None
            assert code == 0, (name, capsys.readouterr().err[-2000:])
    finally:
        active[0] = None
    bad = []
    for name, path, files in writes:
        rel = Path(path).relative_to(work)
        in_temp_dir = any(re.match(_TEMP_DIR, part) for part in rel.parts[:-1])
        by_writer = any(f.endswith(_WRITER_MODULES) for f in files)
        if not (in_temp_dir or by_writer):
            eslm_frame = next((f for f in reversed(files) if "/eslm/" in f), "?")
            bad.append(f"{name}: {rel} (opened from {eslm_frame.rsplit('/src/', 1)[-1]})")
    assert not bad, "writes outside the one writer:\n" + "\n".join(bad)
    assert {w[0] for w in writes} == set(commands)  # each command wrote something and was watched


# ---------------------------------------------------------------- study --out


def _tiny_study(tiny_data, tmp_path) -> Path:
    study = tmp_path / "tiny35.yaml"
    study.write_text("methods: [clm]\nseeds: [1]\nconfig:\n" + "".join(
        f"  {o.split('=', 1)[0]}: {o.split('=', 1)[1]}\n" for o in tiny_overrides(
            tiny_data, tmp_path, **{"train.max_steps": 2, "train.warmup_steps": 1, "eval.interval": 1})
        if not o.startswith(("run.out_dir", "run.name"))))
    return study


def test_study_out_onto_a_foreign_directory_is_refused_before_any_training(tiny_data, tmp_path, capsys):
    study = _tiny_study(tiny_data, tmp_path)
    d = tmp_path / "out" / "tiny35"
    (d / "plan").mkdir(parents=True)
    (d / "plan" / "clm-s1.yaml").write_text("mine")
    (d / "thesis.tex").write_text("mine")
    t0 = time.monotonic()
    err = _one_line(capsys, cli_main(["study", str(study), "--out", str(tmp_path / "out")]))
    assert "empty or marked by eslm (eslm-study.json), found other files ('plan', 'thesis.tex')" in err
    assert time.monotonic() - t0 < 60
    assert (d / "plan" / "clm-s1.yaml").read_text() == "mine" and not (d / "clm-s1").exists()


def test_study_never_appends_to_a_log_planted_as_a_link(tiny_data, tmp_path, capsys):
    study = _tiny_study(tiny_data, tmp_path)
    d = tmp_path / "out" / "tiny35"
    (d / "logs").mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (d / "logs" / "clm-s1.log").symlink_to(victim)
    # a study directory eslm marked (an unmarked one holding logs/ is refused before any link is looked at)
    (d / "eslm-study.json").write_text(json.dumps(new_marker("eslm-study-v1")) + "\n")
    code = cli_main(["study", str(study), "--out", str(tmp_path / "out"), "--jobs", "2"])  # logs: parallel runs
    err = capsys.readouterr().err
    assert code == 2 and "is a symbolic link" in err and "Traceback" not in err, err
    assert victim.read_text() == "precious"


def test_eval_reads_past_a_json_that_is_not_utf8(run, tmp_path, fake_eval, capsys):
    # issue 47: a non-UTF-8 file eval/*.json beside eslm eval's results stopped eval/summary.md with a traceback;
    # it is not a result eslm eval wrote, so it is left alone and out of the summary, like any other such file
    run_copy = tmp_path / "r"
    shutil.copytree(run, run_copy, symlinks=True)
    (run_copy / "eval").mkdir(exist_ok=True)
    (run_copy / "eval" / "notes.json").write_bytes(b'{"format": "eslm-eval-v1", "x": "\xff"}')
    assert cli_main(["eval", str(run_copy), "--tasks", "t", "--device", "cpu"]) == 0
    assert "t (acc)" in (run_copy / "eval" / "summary.md").read_text()
    assert (run_copy / "eval" / "notes.json").read_bytes() == b'{"format": "eslm-eval-v1", "x": "\xff"}'
    assert "wrote " + str(run_copy / "eval" / "summary.md") in capsys.readouterr().out
