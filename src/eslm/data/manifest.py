"""``manifest.json`` of a prepared data directory (docs/data.md, "Directory and manifest") and the checks that the
directory is intact (content hashes only when asked or when the data is small: hashing is O(size))."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from eslm.errors import DataError
from eslm.files import atomic_write, name_problem, sha256_file

MANIFEST_NAME = "manifest.json"
FORMAT = "eslm-tokens"
VERSION = 1
SPLITS = ("train", "val")
# verify="auto" hashes the shards when they total at most this many bytes (the stdlib corpus: ~15 MB)
AUTO_HASH_MAX_BYTES = 256 * 2**20
_REQUIRED = ("format", "version", "tokenizer", "dtype", "domains", "files", "num_tokens")


def dtype_for_vocab(vocab_size: int) -> str:
    """"uint16" when every id (0 .. vocab_size-1) fits in 16 bits, else "uint32"."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def shard_name(split: str, domain: str) -> str:
    return f"{split}-{domain}.bin"


def content_hash(files: list[dict]) -> str:
    lines = sorted(f"{f['path']} {f['sha256']}" for f in files)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def write_manifest(data_dir: str | os.PathLike, manifest: dict) -> Path:
    path = Path(data_dir) / MANIFEST_NAME
    atomic_write(path, (json.dumps(manifest, indent=2, sort_keys=False) + "\n").encode())  # never half a manifest
    return path


def read_manifest(data_dir: str | os.PathLike) -> dict:
    """The parsed, schema-checked manifest of ``data_dir``; every problem is a one-line DataError."""
    data_dir = Path(data_dir)
    fix = f"fix: run 'eslm prepare SOURCE --out {data_dir}'"
    if not data_dir.is_dir():
        raise DataError(f"expected a prepared data directory at {data_dir}; found no such directory; {fix}")
    path = data_dir / MANIFEST_NAME
    if not path.is_file():
        raise DataError(f"expected {path}; found the directory without a manifest; {fix}")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"expected valid JSON in {path}; found {type(e).__name__} ({e}); {fix}") from None
    _check_schema(manifest, path, fix)
    return manifest


def _check_schema(m: object, path: Path, fix: str) -> None:
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise DataError(f"expected an {FORMAT} manifest in {path}; found another file; {fix}")
    missing = [k for k in _REQUIRED if k not in m]
    if missing:
        raise DataError(f"expected manifest keys {list(_REQUIRED)} in {path}; found {missing} missing; {fix}")
    if m["version"] != VERSION:
        raise DataError(f"expected manifest version {VERSION} in {path}; found {m['version']!r}; {fix}")
    if m["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"expected dtype uint16 or uint32 in {path}; found {m['dtype']!r}; {fix}")
    tok = m["tokenizer"]
    if not isinstance(tok, dict) or not {"name", "vocab_size", "eot_id"} <= set(tok):
        raise DataError(f"expected tokenizer {{name, vocab_size, eot_id}} in {path}; found {tok!r}; {fix}")
    if dtype_for_vocab(int(tok["vocab_size"])) == "uint32" and m["dtype"] == "uint16":
        raise DataError(f"expected dtype uint32 for vocab {tok['vocab_size']} in {path}; found uint16; {fix}")
    seen = set()
    if not isinstance(m["files"], list) or not all(isinstance(f, dict) for f in m["files"]):
        raise DataError(f"expected files to be a list of objects in {path}; found {type(m['files']).__name__}; "
                        f"{fix}")
    for f in m["files"]:
        if (why := name_problem(f.get("path"), "files[].path")) is not None:  # shards live in the directory itself
            raise DataError(f"{path}: {why}: a shard must be a file of the data directory itself (never "
                            f"'../', an absolute path or a hidden name); {fix}")
        key = (f.get("split"), f.get("domain"))
        if key[0] not in SPLITS or key[1] not in m["domains"] or key in seen:
            raise DataError(f"expected one file per (split in {list(SPLITS)}, domain in {m['domains']}) in {path}; "
                            f"found {f.get('path')!r} with {key}; {fix}")
        seen.add(key)


def verify_shards(data_dir: str | os.PathLike, manifest: dict, verify: str = "auto") -> None:
    """Check every shard exists with its byte size (always) and SHA-256 (verify="hash", or "auto" when small).

    verify: "size" | "hash" | "auto". Raises a one-line DataError naming the first bad shard.
    """
    data_dir = Path(data_dir)
    itemsize = 2 if manifest["dtype"] == "uint16" else 4
    fix = f"fix: re-run 'eslm prepare' into {data_dir}"
    total = 0
    for f in manifest["files"]:
        path = data_dir / f["path"]
        if not path.is_file():
            raise DataError(f"expected shard {path} listed in the manifest; found it missing; {fix}")
        size = path.stat().st_size
        expected = int(f["num_tokens"]) * itemsize
        if size != expected or size != int(f["num_bytes"]):
            raise DataError(f"expected shard {path} of {expected} bytes; found {size} bytes (truncated or "
                            f"overwritten); {fix}")
        total += size
    if verify == "hash" or (verify == "auto" and total <= AUTO_HASH_MAX_BYTES):
        for f in manifest["files"]:
            path = data_dir / f["path"]
            if sha256_file(path) != f["sha256"]:
                raise DataError(f"expected shard {path} with sha256 {f['sha256'][:12]}...; found different "
                                f"content (corrupt); {fix}")


def check_token_range(data_dir: str | os.PathLike, manifest: dict, chunk_tokens: int = 1 << 24) -> None:
    """DataError unless every token id of every shard is below the tokenizer's vocabulary size, whatever the size
    (else it would fail deep in training with an IndexError or a device assert)."""
    import numpy as np

    data_dir = Path(data_dir)
    vocab = int(manifest["tokenizer"]["vocab_size"])
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    for f in manifest["files"]:
        if int(f["num_tokens"]) == 0:
            continue
        path = data_dir / f["path"]
        ids = np.memmap(path, dtype=dtype, mode="r")
        for start in range(0, ids.size, chunk_tokens):
            top = int(ids[start:start + chunk_tokens].max())
            if top >= vocab:
                pos = start + int(np.argmax(ids[start:start + chunk_tokens] >= vocab))
                raise DataError(f"expected token ids < {vocab} ({manifest['tokenizer']['name']}) in shard {path}; "
                                f"found id {int(ids[pos])} at token {pos} (corrupt or overwritten); "
                                f"fix: re-run 'eslm prepare' into {data_dir}")
        del ids
