"""eslm.model.loading: what a path means, verified (issue 24 items 3, 5, 9).

A run directory means its latest checkpoint even when an old export (config.json) was written into it; a
snapshot or checkpoint that fails its checksum or holds non-finite weights is refused in one line that names the
newest good file of its run; ``eslm sample`` on such weights is that one line, not a traceback."""

import json

import pytest
import torch

from eslm.cli import main as cli_main
from eslm.errors import CheckpointError
from eslm.model.gpt import GPT, preset
from eslm.model.loading import load_model


def _save(path, model, step):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": "eslm-checkpoint-v1", "model": model.state_dict(), "model_config": model.config.to_dict(),
                "tokenizer": "byte", "step": step, "optimizer": {}}, path)


def _run(tmp_path, nan_at=None):
    torch.manual_seed(0)
    run = tmp_path / "run"
    for step in (100, 200):
        m = GPT(preset("tiny", vocab_size=300))
        if step == nan_at:
            with torch.no_grad():
                m.transformer.h[0].attn.c_attn.weight[3, 4] = float("nan")
        _save(run / "checkpoints" / f"step_{step:07d}.pt", m, step)
    (run / "checkpoints" / "latest").write_text("step_0000200.pt\n")
    return run


def test_a_run_directory_means_its_latest_checkpoint_even_beside_an_old_export(tmp_path):
    pytest.importorskip("transformers")
    from eslm.model.export_hf import export

    run = _run(tmp_path)
    export(run / "checkpoints" / "step_0000100.pt", tmp_path / "old", with_tokenizer=False)
    for f in (tmp_path / "old").iterdir():  # what an earlier eslm let `export-hf --out RUN` write
        (run / f.name).write_bytes(f.read_bytes())
    _, info = load_model(run)
    assert info["step"] == 200 and info["source"].endswith("step_0000200.pt")


def test_sample_on_non_finite_weights_is_one_line_naming_the_newest_good_file(tmp_path, capsys):
    run = _run(tmp_path, nan_at=200)
    code = cli_main(["sample", str(run), "--max-new-tokens", "3", "--tokenizer", "byte"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err, err
    assert "step_0000200.pt holds non-finite weights" in err and "step_0000100.pt" in err


def test_non_finite_snapshot_is_refused(tmp_path):
    from safetensors.torch import save_file

    from eslm.model.loading import snapshot_digest

    m = GPT(preset("tiny", vocab_size=300))
    state = {k: v.clone() for k, v in m.state_dict().items() if k != "lm_head.weight"}
    state["transformer.wte.weight"][0, 0] = float("inf")
    snap = tmp_path / "snapshots" / "step_0000005.safetensors"
    snap.parent.mkdir()
    meta = {"format": "eslm-snapshot-v1", "model_config": json.dumps(m.config.to_dict()), "tokenizer": "byte",
            "step": "5"}
    save_file(state, str(snap), metadata={**meta, "sha256": snapshot_digest(state, meta)})
    with pytest.raises(CheckpointError, match="holds non-finite weights .* no other weights file"):
        load_model(snap)


def test_snapshot_without_its_checksum_is_refused(tmp_path):
    """A snapshot header must carry its sha256 (no snapshot of this version lacks one): without it the file is
    refused in one line, as a damaged one."""
    from safetensors.torch import save_file

    m = GPT(preset("tiny", vocab_size=300))
    state = {k: v.clone() for k, v in m.state_dict().items() if k != "lm_head.weight"}
    snap = tmp_path / "snapshots" / "step_0000005.safetensors"
    snap.parent.mkdir()
    save_file(state, str(snap), metadata={"format": "eslm-snapshot-v1", "model_config": json.dumps(m.config.to_dict()),
                                          "tokenizer": "byte", "step": "5"})
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        load_model(snap)
