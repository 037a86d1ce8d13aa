"""The corpus of the confirmatory 124M GPU study (configs/studies/confirm-124m-gpu.yaml): English prose and Python
code as two domains, from pinned downloads, built deterministically here and carried to the GPU machine.

    PYTHONPATH=src python benchmarks/confirm_corpus.py build --out data/confirm-gpt2 [--cache DIR]
    PYTHONPATH=src python benchmarks/confirm_corpus.py check data/confirm-gpt2

Inputs (each pinned by version and the SHA-256 of its download; a different download is refused in one line):

* ``prose``: the Linux kernel's documentation, Debian's ``linux-doc-6.1`` package (``apt-get download``): every
  ``Documentation/**/*.rst`` and ``*.txt`` (shipped gzipped), the non-English ``translations/`` left out;
* ``code``: the Python sources of three pure-Python wheels from PyPI (``pip download``): sympy, networkx, mpmath;
  ``test``/``tests``/``testing`` directories left out.

A file that is not UTF-8 is skipped; a file whose bytes already appeared is kept once (in sorted path order).
The files are written under ``OUT.src/<domain>/`` and prepared by eslm's own ``text`` source (``eslm prepare
text``, GPT-2 BPE), whose split is by document: a file goes to validation when the SHA-256 of its domain and
relative path falls below ``VAL_FRACTION``, so validation is held-out documents, the same on every machine.

``build`` ends by comparing the prepared data's content hash (the manifest's ``content_hash``: SHA-256 over every
token shard's SHA-256) with ``CONTENT_HASH``, the value the study file names; ``check`` verifies a prepared
directory (every shard's SHA-256, then the content hash) and is what the GPU window runs first. Either prints
one line and exits 1 when they differ.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from eslm.data import manifest as mf
from eslm.data.prepare import prepare
from eslm.errors import DataError

DEB = ("linux-doc-6.1", "6.1.176-1", "0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f")
WHEELS = (
    ("sympy", "1.14.0", "e091cc3e99d2141a0ba2847328f5479b05d94a6635cb96148ccb3f34671bd8f5"),
    ("networkx", "3.6.1", "d47fbf302e7d9cbbb9e2555a0d267983d2aa476bac30e90dfbe5669bd57f3762"),
    ("mpmath", "1.3.0", "a0b2b9fe80bbcd81a6647ff13108738cfb482d481d826cc0e02f5b35e5c88d2c"),
)
VAL_FRACTION = 0.06
DOC_ROOT = "usr/share/doc/linux-doc-6.1/Documentation/"
SKIP_DIRS = {"test", "tests", "testing", "__pycache__"}
# the manifest's content_hash of a build from the pins above (set from the first build; the study file names it)
CONTENT_HASH = "a7a102445c4244a8f29f00429f0d1198e1ac84a3fa276d04770c18e6709a3d8c"


class CorpusError(Exception):
    """One line for the user: what was expected, what was found, how to fix it."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fetch(cmd: list[str], cache: Path, name: str, want: str) -> Path:
    """The pinned download ``name`` in ``cache`` (fetched with ``cmd`` unless already there), its SHA-256 checked."""
    path = cache / name
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(cmd, cwd=cache, capture_output=True, text=True)
        if done.returncode != 0 or not path.is_file():
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise CorpusError(f"expected to download {name} with `{' '.join(cmd)}`; it failed ({last[0]}); fix: "
                              f"run it where the package index is reachable (after `apt-get update` for the .deb), "
                              f"or put the file in {cache}")
    got = _sha256(path)
    if got != want:
        raise CorpusError(f"expected {path} with sha256 {want}; found {got}; fix: delete it and download the pinned "
                          "version again (a different file would build a different corpus)")
    return path


def downloads(cache: Path) -> tuple[Path, list[Path]]:
    """The pinned .deb and wheels, downloaded into ``cache`` where missing, each checked."""
    pkg, ver, sha = DEB
    deb = _fetch(["apt-get", "download", f"{pkg}={ver}"], cache, f"{pkg}_{ver}_all.deb", sha)
    wheels = [_fetch([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", ".",
                      f"{name}=={ver}"], cache, f"{name}-{ver}-py3-none-any.whl", sha) for name, ver, sha in WHEELS]
    return deb, wheels


def _keep(rel: str, text_bytes: bytes, seen: set[str], stats: dict) -> str | None:
    digest = hashlib.sha256(text_bytes).hexdigest()
    if digest in seen:
        stats["duplicates"] += 1
        return None
    try:
        text = text_bytes.decode("utf-8")
    except UnicodeDecodeError:
        stats["not_utf8"] += 1
        return None
    seen.add(digest)
    stats["files"] += 1
    stats["bytes"] += len(text_bytes)
    return text


