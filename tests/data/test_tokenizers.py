"""The exact GPT-2 BPE offline, and the byte tokenizer."""

from pathlib import Path

import pytest

from eslm.data.tokenizers import get_tokenizer
from eslm.errors import ConfigError

KNOWN_GPT2_IDS = {
    "Hello world": [15496, 995],
    " Hello world": [18435, 995],
    "Hello, my dog is cute": [15496, 11, 616, 3290, 318, 13779],
}


@pytest.mark.parametrize("text,ids", list(KNOWN_GPT2_IDS.items()))
def test_gpt2_known_ids(text, ids):
    assert get_tokenizer("gpt2").encode(text) == ids


def test_gpt2_constants_and_batch():
    tok = get_tokenizer("gpt2")
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("gpt2", 50257, 50256)
    texts = list(KNOWN_GPT2_IDS)
    assert tok.encode_batch(texts) == [KNOWN_GPT2_IDS[t] for t in texts]


def test_gpt2_special_string_in_data_is_plain_text():
    # documents containing "<|endoftext|>" must not inject the real eot id into the stream
    ids = get_tokenizer("gpt2").encode("a <|endoftext|> b")
    assert 50256 not in ids
    assert get_tokenizer("gpt2").decode(ids) == "a <|endoftext|> b"


def test_gpt2_roundtrip_unicode():
    tok = get_tokenizer("gpt2")
    text = "naïve café — 日本語 🙂\n\tdef f(x): return x**2"
    assert tok.decode(tok.encode(text)) == text


def test_tokenizers_pickle_by_name():
    import pickle

    for name in ("gpt2", "byte"):
        tok = pickle.loads(pickle.dumps(get_tokenizer(name)))
        assert tok.name == name and tok.encode("Hello world") == get_tokenizer(name).encode("Hello world")


def test_byte_tokenizer():
    tok = get_tokenizer("byte")
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("byte", 257, 256)
    assert tok.encode("hé") == [104, 195, 169]
    assert tok.decode(tok.encode("hé") + [tok.eot_id]) == "hé"
    assert tok.encode_batch(["a", "bc"]) == [[97], [98, 99]]


def test_matches_transformers_gpt2_if_cached():
    """Cross-check against HF's GPT-2 tokenizer when a local copy exists (never downloads)."""
    hub = pytest.importorskip("huggingface_hub")
    if not isinstance(hub.try_to_load_from_cache("gpt2", "tokenizer.json"), str):
        pytest.skip("no local HF gpt2 tokenizer")  # checked before importing transformers (slow import)
    transformers = pytest.importorskip("transformers")
    try:
        hf = transformers.AutoTokenizer.from_pretrained("gpt2", local_files_only=True)
    except Exception:
        pytest.skip("no local HF gpt2 tokenizer")
    text = "The quick brown fox, 1234 times: über\n\n  spaced   out"
    assert get_tokenizer("gpt2").encode(text) == hf(text)["input_ids"]


def test_matches_transformers_gpt2_built_from_the_shipped_files(tmp_path):
    """HF's GPT-2 tokenizer (its own BPE implementation), built offline from the vocabulary files eslm ships,
    gives the same ids on source code, prose, and the bytes GPT-2 remaps (controls, NBSP, soft hyphen)."""
    pytest.importorskip("transformers")
    import json

    from transformers import AutoTokenizer

    from eslm.model.export_hf import save_gpt2_tokenizer

    assert save_gpt2_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    texts = [Path(json.__file__).read_text()[:20000], "naïve café — 日本語 🙂 x\u00a0y\u00adz \x00\x07\x1b[0m\r\n",
             "The quick brown fox, 1234 times: über\n\n  spaced   out   ", "'s 're 've 'll 'd I'm"]
    tok = get_tokenizer("gpt2")
    for text in texts:
        assert tok.encode(text) == hf(text)["input_ids"]


def test_shipped_vocabulary_is_checked(tmp_path, monkeypatch):
    from eslm.data import tokenizers
    from eslm.errors import DataError

    shipped = {name: (tokenizers._GPT2_DIR / name).read_bytes() for name in ("encoder.json", "vocab.bpe")}
    (tmp_path / "encoder.json").write_bytes(shipped["encoder.json"])
    (tmp_path / "vocab.bpe").write_bytes(shipped["vocab.bpe"].replace(b"\n", b"\r\n"))
    monkeypatch.setattr(tokenizers, "_GPT2_DIR", tmp_path)
    with pytest.raises(DataError, match="expected GPT-2's vocab.bpe .*CRLF") as e:
        tokenizers.gpt2_bpe_files()
    assert "\n" not in str(e.value)
    (tmp_path / "vocab.bpe").write_bytes(shipped["vocab.bpe"])
    (tmp_path / "encoder.json").unlink()
    with pytest.raises(DataError, match="encoder.json .*unreadable.*reinstall eslm"):
        tokenizers.gpt2_bpe_files()


def test_unknown_tokenizer_lists_valid_names():
    with pytest.raises(ConfigError, match="gpt2.*byte") as e:
        get_tokenizer("llama")
    assert "\n" not in str(e.value)
