"""transformers interop (export/import parity) and checkpoint loading (eslm.model.hf, eslm.model.loading)."""

import json

import pytest
import torch

from eslm.errors import CheckpointError
from eslm.model.gpt import GPT, preset
from eslm.model.loading import list_checkpoints, load_model, resolve_checkpoint

TOL = dict(atol=2e-5, rtol=1e-4)  # fp32: the two implementations differ only in op order


def _save_ckpt(path, model, step=7, tokenizer="byte", **extra):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": "eslm-checkpoint-v1", "model": model.state_dict(),
                "model_config": model.config.to_dict(), "tokenizer": tokenizer, "step": step,
                "optimizer": {}, **extra}, path)


def _make_run(tmp_path, steps=(100, 200), vocab=300, seed=0):
    torch.manual_seed(seed)
    run = tmp_path / "run"
    models = {}
    for s in steps:
        m = GPT(preset("tiny", vocab_size=vocab))
        _save_ckpt(run / "checkpoints" / f"step_{s:07d}.pt", m, step=s, flops_paper=1e9 * s)
        models[s] = m
    (run / "checkpoints" / "latest").write_text(f"step_{steps[-1]:07d}.pt\n")
    return run, models


def _ours_logits(model, idx):
    with torch.no_grad():
        return model.logits(model(idx))


# ------------------------------------------------------------------------------ loading


def test_load_run_dir_uses_latest_and_checkpoint_file(tmp_path):
    run, models = _make_run(tmp_path)
    idx = torch.randint(0, 300, (2, 9))
    m, info = load_model(run)
    assert info["step"] == 200 and info["tokenizer"] == "byte" and info["run_dir"] == str(run.resolve())
    assert info["flops_paper"] == 2e11
    assert torch.equal(_ours_logits(m, idx), _ours_logits(models[200].eval(), idx))
    m1, info1 = load_model(run / "checkpoints" / "step_0000100.pt")
    assert info1["step"] == 100
    assert torch.equal(_ours_logits(m1, idx), _ours_logits(models[100].eval(), idx))
    assert [p.name for p in list_checkpoints(run)] == ["step_0000100.pt", "step_0000200.pt"]


def test_load_strips_compile_and_ddp_prefixes(tmp_path):
    m = GPT(preset("tiny", vocab_size=50))
    state = {"module._orig_mod." + k: v for k, v in m.state_dict().items()}
    p = tmp_path / "c.pt"
    torch.save({"format": "eslm-checkpoint-v1", "model": state, "model_config": m.config.to_dict(),
                "tokenizer": "byte", "step": 1}, p)
    loaded, _ = load_model(p)
    idx = torch.randint(0, 50, (1, 5))
    assert torch.equal(_ours_logits(loaded, idx), _ours_logits(m.eval(), idx))


def test_load_errors_are_one_clear_line(tmp_path):
    with pytest.raises(CheckpointError, match="found nothing"):
        load_model(tmp_path / "nope")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="could not be read"):
        load_model(junk)
    wrong = tmp_path / "wrong.pt"
    torch.save({"format": "something-else", "model": {}, "model_config": {}}, wrong)
    with pytest.raises(CheckpointError, match="something-else"):
        load_model(wrong)
    with pytest.raises(CheckpointError, match="found none"):
        resolve_checkpoint(tmp_path)  # a directory without checkpoints
    m = GPT(preset("tiny", vocab_size=50))
    bad = tmp_path / "bad.pt"
    cfg = {**m.config.to_dict(), "n_embd": 32}  # config says 32, tensors are 64 wide
    torch.save({"format": "eslm-checkpoint-v1", "model": m.state_dict(), "model_config": cfg,
                "tokenizer": "byte", "step": 1}, bad)
    with pytest.raises(CheckpointError, match=r"transformer\.wte\.weight of shape \(50, 32\).*found \(50, 64\)") as e:
        load_model(bad)
    assert "\n" not in str(e.value)


def test_latest_pointing_to_missing_file(tmp_path):
    run, _ = _make_run(tmp_path, steps=(100,))
    (run / "checkpoints" / "latest").write_text("step_0000999.pt")
    with pytest.raises(CheckpointError, match="step_0000999.pt"):
        load_model(run)


# ------------------------------------------------------------------------------ HF interop


def _tiny_hf(vocab=61, bias_scale=0.1, seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=vocab, n_positions=40,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # HF initialises biases to 0 and LN to 1: randomise so the bias path is tested
        for name, p in hf.named_parameters():
            if name.endswith(".bias") or "ln_" in name:
                p.add_(bias_scale * torch.randn_like(p))
    return hf


def test_import_hf_directory_matches_transformers_logits(tmp_path):
    hf = _tiny_hf()
    hf.save_pretrained(tmp_path / "hf")
    model, info = load_model(tmp_path / "hf")
    assert model.config.bias and model.config.vocab_size == 61 and model.config.block_size == 40
    assert info["source"] == str(tmp_path / "hf") and info["step"] is None
    idx = torch.randint(0, 61, (3, 17))
    with torch.no_grad():
        ref = hf(idx).logits
    assert torch.allclose(_ours_logits(model, idx), ref, **TOL)


@pytest.mark.parametrize("trim", [True, False])
def test_export_matches_ours_and_round_trips(tmp_path, trim):
    transformers = pytest.importorskip("transformers")
    from eslm.model.hf import from_hf, to_hf

    torch.manual_seed(1)
    ours = GPT(preset("tiny", vocab_size=320)).eval()  # bias=False, padded vocab (tokenizer: 257)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf = to_hf(ours, vocab_size=257 if trim else None, eot_id=256)
    hf.save_pretrained(tmp_path / "exp")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "exp", local_files_only=True).float().eval()
    assert reloaded.config.vocab_size == (257 if trim else 320)
    idx = torch.randint(0, 257, (2, 33))
    mine = _ours_logits(ours, idx)
    with torch.no_grad():
        theirs = reloaded(idx).logits
    v = theirs.shape[-1]
    assert torch.allclose(theirs, mine[..., :v], **TOL)  # parity on the rows that exist
    if not trim:  # the full vocabulary: identical distributions
        assert torch.allclose(theirs.log_softmax(-1), mine.log_softmax(-1), **TOL)
    back = from_hf(tmp_path / "exp")
    assert not back.config.bias  # zero biases are recognised: same config as before export
    assert torch.allclose(_ours_logits(back, idx), mine[..., :v], **TOL)


def test_export_cli_writes_loadable_directory(tmp_path):
    pytest.importorskip("transformers")
    from eslm.cli import main

    run, models = _make_run(tmp_path, steps=(100,), vocab=300)
    out = tmp_path / "hfout"
    assert main(["export-hf", str(run), "--out", str(out)]) == 0
    meta = json.loads((out / "eslm_export.json").read_text())
    assert meta["step"] == 100 and meta["vocab_size_trained"] == 300
    # byte tokenizer: 257 ids when eslm.data.tokenizers is available, else the padded vocab is kept
    assert meta["vocab_size_exported"] in (257, 300)
    model, info = load_model(out)
    assert info["step"] == 100 and info["tokenizer"] == "byte"
    idx = torch.randint(0, 257, (1, 12))
    v = meta["vocab_size_exported"]
    assert torch.allclose(_ours_logits(model, idx), _ours_logits(models[100].eval(), idx)[..., :v], **TOL)
    assert main(["export-hf", str(tmp_path / "missing"), "--out", str(out)]) == 2
