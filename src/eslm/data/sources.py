"""Text sources for ``eslm prepare`` (``SOURCE_NAMES``; docs/data.md, "Preparing a corpus"). A document's text is
read by :func:`document_text` inside the tokenisation workers, so reading runs in parallel with tokenisation."""

from __future__ import annotations

import ast
import glob
import hashlib
import json
import os
import pydoc_data.topics
import re
import sys
import sysconfig
import tokenize
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from eslm.errors import ConfigError, DataError

SOURCE_NAMES = ("stdlib", "text", "openwebtext", "slimpajama-6b")
SPLITS = ("train", "val")
STDLIB_DOMAINS = ("code", "docs", "reference")
# meta.redpajama_set_name -> our domain name (keyed by name on purpose: never rely on column order)
SLIMPAJAMA_SET_NAMES = {
    "RedPajamaArXiv": "arxiv",
    "RedPajamaBook": "book",
    "RedPajamaC4": "c4",
    "RedPajamaCommonCrawl": "cc",
    "RedPajamaGithub": "github",
    "RedPajamaStackExchange": "stackexchange",
    "RedPajamaWikipedia": "wikipedia",
}
SLIMPAJAMA_DOMAINS = tuple(SLIMPAJAMA_SET_NAMES.values())
HUB_IDS = {"openwebtext": "Skylion007/openwebtext", "slimpajama-6b": "DKYoon/SlimPajama-6B"}
# nanoGPT's data/openwebtext/prepare.py: train_test_split(test_size=0.0005, seed=2357, shuffle=True)
OWT_TEST_SIZE, OWT_SEED = 0.0005, 2357
DEFAULT_VAL_FRACTION = 0.05

_DOMAIN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib-dynload"}


@dataclass(frozen=True)
class Document:
    """One document. ``kind`` says how :func:`document_text` gets its text:
    "text" (``payload`` is the text), "utf8" (read file ``payload`` as strict UTF-8),
    "pyfile" (read Python source ``payload`` honouring its coding cookie), "docstrings" (docstrings of it).
    """

    domain: str
    split: str
    key: str
    kind: str
    payload: str


@dataclass
class Source:
    """A resolved source: its domains (in manifest order), a description for the manifest, and documents."""

    name: str
    domains: list[str]
    description: dict
    documents: Callable[[], Iterator[Document]]
    num_documents: int | None  # for the progress bar; None when unknown up front


# ----------------------------------------------------------------------------------------------- texts
def document_text(doc: Document) -> str:
    """The text of ``doc`` (runs in tokenisation workers). Non-UTF-8 text files raise a one-line DataError."""
    return TEXT_OF[doc.kind](doc.payload)


def _read_utf8(path: str) -> str:
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"expected UTF-8 text in {path}; found byte 0x{data[e.start]:02x} at offset {e.start} "
                        f"that is not UTF-8; fix: convert the file (e.g. iconv -t UTF-8) or leave it out") from None


def _read_python(path: str) -> str:
    try:
        with tokenize.open(path) as f:  # honours PEP 263 coding cookies
            return f.read()
    except (SyntaxError, UnicodeDecodeError):
        return ""  # an undecodable stdlib file is skipped (empty documents are dropped), not fatal


def extract_docstrings(source: str) -> str:
    """Module, class and function docstrings of ``source`` in source order, separated by blank lines."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    docs = []
    for node in [tree, *_definitions(tree)]:
        doc = ast.get_docstring(node, clean=True)
        if doc:
            docs.append(doc)
    return "\n\n".join(docs)


TEXT_OF: dict[str, Callable[[str], str]] = {"text": str, "utf8": _read_utf8, "pyfile": _read_python,
                                            "docstrings": lambda path: extract_docstrings(_read_python(path))}
_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _definitions(node: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef]:
    """Class and function definitions under ``node`` in source order, also inside if/try/with blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _DEFS):
            yield child
            yield from _definitions(child)
        elif isinstance(child, (ast.stmt, ast.excepthandler)):
            yield from _definitions(child)