def prose_files(deb: Path, work: Path) -> dict[str, bytes]:
    """{relative path: bytes} of the English .rst/.txt files of the kernel's documentation in the .deb."""
    root = work / "deb"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    docs = root / DOC_ROOT
    out = {}
    for path in sorted(docs.rglob("*.gz")):
        rel = path.relative_to(docs).as_posix()[:-3]
        if rel.startswith("translations/") or not rel.endswith((".rst", ".txt")):
            continue
        out[rel] = gzip.decompress(path.read_bytes())
    return out


def code_files(wheels: list[Path]) -> dict[str, bytes]:
    """{package/relative path: bytes} of the .py files of the wheels, test directories left out."""
    out = {}
    for whl in wheels:
        with zipfile.ZipFile(whl) as z:
            for name in sorted(z.namelist()):
                parts = PurePosixPath(name).parts
                if not name.endswith(".py") or any(p in SKIP_DIRS or p.endswith(".dist-info") for p in parts):
                    continue
                out[name] = z.read(name)
    return out


def write_sources(files: dict[str, dict[str, bytes]], src: Path) -> dict:
    """Each domain's files under ``src/<domain>/`` (duplicates by content and non-UTF-8 files left out)."""
    seen: set[str] = set()
    stats = {}
    for domain, items in files.items():
        s = stats[domain] = {"files": 0, "bytes": 0, "duplicates": 0, "not_utf8": 0}
        for rel in sorted(items):
            if (text := _keep(rel, items[rel], seen, s)) is None:
                continue
            path = src / domain / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    return stats


def check(data_dir: Path, want: str = CONTENT_HASH) -> dict:
    """The prepared corpus at ``data_dir`` verified: every shard's SHA-256, then the content hash."""
    try:
        manifest = mf.read_manifest(data_dir)
        mf.verify_shards(data_dir, manifest, verify="hash")
    except DataError as e:
        raise CorpusError(str(e)) from None
    got = manifest.get("content_hash")
    if got != want:
        raise CorpusError(f"expected the corpus {data_dir} with content hash {want}; found {got}; fix: rebuild it "
                          f"with `python benchmarks/confirm_corpus.py build --out {data_dir}` (from the pinned "
                          "downloads; a build that differs is refused)")
    return manifest


def build(out: Path, cache: Path | None = None, workers: int | None = None, want: str = CONTENT_HASH) -> dict:
    if out.exists():
        raise CorpusError(f"expected no {out} (the build writes it whole); found it; fix: check it with `python "
                          f"benchmarks/confirm_corpus.py check {out}`, or move it away and build again")
    with tempfile.TemporaryDirectory(prefix="confirm-corpus-") as tmp:
        work = Path(tmp)
        deb, wheels = downloads(cache or work / "downloads")
        src = out.parent / f"{out.name}.src"
        if src.exists():
            shutil.rmtree(src)  # this builder's own sources folder, rewritten from the pinned downloads
        stats = write_sources({"prose": prose_files(deb, work), "code": code_files(wheels)}, src)
    (src / "corpus.json").write_text(json.dumps({"deb": DEB, "wheels": WHEELS, "val_fraction": VAL_FRACTION,
                                                 "domains": stats}, indent=1) + "\n")
    manifest = prepare("text", out, tokenizer="gpt2", paths=[f"prose={src / 'prose'}", f"code={src / 'code'}"],
                       val_fraction=VAL_FRACTION, workers=workers, progress=False)
    shutil.rmtree(src)
    got = manifest["content_hash"]
    print(json.dumps({"content_hash": got, "num_tokens": manifest["num_tokens"],
                      "num_documents": manifest["num_documents"], "sources": stats}, indent=1))
    if want != "PENDING" and got != want:
        raise CorpusError(f"expected the build to give content hash {want}; found {got} (kept at {out} to inspect); "
                          "fix: build with the same eslm tokenizer and pinned downloads, or find what changed")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download the pinned inputs and prepare the corpus")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--cache", type=Path, help="where the downloads are kept (default: a temporary folder)")
    b.add_argument("--workers", type=int)
    c = sub.add_parser("check", help="verify a prepared corpus against the pinned content hash")
    c.add_argument("dir", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            build(args.out, args.cache, args.workers)
        else:
            m = check(args.dir)
            print(f"corpus {args.dir}: content hash {m['content_hash']} as pinned; train tokens "
                  f"{sum(m['num_tokens']['train'].values())}, val tokens {sum(m['num_tokens']['val'].values())}")
    except CorpusError as e:
        print(f"confirm_corpus: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
