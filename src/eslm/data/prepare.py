"""``eslm prepare SOURCE --out DIR``: text -> token shards + ``manifest.json`` (format: see manifest.py).

Worker processes read and tokenise chunks of documents, written back in source order (the shards do not depend
on the number of workers); every document is followed by the end-of-text id. The output is written to a marked
temporary sibling and renamed into place; what ``--force`` may replace: docs/data.md ("Preparing a corpus").
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

import eslm
from eslm.data import manifest as mf
from eslm.data.sources import Document, document_text, get_source
from eslm.data.tokenizers import get_tokenizer
from eslm.errors import ConfigError, DataError
from eslm.files import check_forced_out, named, output_lock, read_marker, swap_dir

CHUNK_DOCS = 64  # documents per worker task: big enough to amortise IPC, small enough for a smooth bar
CHUNK_CHARS = 4_000_000  # ... and at most this many characters of inline text per task


class _ShardWriter:
    """Appends token arrays to one (split, domain) file, hashing and counting as it goes."""

    def __init__(self, path: Path, dtype: str):
        self.path, self.dtype = path, np.dtype(dtype).newbyteorder("<")
        self._f = open(path, "wb")
        self._sha = hashlib.sha256()
        self.num_tokens = 0
        self.num_documents = 0

    def write(self, tokens: np.ndarray, num_documents: int) -> None:
        data = tokens.astype(self.dtype, copy=False).tobytes()
        with named(self.path):  # a full disk: the error names the shard
            self._f.write(data)
        self._sha.update(data)
        self.num_tokens += tokens.size
        self.num_documents += num_documents

    def close(self) -> dict:
        with named(self.path):
            self._f.close()
        return {"path": self.path.name, "num_tokens": self.num_tokens, "num_bytes": self.num_tokens *
                self.dtype.itemsize, "sha256": self._sha.hexdigest()}


def _tokenize_chunk(task: tuple[str, str, list[Document]]) -> tuple[int, list[tuple[str, str, np.ndarray, int]]]:
    """Worker: read + tokenise a chunk of documents.

    Returns (documents read, [(split, domain, tokens, documents kept)]) with groups in first-seen order;
    tokens: 1-D array of dtype ``task[1]``, each kept document's ids followed by eot.
    """
    tokenizer_name, dtype, docs = task
    tok = get_tokenizer(tokenizer_name)
    texts = [document_text(d) for d in docs]
    kept = [(d, t) for d, t in zip(docs, texts) if t]
    ids = tok.encode_batch([t for _, t in kept])
    groups: dict[tuple[str, str], list[np.ndarray]] = {}
    eot = np.array([tok.eot_id], dtype=dtype)
    for (doc, _), doc_ids in zip(kept, ids):
        groups.setdefault((doc.split, doc.domain), []).extend([np.asarray(doc_ids, dtype=dtype), eot])
    return len(docs), [(s, d, np.concatenate(parts), len(parts) // 2) for (s, d), parts in groups.items()]


def _chunks(docs: Iterable[Document], tokenizer: str, dtype: str) -> Iterator[tuple[str, str, list[Document]]]:
    chunk, chars = [], 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc.payload)
        if len(chunk) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield tokenizer, dtype, chunk
            chunk, chars = [], 0
    if chunk:
        yield tokenizer, dtype, chunk


def _tokenized(tasks: Iterator, workers: int) -> Iterator:
    """Results of ``_tokenize_chunk`` in task order, in ``workers`` processes (1: in this process)."""
    if workers <= 1:
        yield from map(_tokenize_chunk, tasks)
        return
    import multiprocessing as mp

    # spawn, not fork: the parent may hold threads (torch, tiktoken) that fork would copy in a locked state
    with mp.get_context("spawn").Pool(workers) as pool:
        yield from pool.imap(_tokenize_chunk, tasks)


def prepare(source: str, out_dir: str | os.PathLike, *, tokenizer: str = "gpt2", paths: list[str] | None = None,
            domains: list[str] | None = None, val_fraction: float | None = None, workers: int | None = None,
            progress: bool = True, overwrite: bool = False, hf_cache_dir: str | None = None,
            _lock: bool = True) -> dict:
    """Tokenise ``source`` into ``out_dir``; returns the manifest dict (also written as manifest.json).

    val_fraction: share of documents (by stable hash) sent to val, stdlib/text only (default 0.05).
    workers: tokenisation processes (default min(2, cpu count)); the output does not depend on it.
    """
    out_dir = Path(out_dir)
    manifest: dict = {}
    # without _lock the caller (ensure_prepared) holds the output lock
    with output_lock(out_dir, WHAT).acquire() if _lock else contextlib.nullcontext():
        t0 = time.perf_counter()
        earlier = read_marker(out_dir / mf.MANIFEST_NAME, mf.FORMAT)
        check_forced_out(out_dir, "an eslm-prepared directory", None if earlier is None else
                         {mf.MANIFEST_NAME, *(f.get("path") for f in earlier.get("files", []))}, overwrite)
        tok = get_tokenizer(tokenizer)
        src = get_source(source, paths=paths, domains=domains, val_fraction=val_fraction, hf_cache_dir=hf_cache_dir)
        dtype = mf.dtype_for_vocab(tok.vocab_size)

        def fill(tmp: Path) -> None:
            writers = {(s, d): _ShardWriter(tmp / mf.shard_name(s, d), dtype) for s in mf.SPLITS
                       for d in src.domains}
            _write_all(src, tok.name, dtype, writers, workers or max(1, min(2, os.cpu_count() or 1)), progress)
            files = [dict(w.close(), split=s, domain=d) for (s, d), w in writers.items()]
            manifest.update(_build_manifest(src, tok, dtype, files, writers, time.perf_counter() - t0))
            _check_not_empty(src, manifest)
            mf.write_manifest(tmp, manifest)

        swap_dir(out_dir, fill)
    return manifest


WHAT = "prepare output directory"


def _check_not_empty(src, manifest: dict) -> None:
    """A corpus of 0 training tokens cannot train anything: refused here, not later by ``eslm train``."""
    if sum(manifest["num_tokens"]["train"].values()) == 0:
        docs = sum(sum(d.values()) for d in manifest["num_documents"].values())
        raise DataError(f"expected text to tokenize in {src.name}; found 0 tokens in the train split ({docs} "
                        "non-empty document(s) in all, every file empty or none matched); fix: check the paths "
                        "and --domains")


def _write_all(src, tokenizer: str, dtype: str, writers: dict, workers: int, progress: bool) -> None:
    from tqdm.auto import tqdm

    tasks = _chunks(src.documents(), tokenizer, dtype)
    with tqdm(total=src.num_documents, unit="doc", desc=f"prepare {src.name}", disable=not progress) as bar:
        total = 0
        for n_read, results in _tokenized(tasks, workers):
            for split, domain, tokens, n_docs in results:
                writers[(split, domain)].write(tokens, n_docs)
                total += tokens.size
            bar.update(n_read)
            bar.set_postfix(tokens=f"{total:,}", refresh=False)


def _build_manifest(src, tok, dtype, files, writers, seconds) -> dict:
    count = {s: {d: writers[(s, d)].num_tokens for d in src.domains} for s in mf.SPLITS}
    docs = {s: {d: writers[(s, d)].num_documents for d in src.domains} for s in mf.SPLITS}
    return {
        "format": mf.FORMAT, "version": mf.VERSION,
        "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
        "dtype": dtype, "byteorder": "little",
        "domains": list(src.domains), "splits": list(mf.SPLITS),
        "files": files, "num_tokens": count, "num_documents": docs,
        "content_hash": mf.content_hash(files),
        "source": src.description, "val_fraction": src.description.get("val_fraction"),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "eslm_version": eslm.__version__, "id": uuid.uuid4().hex,
        "prepare_seconds": round(seconds, 3),
    }


def default_data_root() -> Path:
    """$ESLM_DATA_DIR, else ./data."""
    return Path(os.environ.get("ESLM_DATA_DIR") or "data")


def ensure_prepared(source: str = "stdlib", tokenizer: str = "gpt2", root: str | os.PathLike | None = None,
                    *, progress: bool = False, **kwargs) -> Path:
    """The directory ``root/{source}-{tokenizer}``, preparing it first if it has no manifest.

    An existing directory is validated (manifest + shard sizes) and reused, never silently rebuilt.
    Safe when several processes call it at once: the first to finish wins, the others use its result.
    """
    if source == "text":
        raise ConfigError("expected a source that needs no paths for ensure_prepared; found 'text'; "
                          "fix: run 'eslm prepare text --out DIR PATH...' and point data.dir at DIR")
    out = Path(root) if root is not None else default_data_root()
    out = out / f"{source}-{tokenizer}"
    if not (out / mf.MANIFEST_NAME).is_file():
        with output_lock(out, WHAT).acquire(wait=True):  # a concurrent caller prepares; we then use its result
            if not (out / mf.MANIFEST_NAME).is_file():
                prepare(source, out, tokenizer=tokenizer, progress=progress, _lock=False, **kwargs)
    manifest = mf.read_manifest(out)
    mf.verify_shards(out, manifest, verify="size")
    return out


def format_summary(m: dict, out: Path) -> str:
    """A small table of tokens per (domain, split) plus totals and the time taken."""
    lines = [f"{'domain':<16}{'train tokens':>16}{'val tokens':>14}{'train docs':>12}{'val docs':>10}"]
    for d in m["domains"]:
        lines.append(f"{d:<16}{m['num_tokens']['train'][d]:>16,}{m['num_tokens']['val'][d]:>14,}"
                     f"{m['num_documents']['train'][d]:>12,}{m['num_documents']['val'][d]:>10,}")
    tot = {s: sum(m["num_tokens"][s].values()) for s in mf.SPLITS}
    lines.append(f"{'total':<16}{tot['train']:>16,}{tot['val']:>14,}")
    lines.append(f"wrote {out} ({m['tokenizer']['name']}, {m['dtype']}) in {m['prepare_seconds']:.1f} s; "
                 f"content hash {m['content_hash'][:16]}")
    return "\n".join(lines)
