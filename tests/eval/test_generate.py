"""`eslm sample`: KV-cached generation equals uncached generation and transformers' greedy `generate` on the
export of the same weights; the incremental forward equals the full one."""

from __future__ import annotations

import pytest
import torch

from eslm.cli import main
from eslm.eval.generate import generate
from eslm.model.gpt import GPT, KVCache, preset
from eslm.train.snapshots import save_snapshot


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = GPT(preset("tiny", vocab_size=320)).eval()
    with torch.no_grad():  # larger weights than the init: confident, varied predictions (no argmax near-ties)
        for p in m.parameters():
            p.mul_(4.0)
    return m


def test_incremental_forward_equals_full_forward(model):
    idx = torch.randint(0, 320, (2, 40))
    full = model(idx)
    cache = KVCache(model.config.n_layer)
    parts = [model(idx[:, :17], cache=cache), model(idx[:, 17:18], cache=cache), model(idx[:, 18:], cache=cache)]
    assert cache.length == 40
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prompt_len,new", [(5, 20), (50, 40)])  # the second crosses block_size=64
def test_cached_and_uncached_greedy_agree(model, prompt_len, new):
    prompt = torch.randint(0, 256, (prompt_len,)).tolist()
    cached = generate(model, prompt, new, temperature=0, vocab_limit=257)
    uncached = generate(model, prompt, new, temperature=0, vocab_limit=257, use_cache=False)
    assert cached == uncached and len(cached) == new
    assert max(cached) < 257  # padded vocabulary rows are never produced


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    prompt = [1, 2, 3]
    a = generate(model, prompt, 15, temperature=1.0, top_k=50, seed=7)
    assert a == generate(model, prompt, 15, temperature=1.0, top_k=50, seed=7)
    assert a != generate(model, prompt, 15, temperature=1.0, top_k=50, seed=8)
    assert generate(model, prompt, 15, temperature=1.0, top_k=1, seed=3) == generate(model, prompt, 15, temperature=0)


def _snapshot(model, tmp_path):
    return save_snapshot(tmp_path / "snapshots", model.state_dict(),
                         {"model_config": model.config.to_dict(), "tokenizer": "byte", "step": 1})


def test_hf_generate_agrees_on_the_export(model, tmp_path):
    transformers = pytest.importorskip("transformers")
    from eslm.model.export_hf import export

    export(_snapshot(model, tmp_path), tmp_path / "hf", with_tokenizer=False)
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    prompt = [104, 101, 108, 108, 111, 32]
    ours = generate(model, prompt, 30, temperature=0, vocab_limit=hf.config.vocab_size, stop_ids={256})
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=30, pad_token_id=256)
    assert out[0, len(prompt):].tolist() == ours


def test_sample_command(model, tmp_path, capsys):
    snap = _snapshot(model, tmp_path)
    assert main(["sample", str(snap), "--prompt", "hello", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert greedy.startswith("hello")
    assert main(["sample", str(snap), "--prompt", "hello", "--max-new-tokens", "8", "--temperature", "0",
                 "--no-kv-cache"]) == 0
    assert capsys.readouterr().out == greedy
    assert main(["sample", str(snap), "--max-new-tokens", "0"]) == 2
    assert "expected --max-new-tokens >= 1" in capsys.readouterr().err


def test_a_temperature_too_small_to_divide_by_is_greedy(model, tmp_path, capsys):
    # issue 47: --temperature 1e-300 made logits / T overflow to inf and torch.multinomial raise (a traceback);
    # sampling's limit as T goes to 0 is the argmax
    prompt = [1, 2, 3]
    greedy = generate(model, prompt, 15, temperature=0)
    for t in (1e-40, 1e-300, 5e-324):
        assert generate(model, prompt, 15, temperature=t, top_k=50, seed=1) == greedy
    snap = _snapshot(model, tmp_path)
    args = ["sample", str(snap), "--prompt", "hello", "--max-new-tokens", "8"]
    assert main([*args, "--temperature", "0"]) == 0
    expected = capsys.readouterr().out
    assert main([*args, "--temperature", "1e-300"]) == 0
    assert capsys.readouterr().out == expected