# ---------------------------------------------------------------------------------------------- splits
def _unit_hash(key: str) -> float:
    """A stable number in [0, 1) from ``key`` (sha256, so identical across processes and Python versions)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little") / 2.0**64


def assign_splits(items: list[tuple[str, str]], val_fraction: float) -> dict[str, str]:
    """Map each (domain, key) item's key to "val" when its hash is below ``val_fraction``, else "train"; a domain
    with >= 2 documents but none in val gets its lowest-hash document moved there. A module's code and docstrings
    share one key, so a module is never in train as code and in val as docs."""
    split = {}
    by_domain: dict[str, list[str]] = {}
    for domain, key in items:
        split[key] = "val" if _unit_hash(key) < val_fraction else "train"
        by_domain.setdefault(domain, []).append(key)
    if val_fraction > 0:
        for keys in by_domain.values():
            if len(set(keys)) >= 2 and not any(split[k] == "val" for k in keys):
                split[min(keys, key=_unit_hash)] = "val"
    return split


# ---------------------------------------------------------------------------------------------- stdlib
def _walk(root: str, skip_dir: Callable[[str], bool], keep: Callable[[str], bool]) -> list[tuple[str, str]]:
    """(path relative to ``root`` with '/', path) of the files under ``root`` that ``keep`` names, in sorted order,
    not descending into directories ``skip_dir`` names."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not skip_dir(d))
        paths = [os.path.join(dirpath, f) for f in sorted(filenames) if keep(f)]
        out += [(os.path.relpath(p, root).replace(os.sep, "/"), p) for p in paths]
    return out


def stdlib_python_files(root: str | None = None) -> list[tuple[str, str]]:
    """(relative path, absolute path) of the stdlib's .py files, test packages and site-packages excluded."""
    return _walk(root or sysconfig.get_paths()["stdlib"], lambda d: d in _STDLIB_SKIP_DIRS,
                 lambda f: f.endswith(".py") and not f.startswith("test_"))


def python_docs_sources() -> list[tuple[str, str]]:
    """(relative path, path) of installed Python documentation sources (Sphinx ``_sources``), if any."""
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    candidates = [Path(sys.prefix) / "share" / "doc", Path("/usr/share/doc")]
    found = []
    for base in candidates:
        for doc_dir in sorted(base.glob(f"python{ver}*")) + sorted(base.glob(f"python{sys.version_info[0]}-doc*")):
            for path in sorted(doc_dir.rglob("_sources/**/*.txt")):
                found.append((path.relative_to(doc_dir).as_posix(), str(path)))
        if found:
            break
    return found


def stdlib_source(val_fraction: float, domains: list[str] | None = None) -> Source:
    domains = _pick_domains(list(STDLIB_DOMAINS), domains, "stdlib")
    files = stdlib_python_files()
    topics = sorted(pydoc_data.topics.topics.items())
    docs_src = python_docs_sources()
    # one key per module (shared by code and docs), one per reference item
    items = [("code", rel) for rel, _ in files] + [("reference", f"topic:{n}") for n, _ in topics] + \
            [("reference", f"pydocs:{rel}") for rel, _ in docs_src]
    split = assign_splits(items, val_fraction)

    def documents() -> Iterator[Document]:
        if "code" in domains:
            yield from (Document("code", split[rel], rel, "pyfile", p) for rel, p in files)
        if "docs" in domains:
            yield from (Document("docs", split[rel], rel, "docstrings", p) for rel, p in files)
        if "reference" in domains:
            yield from (Document("reference", split[f"topic:{n}"], f"topic:{n}", "text", t) for n, t in topics)
            yield from (Document("reference", split[f"pydocs:{r}"], f"pydocs:{r}", "utf8", p) for r, p in docs_src)

    n = len(files) * (("code" in domains) + ("docs" in domains)) + \
        (len(topics) + len(docs_src)) * ("reference" in domains)
    desc = {"name": "stdlib", "python": sys.version.split()[0], "stdlib_dir": sysconfig.get_paths()["stdlib"],
            "python_files": len(files), "pydoc_topics": len(topics), "python_docs_files": len(docs_src),
            "val_fraction": val_fraction, "split_rule": "sha256(module path or topic) < val_fraction"}
    return Source("stdlib", domains, desc, documents, n)


# ------------------------------------------------------------------------------------------------ text
def parse_named_paths(paths: Iterable[str], default_name: str) -> list[tuple[str, str]]:
    """``["a=x.txt", "y/"]`` -> ``[("a", "x.txt"), (default_name, "y/")]``. A name must be a plain word."""
    out = []
    for entry in paths:
        name, sep, path = entry.partition("=")
        if not sep or os.path.exists(entry):
            name, path = default_name, entry
        if not _DOMAIN_RE.match(name):
            raise ConfigError(f"expected NAME=PATH with NAME made of letters, digits, '_', '-', '.'; found {entry!r}; "
                              "fix: rename the domain")
        out.append((name, path))
    return out


