"""Tokenizers (``get_tokenizer``): the exact GPT-2 BPE, built offline from OpenAI's files shipped in
``eslm/data/gpt2_bpe/`` and checked against tiktoken's digests (docs/data.md, "Tokenizers"), and a byte-level one."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from eslm.errors import ConfigError, DataError

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


_GPT2_DIR = Path(__file__).resolve().parent / "gpt2_bpe"


def _read_checked(fname: str) -> bytes:
    """The bytes of GPT-2's BPE file ``fname`` shipped with eslm, after checking its SHA-256."""
    path, digest = _GPT2_DIR / fname, _GPT2_FILE_SHA256[fname]
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"expected GPT-2's BPE file {path} (it ships with eslm); found it unreadable "
                        f"({e.strerror or e}); fix: reinstall eslm") from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise DataError(f"expected GPT-2's {fname} (sha256 {digest[:12]}...); found different content at {path}; "
                        f"fix: reinstall eslm (a checkout converted to CRLF line endings changes it too)")
    return data


def gpt2_bpe_files() -> tuple[Path, Path]:
    """(vocab.bpe, encoder.json): GPT-2's BPE files shipped with eslm, both checked against OpenAI's SHA-256."""
    for fname in _GPT2_FILE_SHA256:
        _read_checked(fname)
    return _GPT2_DIR / "vocab.bpe", _GPT2_DIR / "encoder.json"


def _gpt2_byte_of_char() -> dict[str, int]:
    """GPT-2's byte alphabet, inverted: the character that stands for each byte in encoder.json -> the byte.

    The 188 printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves; the other 68 bytes
    (controls, space, NBSP, soft hyphen), in increasing order, stand for U+0100, U+0101, ..."""
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    others = sorted(set(range(256)) - set(printable))
    return {**{chr(b): b for b in printable}, **{chr(0x100 + n): b for n, b in enumerate(others)}}


@functools.lru_cache(maxsize=1)
def _build_gpt2_encoding():
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    encoder = json.loads(_read_checked("encoder.json"))
    eot = encoder.pop("<|endoftext|>")
    byte_of = _gpt2_byte_of_char()
    # A token's BPE rank is its id: GPT-2 numbers the 256 bytes first, then each merge in vocab.bpe's order.
    ranks = {bytes(byte_of[c] for c in token): rank for token, rank in encoder.items()}
    assert eot == _GPT2_EOT_ID and len(ranks) == _GPT2_EOT_ID  # guaranteed by the digest checked above
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": _GPT2_EOT_ID},
        explicit_n_vocab=_GPT2_VOCAB_SIZE,
    )


TOKENIZERS: dict[str, type[GPT2Tokenizer] | type[ByteTokenizer]] = {"gpt2": GPT2Tokenizer, "byte": ByteTokenizer}
TOKENIZER_NAMES = tuple(TOKENIZERS)


def tokenizer_class(name: str) -> type[GPT2Tokenizer] | type[ByteTokenizer]:
    """The class of tokenizer ``name``: its ``vocab_size`` and ``eot_id`` without building it."""
    if name not in TOKENIZERS:
        raise ConfigError(f"expected a tokenizer name in {list(TOKENIZER_NAMES)}; found {name!r}; "
                          f"fix: use one of {', '.join(TOKENIZER_NAMES)}")
    return TOKENIZERS[name]


@functools.cache
def get_tokenizer(name: str) -> GPT2Tokenizer | ByteTokenizer:
    """The tokenizer called ``name`` ("gpt2" or "byte"); instances are cached per process."""
    return tokenizer_class(name)()


def resolve_tokenizer(name: str | None, model_vocab: int | None = None,
                      source: str = "the model") -> GPT2Tokenizer | ByteTokenizer:
    """The tokenizer a checkpoint names (or the one ``--tokenizer`` names); one line when it names none, or when
    it has more ids than ``model_vocab``, the vocabulary of the model loaded from ``source``."""
    if not name:
        raise ConfigError("expected the checkpoint to name its tokenizer, found none; pass --tokenizer gpt2|byte")
    tok = get_tokenizer(name)
    if model_vocab is not None and tok.vocab_size > model_vocab:
        raise ConfigError(f"expected a tokenizer with at most {model_vocab} ids for {source} (the model's "
                          f"vocabulary), found {tok.name} with {tok.vocab_size}; pass the --tokenizer it was "
                          "trained with")
    return tok
