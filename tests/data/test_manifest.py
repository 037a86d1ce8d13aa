"""``eslm.data.manifest``: the schema checks and the shard checks, each failure one DataError line."""

import json

import numpy as np
import pytest

from eslm.data import manifest as mf
from eslm.errors import DataError


def _prepared(tmp_path, tokens=(1, 2, 3, 0)):
    """A one-domain prepared directory written by hand: train and val shards + a valid manifest."""
    files = []
    for split in mf.SPLITS:
        name = mf.shard_name(split, "prose")
        np.asarray(tokens, dtype="<u2").tofile(tmp_path / name)
        files.append({"path": name, "split": split, "domain": "prose", "num_tokens": len(tokens),
                      "num_bytes": 2 * len(tokens), "sha256": mf.sha256_file(tmp_path / name)})
    m = {"format": mf.FORMAT, "version": mf.VERSION, "tokenizer": {"name": "byte", "vocab_size": 257, "eot_id": 0},
         "dtype": "uint16", "domains": ["prose"], "splits": list(mf.SPLITS), "files": files,
         "num_tokens": {s: {"prose": len(tokens)} for s in mf.SPLITS}, "content_hash": mf.content_hash(files)}
    mf.write_manifest(tmp_path, m)
    return m


def test_dtype_boundary():
    assert mf.dtype_for_vocab(65536) == "uint16" and mf.dtype_for_vocab(65537) == "uint32"


def test_round_trip_and_content_hash_is_order_free(tmp_path):
    m = _prepared(tmp_path)
    assert mf.read_manifest(tmp_path) == m
    assert not (tmp_path / "manifest.json.tmp").exists()  # written atomically
    assert mf.content_hash(list(reversed(m["files"]))) == m["content_hash"]
    mf.verify_shards(tmp_path, m, verify="hash")


@pytest.mark.parametrize("change, match", [
    (lambda m: m.update(format="other"), "manifest"),
    (lambda m: m.pop("dtype"), "missing"),
    (lambda m: m.update(version=99), "version"),
    (lambda m: m.update(dtype="int8"), "dtype"),
    (lambda m: m.update(tokenizer={"name": "byte"}), "tokenizer"),
    (lambda m: m.update(dtype="uint16", tokenizer={"name": "x", "vocab_size": 70000, "eot_id": 0}), "uint32"),
    (lambda m: m["files"].append(dict(m["files"][0])), "one file per"),
])
def test_schema_problems_are_one_line_data_errors(tmp_path, change, match):
    m = _prepared(tmp_path)
    change(m)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match=match) as e:
        mf.read_manifest(tmp_path)
    assert "\n" not in str(e.value) and "eslm prepare" in str(e.value)


def test_missing_directory_manifest_and_bad_json(tmp_path):
    with pytest.raises(DataError, match="no such directory"):
        mf.read_manifest(tmp_path / "nope")
    with pytest.raises(DataError, match="without a manifest"):
        mf.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="valid JSON"):
        mf.read_manifest(tmp_path)


def test_shard_checks(tmp_path):
    m = _prepared(tmp_path)
    shard = tmp_path / m["files"][0]["path"]
    np.asarray([4, 5, 6, 0], dtype="<u2").tofile(shard)  # same size, other content
    mf.verify_shards(tmp_path, m, verify="size")  # sizes alone cannot see it
    with pytest.raises(DataError, match="corrupt"):
        mf.verify_shards(tmp_path, m, verify="auto")  # small: hashed
    np.asarray([4, 5], dtype="<u2").tofile(shard)
    with pytest.raises(DataError, match="truncated"):
        mf.verify_shards(tmp_path, m, verify="size")
    shard.unlink()
    with pytest.raises(DataError, match="missing"):
        mf.verify_shards(tmp_path, m, verify="size")