def _expand_path(path: str) -> list[tuple[str, str]]:
    """(stable key, file) pairs for a file, a directory (recursive, hidden files skipped) or a glob."""
    if any(c in path for c in "*?["):
        files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        return [(os.path.relpath(p, _glob_root(path)).replace(os.sep, "/"), p) for p in files]
    if os.path.isdir(path):
        return _walk(path, lambda d: d.startswith("."), lambda f: not f.startswith("."))
    if os.path.isfile(path):
        return [(os.path.basename(path), path)]
    return []


def _glob_root(pattern: str) -> str:
    parts = []
    for part in Path(pattern).parts:
        if any(c in part for c in "*?["):
            break
        parts.append(part)
    return str(Path(*parts)) if parts else "."


def text_source(paths: list[str] | None, val_fraction: float, domains: list[str] | None = None) -> Source:
    if not paths:
        raise ConfigError("expected at least one path for source 'text'; found none; "
                          "fix: eslm prepare text --out DIR [DOMAIN=]PATH ...")
    named = parse_named_paths(paths, "text")
    all_domains = list(dict.fromkeys(name for name, _ in named))
    domains = _pick_domains(all_domains, domains, "text")
    files = []  # (domain, key, path)
    for name, path in named:
        expanded = _expand_path(path)
        if not expanded:
            raise DataError(f"expected a file, directory or glob with files; found nothing at {path!r}; "
                            "fix: check the path")
        files += [(name, f"{name}:{key}", p) for key, p in expanded if name in domains]
    split = assign_splits([(d, k) for d, k, _ in files], val_fraction)

    def documents() -> Iterator[Document]:
        for d, k, p in files:
            yield Document(d, split[k], k, "utf8", p)

    desc = {"name": "text", "paths": [f"{n}={os.path.abspath(p)}" for n, p in named], "files": len(files),
            "val_fraction": val_fraction, "split_rule": "sha256(domain:relative path) < val_fraction"}
    return Source("text", domains, desc, documents, len(files))


# ------------------------------------------------------------------------------------------------- hub
def load_hf_splits(source: str, data_files: dict[str, list[str]] | None = None, cache_dir: str | None = None):
    """The raw HF ``DatasetDict`` of a hub source, through the parquet route; ``data_files`` ({split: [local
    parquet/json files]}) replaces the download (the same code path)."""
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(f"source {source!r} needs the 'datasets' package; found it missing; "
                          "fix: pip install 'eslm[data]'") from e
    if data_files:
        suffixes = {Path(f).suffix for files in data_files.values() for f in files}
        builder = "parquet" if suffixes <= {".parquet"} else "json"
        return datasets.load_dataset(builder, data_files=data_files, cache_dir=cache_dir)
    if source == "openwebtext":
        # the repository's loading script is refused by datasets >= 4; the Hub's parquet conversion is not
        return datasets.load_dataset(HUB_IDS[source], revision="refs/convert/parquet", cache_dir=cache_dir)
    return datasets.load_dataset(HUB_IDS[source], cache_dir=cache_dir)


def _hub_data_files(paths: list[str] | None) -> dict[str, list[str]] | None:
    if not paths:
        return None
    data_files: dict[str, list[str]] = {}
    for split, path in parse_named_paths(paths, "train"):
        files = [p for _, p in _expand_path(path)]
        if not files:
            raise DataError(f"expected data files at {path!r}; found none; fix: check the path")
        data_files.setdefault(split, []).extend(files)
    return data_files


def _rows_source(name: str, domains: list[str], desc: dict, parts: dict, columns: list[str],
                 domain_of: Callable[[dict], str]) -> Source:
    """A hub source whose documents are the rows of ``parts`` ({split: dataset}), each in domain ``domain_of(row)``
    (rows of other domains than ``domains`` left out)."""
    def rows(ds) -> Iterator[dict]:
        for batch in ds.select_columns(columns).iter(batch_size=1000):
            yield from ({c: batch[c][i] for c in columns} for i in range(len(batch["text"])))

    def documents() -> Iterator[Document]:
        for split, ds in parts.items():
            for i, row in enumerate(rows(ds)):
                if (domain := domain_of(row)) in domains:
                    yield Document(domain, split, f"{split}:{i}", "text", row["text"])

    return Source(name, domains, desc, documents, sum(len(d) for d in parts.values()))


