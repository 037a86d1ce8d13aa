"""The confirmatory GPU study's window: its corpus (benchmarks/confirm_corpus.py) is refused, in one line, when it
differs from the pinned content hash (its build from the pinned downloads needs the network: run it by hand, see
its docstring)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import confirm_corpus  # noqa: E402

from eslm.data import manifest as mf  # noqa: E402


def test_check_accepts_the_pinned_hash_and_refuses_another_in_one_line(tiny_data, capsys):
    want = mf.read_manifest(tiny_data)["content_hash"]
    assert confirm_corpus.check(tiny_data, want)["content_hash"] == want
    assert confirm_corpus.main(["check", str(tiny_data)]) == 1  # the tiny corpus is not the pinned one
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and confirm_corpus.CONTENT_HASH in err and want in err


def test_check_refuses_a_changed_shard(tiny_data, tmp_path, capsys):
    import shutil

    copy = tmp_path / "c"
    shutil.copytree(tiny_data, copy)
    shard = next(copy.glob("train-*.bin"))
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    want = mf.read_manifest(tiny_data)["content_hash"]
    try:
        confirm_corpus.check(copy, want)
    except confirm_corpus.CorpusError as e:
        assert "sha256" in str(e) and "\n" not in str(e)
    else:
        raise AssertionError("a changed shard was accepted")


def test_the_pins_are_complete():
    assert len(confirm_corpus.CONTENT_HASH) == 64 and len(confirm_corpus.DEB[2]) == 64
    assert all(len(sha) == 64 for _, _, sha in confirm_corpus.WHEELS)
