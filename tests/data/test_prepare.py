"""eslm prepare: sources, shards, manifest, splits, hub sources on local fixtures, bad input."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import hashlib

import numpy as np
import pytest

from eslm.cli import main as cli_main
from eslm.data import sources
from eslm.data.prepare import ensure_prepared, prepare
from eslm.data.tokenizers import get_tokenizer
from eslm.errors import ConfigError, DataError


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _shard(out, manifest, split, domain):
    f = next(f for f in manifest["files"] if f["split"] == split and f["domain"] == domain)
    return np.fromfile(out / f["path"], dtype=np.dtype(manifest["dtype"]).newbyteorder("<"))


def _docs_of(stream, eot):
    """Split a token stream at eot into documents; asserts it ends with eot."""
    assert stream.size == 0 or stream[-1] == eot
    cuts = np.flatnonzero(stream == eot)
    return [stream[a + 1:b] for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]


@pytest.fixture
def corpus(tmp_path):
    """Two domains: 'poems' (a directory of 12 files) and 'notes' (a glob of 9 files)."""
    for i in range(12):
        _write(tmp_path / "src" / "poems" / f"p{i:02d}.txt", f"poem {i}: roses — ñ {'la ' * i}\n")
    for i in range(9):
        _write(tmp_path / "src" / "notes" / f"n{i}.md", f"note {i} <|endoftext|> {'x' * i}")
    _write(tmp_path / "src" / "notes" / "skip.bin", "not matched by the glob")
    return tmp_path / "src"


def test_text_source_byte_shards_manifest_and_eot(corpus, tmp_path):
    out = tmp_path / "out"
    m = prepare("text", out, tokenizer="byte", paths=[f"poems={corpus / 'poems'}", f"notes={corpus / 'notes' / '*.md'}"],
                val_fraction=0.3, workers=1, progress=False)
    assert m["domains"] == ["poems", "notes"] and m["dtype"] == "uint16"
    assert m["tokenizer"] == {"name": "byte", "vocab_size": 257, "eot_id": 256}
    texts = {"poems": sorted(p.read_text() for p in (corpus / "poems").iterdir()),
             "notes": sorted(p.read_text() for p in (corpus / "notes").glob("*.md"))}
    tok = get_tokenizer("byte")
    for domain, expected in texts.items():
        got = []
        for split in ("train", "val"):
            stream = _shard(out, m, split, domain)
            assert stream.size == m["num_tokens"][split][domain]
            docs = _docs_of(stream, 256)  # eot after EVERY document
            assert len(docs) == m["num_documents"][split][domain]
            got += [tok.decode(d.tolist()) for d in docs]
        assert sorted(got) == expected  # every document exactly once, across the two splits
        assert m["num_documents"]["val"][domain] >= 1 and m["num_documents"]["train"][domain] >= 1
    for f in m["files"]:
        data = (out / f["path"]).read_bytes()
        assert len(data) == f["num_bytes"] and hashlib.sha256(data).hexdigest() == f["sha256"]
    assert json.loads((out / "manifest.json").read_text())["content_hash"] == m["content_hash"]
    assert m["source"]["name"] == "text" and m["val_fraction"] == 0.3


def test_gpt2_shards_are_uint16_little_endian_with_eot(tmp_path):
    _write(tmp_path / "a.txt", "Hello world")
    m = prepare("text", tmp_path / "out", paths=[str(tmp_path / "a.txt")], val_fraction=0.0, workers=1,
                progress=False)
    raw = (tmp_path / "out" / "train-text.bin").read_bytes()
    assert m["dtype"] == "uint16" and m["tokenizer"]["eot_id"] == 50256
    assert list(np.frombuffer(raw, dtype="<u2")) == [15496, 995, 50256]


def test_split_is_deterministic_per_document(corpus, tmp_path):
    """Adding documents does not move existing ones between splits, and reruns agree byte for byte."""
    paths = [f"poems={corpus / 'poems'}"]
    m1 = prepare("text", tmp_path / "o1", tokenizer="byte", paths=paths, val_fraction=0.3, workers=1, progress=False)
    m2 = prepare("text", tmp_path / "o2", tokenizer="byte", paths=paths, val_fraction=0.3, workers=1, progress=False)
    assert m1["content_hash"] == m2["content_hash"]
    keys = [f"poems:p{i:02d}.txt" for i in range(12)]
    before = sources.assign_splits([("poems", k) for k in keys], 0.3)
    after = sources.assign_splits([("poems", k) for k in keys + ["poems:new.txt"]], 0.3)
    assert all(before[k] == after[k] for k in keys)


def test_workers_do_not_change_output(corpus, tmp_path):
    paths = [f"poems={corpus / 'poems'}", f"notes={corpus / 'notes' / '*.md'}"]
    kw = dict(tokenizer="gpt2", paths=paths, val_fraction=0.3, progress=False)
    m1 = prepare("text", tmp_path / "w1", workers=1, **kw)
    m2 = prepare("text", tmp_path / "w2", workers=2, **kw)
    assert m1["content_hash"] == m2["content_hash"]


def test_stdlib_sources_exclude_tests_and_extract_docstrings():
    files = [rel for rel, _ in sources.stdlib_python_files()]
    assert "os.py" in files and "json/decoder.py" in files
    assert not any(part in ("test", "tests", "idle_test", "site-packages")
                   for rel in files for part in rel.split("/")[:-1])
    assert not any(rel.split("/")[-1].startswith("test_") for rel in files)
    doc = sources.extract_docstrings('"""Mod."""\nclass A:\n    """Cls."""\n    def f(self):\n        """Fn."""\n')
    assert doc == "Mod.\n\nCls.\n\nFn."


def test_stdlib_reference_domain_prepares(tmp_path):
    m = prepare("stdlib", tmp_path / "ref", tokenizer="byte", domains=["reference"], workers=1, progress=False)
    assert m["domains"] == ["reference"]
    assert m["num_tokens"]["train"]["reference"] > 100_000 and m["num_tokens"]["val"]["reference"] > 0


def test_ensure_prepared_reuses_directory(tmp_path, monkeypatch):
    _write(tmp_path / "a.txt", "x")
    monkeypatch.setenv("ESLM_DATA_DIR", str(tmp_path / "root"))
    calls = []
    import eslm.data.prepare as P

    real = P.prepare
    monkeypatch.setattr(P, "prepare", lambda *a, **k: calls.append(a) or real(*a, **k))
    d1 = ensure_prepared("stdlib", "byte", domains=["reference"])
    d2 = ensure_prepared("stdlib", "byte")
    assert d1 == d2 == tmp_path / "root" / "stdlib-byte" and len(calls) == 1
    assert not [p for p in (tmp_path / "root").iterdir() if p.name.startswith(".")]  # no temp dir left


# ----------------------------------------------------------------------------------------- hub sources
SETS = {"arxiv": "RedPajamaArXiv", "book": "RedPajamaBook", "c4": "RedPajamaC4", "cc": "RedPajamaCommonCrawl",
        "github": "RedPajamaGithub", "stackexchange": "RedPajamaStackExchange", "wikipedia": "RedPajamaWikipedia"}


def _slimpajama_fixture(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    paths = []
    for split, n in (("train", 21), ("test", 14)):
        names = list(SETS.values())
        rows = [{"text": f"{split} doc {i} from {names[i % 7]}", "meta": {"redpajama_set_name": names[i % 7]}}
                for i in range(n)]
        path = tmp_path / f"{split}-00000-of-00001.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        paths.append(f"{split}={path}")
    return paths


def test_slimpajama_domains_by_set_name_and_test_as_val(tmp_path):
    pytest.importorskip("datasets")
    paths = _slimpajama_fixture(tmp_path)
    out = tmp_path / "sp"
    m = prepare("slimpajama-6b", out, tokenizer="byte", paths=paths, workers=1, progress=False,
                hf_cache_dir=str(tmp_path / "hf"))
    assert m["domains"] == sorted(SETS)
    tok = get_tokenizer("byte")
    for domain, set_name in SETS.items():
        for split, src_split, n in (("train", "train", 3), ("val", "test", 2)):
            docs = [tok.decode(d.tolist()) for d in _docs_of(_shard(out, m, split, domain), 256)]
            assert len(docs) == n and all(d.startswith(src_split) and d.endswith(set_name) for d in docs)


def test_slimpajama_unknown_set_name_is_one_line(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("datasets")
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist([{"text": "t", "meta": {"redpajama_set_name": "RedPajamaFoo"}}]),
                       tmp_path / f"{split}.parquet")
    with pytest.raises(DataError, match="RedPajamaFoo") as e:
        prepare("slimpajama-6b", tmp_path / "o", tokenizer="byte", workers=1, progress=False,
                paths=[f"train={tmp_path / 'train.parquet'}", f"test={tmp_path / 'test.parquet'}"],
                hf_cache_dir=str(tmp_path / "hf"))
    assert "\n" not in str(e.value)


def test_openwebtext_uses_nanogpt_split(tmp_path):
    pytest.importorskip("datasets")
    n = 4000
    with open(tmp_path / "owt.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"web page {i}"}) + "\n")
    out = tmp_path / "owt"
    m = prepare("openwebtext", out, tokenizer="byte", paths=[f"train={tmp_path / 'owt.jsonl'}"], workers=1,
                progress=False, hf_cache_dir=str(tmp_path / "hf"))
    # independent reference for datasets' train_test_split(test_size=0.0005, seed=2357, shuffle=True):
    # permutation from numpy's default_rng(seed); the first ceil(0.0005 n) rows are the test (val) split
    perm = np.random.default_rng(2357).permutation(n)
    n_val = int(np.ceil(0.0005 * n))
    tok = get_tokenizer("byte")
    val = [tok.decode(d.tolist()) for d in _docs_of(_shard(out, m, "val", "openwebtext"), 256)]
    train = [tok.decode(d.tolist()) for d in _docs_of(_shard(out, m, "train", "openwebtext"), 256)]
    assert val == [f"web page {i}" for i in perm[:n_val]]
    assert train[:5] == [f"web page {i}" for i in perm[n_val:n_val + 5]] and len(train) == n - n_val


# --------------------------------------------------------------------------------------------- bad input
def test_non_utf8_text_file_is_one_line(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 latin-1")
    with pytest.raises(DataError, match=r"UTF-8.*bad\.txt.*0xe9.*offset 3") as e:
        prepare("text", tmp_path / "o", tokenizer="byte", paths=[str(tmp_path / "bad.txt")], workers=1,
                progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "o").exists()  # nothing half-written left behind


def test_non_utf8_error_crosses_worker_processes(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(DataError, match="UTF-8"):
        prepare("text", tmp_path / "o", tokenizer="byte", paths=[str(tmp_path / "bad.txt")], workers=2,
                progress=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(source="wikipedia"), "expected a source in .*stdlib.*text.*openwebtext.*slimpajama-6b"),
    (dict(source="stdlib", domains=["code", "poetry"]), "unknown \\['poetry'\\]"),
    (dict(source="stdlib", val_fraction=1.5), "val_fraction"),
    (dict(source="text"), "at least one path"),
    (dict(source="text", paths=["/nonexistent/dir/*.txt"]), "found nothing"),
    (dict(source="stdlib", tokenizer="llama"), "tokenizer name"),
])
def test_bad_arguments_are_one_line(tmp_path, kwargs, match):
    source = kwargs.pop("source")
    with pytest.raises((ConfigError, DataError), match=match) as e:
        prepare(source, tmp_path / "o", progress=False, workers=1, **kwargs)
    assert "\n" not in str(e.value)


def test_existing_output_needs_force(tmp_path):
    _write(tmp_path / "a.txt", "abc")
    kw = dict(tokenizer="byte", paths=[str(tmp_path / "a.txt")], workers=1, progress=False)
    prepare("text", tmp_path / "o", **kw)
    with pytest.raises(ConfigError, match="--force"):
        prepare("text", tmp_path / "o", **kw)
    _write(tmp_path / "a.txt", "abcd")
    assert prepare("text", tmp_path / "o", overwrite=True, **kw)["num_tokens"]["train"]["text"] == 5


def test_cli_prepare_prints_counts_and_errors(tmp_path, capsys):
    _write(tmp_path / "d" / "a.txt", "hello")
    rc = cli_main(["prepare", "text", f"mine={tmp_path / 'd'}", "--out", str(tmp_path / "o"), "--tokenizer", "byte",
                   "--workers", "1", "--no-progress"])
    assert rc == 0 and "mine" in capsys.readouterr().out
    rc = cli_main(["prepare", "nosuchsource", "--out", str(tmp_path / "o2"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "nosuchsource" in err


# ---------------------------------------------------------------- issue 24 items 2 and 12


def _tree(d):
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else None for p in sorted(d.rglob("*"))}


def test_force_never_deletes_a_directory_eslm_did_not_prepare(tmp_path, capsys):
    _write(tmp_path / "a.txt", "abc")
    user = tmp_path / "project"
    _write(user / "manifest.json", '{"name": "my web app"}')  # a manifest.json of another program
    _write(user / "src" / "main.py", "print('hi')")
    before = _tree(user)
    code = cli_main(["prepare", "text", str(tmp_path / "a.txt"), "--out", str(user), "--tokenizer", "byte",
                     "--no-progress", "--workers", "1", "--force"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "holds files eslm did not write" in err
    assert _tree(user) == before


def test_force_replaces_a_prepared_directory_only_when_it_holds_nothing_else(tmp_path):
    _write(tmp_path / "a.txt", "abc")
    kw = dict(tokenizer="byte", paths=[str(tmp_path / "a.txt")], workers=1, progress=False)
    out = tmp_path / "o"
    assert len(prepare("text", out, **kw)["id"]) == 32
    _write(out / "NOTES.md", "mine")
    with pytest.raises(ConfigError, match="'NOTES.md'"):
        prepare("text", out, overwrite=True, **kw)
    assert (out / "NOTES.md").read_text() == "mine" and (out / "manifest.json").is_file()
    (out / "NOTES.md").unlink()
    _write(tmp_path / "a.txt", "abcd")
    assert prepare("text", out, overwrite=True, **kw)["num_tokens"]["train"]["text"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "o"]  # no temporary or old copy left


def test_a_killed_prepares_temporary_directory_is_removed_next_time(tmp_path):
    _write(tmp_path / "a.txt", "abc")
    stale = tmp_path / ".o.tmp.4242"  # what a SIGKILLed prepare leaves (eslm's marker inside)
    stale.mkdir()
    (stale / ".eslm-output").write_text("")
    (stale / "train-text.bin").write_bytes(b"\0" * 100)
    foreign = tmp_path / ".o.tmp.99"  # the same pattern without the marker: not provably eslm's
    foreign.mkdir()
    prepare("text", tmp_path / "o", tokenizer="byte", paths=[str(tmp_path / "a.txt")], workers=1, progress=False)
    assert not stale.exists() and foreign.exists()


def test_a_corpus_of_zero_tokens_is_refused(tmp_path):
    _write(tmp_path / "empty" / "a.txt", "")
    _write(tmp_path / "empty" / "b.txt", "")
    with pytest.raises(DataError, match="0 tokens"):
        prepare("text", tmp_path / "o", tokenizer="byte", paths=[str(tmp_path / "empty")], workers=1, progress=False)
    assert not (tmp_path / "o").exists()
