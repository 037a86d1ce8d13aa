import math

import pytest
import torch

from eslm.errors import ConfigError
from eslm.model.gpt import GPT, PRESETS, preset


def test_forward_returns_hidden_not_loss():
    cfg = preset("tiny", vocab_size=97)
    m = GPT(cfg)
    h = m(torch.randint(0, 97, (3, 17)))
    assert h.shape == (3, 17, cfg.n_embd)
    assert m.logits(h).shape == (3, 17, 97)


def test_weight_tying_and_init():
    m = GPT(preset("tiny", vocab_size=101))
    assert m.head_weight.data_ptr() == m.transformer.wte.weight.data_ptr()
    proj = m.transformer.h[0].attn.c_proj.weight
    expected = 0.02 / math.sqrt(2 * m.config.n_layer)
    assert abs(proj.std().item() - expected) / expected < 0.2
    assert all(b is None for b in [m.transformer.h[0].attn.c_attn.bias, m.transformer.h[0].mlp.c_fc.bias])


def test_causality():
    torch.manual_seed(0)
    m = GPT(preset("tiny", vocab_size=50)).eval()
    x = torch.randint(0, 50, (1, 20))
    x2 = x.clone()
    x2[0, 15:] = (x2[0, 15:] + 1) % 50
    with torch.no_grad():
        assert torch.allclose(m(x)[0, :15], m(x2)[0, :15], atol=1e-6)
        assert not torch.allclose(m(x)[0, 15:], m(x2)[0, 15:])


@pytest.mark.parametrize("name,millions", [("gpt2-124m", 85.0), ("gpt2-350m", 302.0), ("gpt2-774m", 708.0)])
def test_gpt2_non_embedding_params(name, millions):
    # analytical count without materialising: 12*L*C^2 (+ LayerNorm weights) + wte(V*C)
    cfg = preset(name)
    L, C = cfg.n_layer, cfg.n_embd
    blocks = L * (12 * C * C + 2 * C) + C  # attn 4C^2, mlp 8C^2, two LayerNorm weights per block, ln_f
    total = blocks + cfg.vocab_size * C
    assert abs((blocks) / 1e6 - millions) < 1.0  # transformer body without embeddings (nanoGPT: 85M for 124M)
    assert total > blocks


def test_tiny_param_count_matches_formula():
    cfg = preset("tiny", vocab_size=64)
    m = GPT(cfg)
    C, L = cfg.n_embd, cfg.n_layer
    assert m.num_params() == L * (12 * C * C + 2 * C) + C + cfg.vocab_size * C


def test_unknown_preset():
    with pytest.raises(ConfigError, match="expected one of"):
        preset("gpt5")
    assert set(PRESETS) >= {"tiny", "small", "gpt2-124m", "gpt2-350m", "gpt2-774m"}


def test_small_byte_is_smalls_body_with_a_byte_vocabulary():
    """The bridge studies' preset (issue 43): small's blocks, a context of 288 bytes, the body (blocks and final
    norm) ~91% of the parameters with the byte tokenizer's 257 ids padded to 320, against ~11% in small with GPT-2's."""
    body = {k: PRESETS["small"][k] for k in ("n_layer", "n_head", "n_embd")}
    assert {k: PRESETS["small-byte"][k] for k in body} == body and PRESETS["small-byte"]["block_size"] == 288
    for name, vocab, lo, hi in (("small-byte", 320, 0.90, 0.92), ("small", 50304, 0.10, 0.12)):
        m = GPT(preset(name, vocab_size=vocab))
        total = sum(p.numel() for p in m.parameters())
        blocks = total - m.transformer.wte.weight.numel() - m.transformer.wpe.weight.numel()
        assert lo < blocks / total < hi, (name, blocks / total)


@pytest.mark.parametrize("over", [{}, {"model.dropout": 0.1}, {"model.vocab_size": 512, "model.block_size": 64},
                                  {"model.preset": "small"}])
def test_one_answer_to_which_model_a_config_trains(tiny_data, over):
    # the trainer (checked against the data) and a FLOPs budget sized before the run ask the same function
    from eslm.config import build_config, model_config_for, training_flops_model
    from eslm.data.loader import open_dataset
    from eslm.flops import FlopsModel
    from eslm.train.setup import checked_model_config

    cfg = build_config(overrides=[f"{k}={v}" for k, v in {"data.tokenizer": "byte", "data.seq_len": 32,
                                                              "model.preset": "tiny", **over}.items()])
    trained = checked_model_config(cfg, open_dataset(tiny_data))
    assert trained == model_config_for(cfg)
    assert trained.vocab_size == (over.get("model.vocab_size") or 320) and trained.dropout == over.get("model.dropout", 0.0)
    assert training_flops_model(cfg) == FlopsModel.from_config(trained, 32)