def openwebtext_source(paths: list[str] | None, cache_dir: str | None = None) -> Source:
    raw = load_hf_splits("openwebtext", _hub_data_files(paths), cache_dir)
    if "train" not in raw:
        raise DataError(f"expected a 'train' split in openwebtext; found {sorted(raw)}; fix: name the files train=PATH")
    split_ds = raw["train"].train_test_split(test_size=OWT_TEST_SIZE, seed=OWT_SEED, shuffle=True)
    desc = {"name": "openwebtext", "hub_id": HUB_IDS["openwebtext"], "local_files": _hub_data_files(paths),
            "split_rule": f"nanoGPT: train_test_split(test_size={OWT_TEST_SIZE}, seed={OWT_SEED}, shuffle=True)"}
    return _rows_source("openwebtext", ["openwebtext"], desc, {"train": split_ds["train"], "val": split_ds["test"]},
                        ["text"], lambda row: "openwebtext")


def _set_name(meta) -> str:
    if isinstance(meta, str):  # some copies store meta as a JSON string
        meta = json.loads(meta)
    name = meta.get("redpajama_set_name") if isinstance(meta, dict) else None
    if name not in SLIMPAJAMA_SET_NAMES:
        raise DataError(f"expected meta.redpajama_set_name in {sorted(SLIMPAJAMA_SET_NAMES)}; found {name!r}; "
                        "fix: check that the files are SlimPajama-6B")
    return SLIMPAJAMA_SET_NAMES[name]


def slimpajama_source(paths: list[str] | None, domains: list[str] | None = None,
                      cache_dir: str | None = None) -> Source:
    domains = _pick_domains(list(SLIMPAJAMA_DOMAINS), domains, "slimpajama-6b")
    raw = load_hf_splits("slimpajama-6b", _hub_data_files(paths), cache_dir)
    # as in the DoGE setup the paper adapted: the test split serves as validation
    missing = [s for s in ("train", "test") if s not in raw]
    if missing:
        raise DataError(f"expected splits train and test in slimpajama-6b; found {sorted(raw)}; "
                        "fix: pass train=PATH test=PATH")
    desc = {"name": "slimpajama-6b", "hub_id": HUB_IDS["slimpajama-6b"], "local_files": _hub_data_files(paths),
            "split_rule": "published splits; test used as val (DoGE setup)",
            "domain_rule": "meta.redpajama_set_name -> " + ", ".join(f"{k}:{v}" for k, v in SLIMPAJAMA_SET_NAMES.items())}
    return _rows_source("slimpajama-6b", domains, desc, {"train": raw["train"], "val": raw["test"]}, ["text", "meta"],
                        lambda row: _set_name(row["meta"]))


# --------------------------------------------------------------------------------------------- factory
def _pick_domains(available: list[str], wanted: list[str] | None, source: str) -> list[str]:
    if not wanted:
        return available
    unknown = [d for d in wanted if d not in available]
    if unknown:
        raise ConfigError(f"expected domains of {source!r} among {available}; found unknown {unknown}; "
                          "fix: pick from the listed domains")
    return [d for d in available if d in wanted]


def get_source(name: str, *, paths: list[str] | None = None, domains: list[str] | None = None,
               val_fraction: float | None = None, hf_cache_dir: str | None = None) -> Source:
    """Resolve source ``name``; ``val_fraction`` applies to stdlib/text (hub sources have fixed splits)."""
    if name not in SOURCE_NAMES:
        raise ConfigError(f"expected a source in {list(SOURCE_NAMES)}; found {name!r}; fix: use one of them")
    if name in ("stdlib", "text"):
        vf = DEFAULT_VAL_FRACTION if val_fraction is None else float(val_fraction)
        if not 0.0 <= vf < 1.0:
            raise ConfigError(f"expected 0 <= val_fraction < 1; found {vf}; fix: e.g. --val-fraction 0.02")
        if name == "stdlib":
            if paths:
                raise ConfigError(f"expected no paths for source 'stdlib'; found {list(paths)}; "
                                  "fix: use source 'text' for your own files")
            return stdlib_source(vf, domains)
        return text_source(paths, vf, domains)
    if val_fraction is not None:
        raise ConfigError(f"expected no val_fraction for {name!r} (it has a fixed published split); "
                          f"found {val_fraction}; fix: drop --val-fraction")
    if name == "openwebtext":
        _pick_domains(["openwebtext"], domains, name)
        return openwebtext_source(paths, hf_cache_dir)
    return slimpajama_source(paths, domains, hf_cache_dir)
