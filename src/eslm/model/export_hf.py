"""A run directory or checkpoint to a transformers GPT-2 directory (the command: ``eslm/cli/export_hf.py``).

The conversion itself is ``eslm.model.hf`` (see its docstring for the vocabulary and bias conventions);
loading the source is ``eslm.model.loading``.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from eslm import metrics as M
from eslm.data.tokenizers import gpt2_bpe_files, tokenizer_class
from eslm.errors import ConfigError
from eslm.files import DIR_MARKER, check_forced_out, os_error_in, output_lock, read_marker, swap_dir
from eslm.model.hf import EXPORT_FORMAT, EXPORT_INFO_FILE, to_hf
from eslm.model.loading import is_run_dir, load_model

# ----------------------------------------------------------------------------------------- tokenizer


def save_gpt2_tokenizer(out_dir: str | Path) -> bool:
    """Write GPT-2's BPE tokenizer (from the vocabulary files eslm ships, no download) to ``out_dir`` in
    transformers format. Returns False when transformers is unavailable."""
    try:
        from transformers import GPT2Tokenizer
    except ImportError:
        return False

    vocab_bpe, encoder_json = gpt2_bpe_files()  # checked against OpenAI's digests
    vocab = json.loads(encoder_json.read_text(encoding="utf-8"))
    lines = vocab_bpe.read_text(encoding="utf-8").split("\n")[1:]  # skip "#version"
    merges = [tuple(line.split(" ")) for line in lines if line]
    import inspect

    if "vocab_file" in inspect.signature(GPT2Tokenizer.__init__).parameters:  # transformers 4.x
        tok = GPT2Tokenizer(vocab_file=str(encoder_json), merges_file=str(vocab_bpe))
    else:
        tok = GPT2Tokenizer(vocab=vocab, merges=merges)
    tok.save_pretrained(str(out_dir))
    return True


def _tokenizer_vocab(name: str | None) -> tuple[int | None, int | None]:
    """(vocab_size, eot_id) of a tokenizer name, or (None, None) when unknown."""
    try:
        tok = tokenizer_class(name or "")
    except ConfigError:
        return None, None
    return tok.vocab_size, tok.eot_id


def export(source: str | Path, out_dir: str | Path, keep_padded_vocab: bool = False,
           with_tokenizer: bool = True, force: bool = False) -> dict:
    """Export a run directory / checkpoint to ``out_dir`` (HF GPT-2 dir); returns the metadata written.

    ``out_dir`` must be new or empty, or (``force``) an earlier eslm export that holds only its own files; never
    a run directory. Written whole by ``eslm.files.swap_dir``: a kill leaves no half export."""
    out = Path(out_dir)
    check_export_target(out, force)  # before the model is loaded; again under the lock
    with output_lock(out, "export directory").acquire():  # a second export to the same --out is refused
        check_export_target(out, force)
        model, info = load_model(source)
        tok_vocab, eot = _tokenizer_vocab(info.get("tokenizer"))
        vocab = None if keep_padded_vocab or tok_vocab is None else min(tok_vocab, model.config.vocab_size)
        hf = to_hf(model, vocab_size=vocab, eot_id=eot)
        meta = {"format": EXPORT_FORMAT, "id": uuid.uuid4().hex, "tokenizer": info.get("tokenizer"),
                "step": info.get("step"), "source": info.get("source"),
                "vocab_size_trained": model.config.vocab_size, "vocab_size_exported": hf.config.vocab_size}

        def fill(tmp: Path) -> None:
            try:
                hf.save_pretrained(str(tmp))
            except Exception as e:  # a full disk inside safetensors' writer: its error names the OS error in its text
                err = os_error_in(e, tmp / "model.safetensors")
                if err is None:
                    raise
                raise err from None
            meta["tokenizer_files"] = bool(with_tokenizer and info.get("tokenizer") == "gpt2"
                                           and save_gpt2_tokenizer(tmp))
            meta["files"] = sorted({p.name for p in tmp.iterdir() if p.name != DIR_MARKER} | {EXPORT_INFO_FILE})
            meta.update({k: info[k] for k in (M.FLOPS_PAPER, M.FLOPS_EXECUTED) if k in info})
            (tmp / EXPORT_INFO_FILE).write_text(json.dumps(meta, indent=2) + "\n")

        swap_dir(out, fill)
    return meta


def check_export_target(out: Path, force: bool) -> None:
    """A one-line ConfigError unless ``out`` is new, empty, or an earlier export that ``force`` may replace (not a
    run directory, no other program's files: an export lists its files in its metadata)."""
    if out.is_dir() and not out.is_symlink() and is_run_dir(out):
        raise ConfigError(f"--out {out} is a run directory: eslm eval / sample would no longer know which weights "
                          f"it means; fix: export next to it, e.g. --out {out.parent / (out.name + '-hf')}")
    previous = read_marker(out / EXPORT_INFO_FILE, EXPORT_FORMAT)
    check_forced_out(out, "an earlier eslm export", None if previous is None else
                     {*previous.get("files", ()), EXPORT_INFO_FILE}, force)
