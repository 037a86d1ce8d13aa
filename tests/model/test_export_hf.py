"""eslm export-hf writes only where it may (issue 24 item 3): a new or empty directory, or (with --force) one it
exported to before; never into a run directory or over another model's files."""

import json

import pytest
import torch

from eslm.cli import main as cli_main
from eslm.model.gpt import GPT, preset

pytest.importorskip("transformers")


@pytest.fixture
def run(tmp_path):
    torch.manual_seed(0)
    m = GPT(preset("tiny", vocab_size=300))
    path = tmp_path / "run" / "checkpoints" / "step_0000100.pt"
    path.parent.mkdir(parents=True)
    torch.save({"format": "eslm-checkpoint-v1", "model": m.state_dict(), "model_config": m.config.to_dict(),
                "tokenizer": "byte", "step": 100, "optimizer": {}}, path)
    (path.parent / "latest").write_text(path.name)
    return tmp_path / "run"


def _tree(d):
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else None for p in sorted(d.rglob("*"))}


def _export(capsys, *args):
    code = cli_main(["export-hf", *map(str, args)])
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return code, err


def test_another_models_directory_is_never_overwritten(run, tmp_path, capsys):
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    (other / "model.safetensors").write_bytes(b"someone else's weights")
    before = _tree(other)
    for force in ([], ["--force"]):
        code, err = _export(capsys, run, "--out", other, *force)
        assert code == 2 and "holds files eslm did not write" in err and "'config.json'" in err
        assert _tree(other) == before


def test_export_into_a_run_directory_is_refused(run, capsys):
    before = _tree(run)
    code, err = _export(capsys, run, "--out", run, "--force")
    assert code == 2 and "is a run directory" in err and _tree(run) == before


def test_a_previous_export_is_replaced_only_with_force(run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert _export(capsys, run, "--out", out, "--no-tokenizer")[0] == 0
    first = json.loads((out / "eslm_export.json").read_text())
    assert len(first["id"]) == 32
    code, err = _export(capsys, run, "--out", out)
    assert code == 2 and "--force" in err
    assert _export(capsys, run, "--out", out, "--force", "--no-tokenizer")[0] == 0
    assert json.loads((out / "eslm_export.json").read_text())["id"] != first["id"]
    (out / "README.md").write_text("my notes")  # a file of the user's in the export: --force keeps off it
    code, err = _export(capsys, run, "--out", out, "--force")
    assert code == 2 and "'README.md'" in err and (out / "README.md").read_text() == "my notes"


def test_a_killed_exports_temporary_directory_is_removed_next_time(run, tmp_path, capsys):
    stale = tmp_path / ".hf.tmp.4242"  # what a SIGKILLed export leaves (with eslm's marker inside)
    stale.mkdir()
    (stale / ".eslm-output").write_text("")
    (stale / "model.safetensors").write_bytes(b"half")
    foreign = tmp_path / ".hf.tmp.99"  # same pattern, no marker: not provably eslm's
    foreign.mkdir()
    assert _export(capsys, run, "--out", tmp_path / "hf", "--no-tokenizer")[0] == 0
    assert not stale.exists() and foreign.exists()
