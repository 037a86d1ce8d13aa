"""open_dataset validation, the training sampler (mixture, windows, exact resume) and fixed val batches."""

import io
import json
import shutil
import warnings

import numpy as np
import pytest
import torch

from eslm.data.batch import Batch
from eslm.data.loader import HELD_OUT_FRACTION, TrainLoader, held_out_start, open_dataset, val_batches
from eslm.data.prepare import prepare
from eslm.errors import CheckpointError, ConfigError, DataError

# domain 'low' uses only bytes a..m, 'high' only n..z, 'tiny' is a single short file: a row's content
# reveals the domain it came from
LOW, HIGH = "abcdefghijklm", "nopqrstuvwxyz"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for name, letters, n_files in (("low", LOW, 30), ("high", HIGH, 30), ("tiny", "q", 1)):
        (root / name).mkdir()
        for i in range(n_files):
            size = 7 if name == "tiny" else int(rng.integers(200, 400))
            (root / name / f"{i:03d}.txt").write_text("".join(rng.choice(list(letters), size)))
    out = root / "prepared"
    prepare("text", out, tokenizer="byte", paths=[f"{d}={root / d}" for d in ("low", "high", "tiny")],
            val_fraction=0.2, workers=1, progress=False)
    return out


@pytest.fixture(scope="module")
def ds(data_dir):
    return open_dataset(data_dir)


def _loader(ds, **kw):
    args = dict(seq_len=16, micro_batch_size_seqs=8, weights={"low": 0.5, "high": 0.5}, seed=3)
    return TrainLoader(ds, **{**args, **kw})


def test_dataset_attributes_and_memmaps(ds, data_dir):
    m = json.loads((data_dir / "manifest.json").read_text())
    assert ds.domains == ["low", "high", "tiny"]
    assert (ds.tokenizer_name, ds.vocab_size, ds.eot_id, ds.dtype) == ("byte", 257, 256, "uint16")
    low = ds.tokens("train", "low")
    assert isinstance(low, np.memmap) and ds.tokens("train", "low") is low  # mapped once
    assert len(low) == ds.num_tokens("train", "low") == m["num_tokens"]["train"]["low"]
    assert set(np.unique(low).tolist()) <= {ord(c) for c in LOW} | {256}


def test_batches_are_windows_of_the_drawn_domain(ds):
    loader = _loader(ds)
    # token ids as characters: "is a contiguous window of the stream" becomes a substring test
    streams = {d: "".join(map(chr, ds.tokens("train", d).tolist())) for d in ("low", "high")}
    for _ in range(10):
        b = loader.next_batch()
        assert isinstance(b, Batch) and b.x.shape == b.y.shape == (8, 16) and b.domain.shape == (8,)
        assert b.x.dtype == b.y.dtype == b.domain.dtype == torch.int64
        assert torch.equal(b.x[:, 1:], b.y[:, :-1])  # y is x shifted inside one window
        for row in range(8):
            name = ds.domains[int(b.domain[row])]
            letters = {ord(c) for c in (LOW if name == "low" else HIGH)} | {256}
            assert set(b.x[row].tolist()) | set(b.y[row].tolist()) <= letters
            window = "".join(map(chr, b.x[row].tolist() + b.y[row, -1:].tolist()))
            assert window in streams[name]


def test_mixture_frequencies_and_zero_weight_never_drawn(ds):
    loader = _loader(ds, weights={"low": 0.8, "high": 0.2, "tiny": 0.0}, micro_batch_size_seqs=50)
    domains = torch.cat([loader.next_batch().domain for _ in range(80)])
    assert 2 not in domains.tolist()
    share_low = (domains == 0).float().mean().item()
    assert abs(share_low - 0.8) < 0.03  # 4000 rows: 5 sigma is about 0.03


def test_resume_is_exact_through_torch_save(ds):
    a = _loader(ds)
    for _ in range(5):
        a.next_batch()
    buf = io.BytesIO()
    torch.save({"loader": a.state_dict()}, buf)
    expected = [a.next_batch() for _ in range(5)]
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["loader"]
    b = _loader(ds)
    b.load_state_dict(state)
    for e, g in zip(expected, [b.next_batch() for _ in range(5)]):
        assert torch.equal(e.x, g.x) and torch.equal(e.y, g.y) and torch.equal(e.domain, g.domain)


def test_state_dict_is_plain_python(ds):
    def plain(v):
        if isinstance(v, dict):
            return all(isinstance(k, str) and plain(x) for k, x in v.items())
        if isinstance(v, list):
            return all(plain(x) for x in v)
        return type(v) in (int, float, str, bool) or v is None

    assert plain(_loader(ds).state_dict())


def test_seeds_and_ranks_draw_different_windows(ds):
    first = _loader(ds).next_batch().x
    assert torch.equal(first, _loader(ds).next_batch().x)
    assert not torch.equal(first, _loader(ds, seed=4).next_batch().x)
    assert not torch.equal(first, _loader(ds, rank=1, world_size=2).next_batch().x)


def test_resume_refuses_other_settings(ds):
    state = _loader(ds).state_dict()
    with pytest.raises(CheckpointError, match="seq_len") as e:
        _loader(ds, seq_len=8).load_state_dict(state)
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="mixture"):
        _loader(ds, weights={"low": 0.6, "high": 0.4}).load_state_dict(state)


def test_a_resume_on_another_world_size_warns_with_the_way_back(ds):
    state = _loader(ds).state_dict()
    with pytest.warns(UserWarning, match=r"batches continue but differ .*resume on as many processes \(torchrun "
                                         r"--nproc_per_node 1\)"):
        _loader(ds, rank=0, world_size=2).load_state_dict(state)


def region_of(region: np.ndarray, x: torch.Tensor) -> bool:
    """Whether the window ``x`` plus its next token could lie in ``region``: x occurs there, not at its end."""
    hay, needle = region[:-1].tobytes(), x.numpy().astype(region.dtype).tobytes()
    at = hay.find(needle)
    while at >= 0 and at % region.dtype.itemsize:
        at = hay.find(needle, at + 1)
    return at >= 0


def test_held_out_tail_starts_at_a_document_and_the_parts_partition_the_stream(ds):
    """The held-out tail (GREATS' validation data) holds >= HELD_OUT_FRACTION of a domain's training tokens from a
    document's start; "fit" windows lie before it, "held_out" windows in it; the whole stream is unchanged."""
    for d in ("low", "high"):
        s = np.asarray(ds.tokens("train", d))
        cut = held_out_start(s, ds.eot_id)
        assert s[cut - 1] == ds.eot_id and len(s) - cut >= HELD_OUT_FRACTION * len(s)
        assert not (s[cut:int(len(s) * (1 - HELD_OUT_FRACTION))] == ds.eot_id).any()  # the last boundary before
    one_document = np.arange(100) % 7
    assert held_out_start(one_document, eot_id=99) == 95  # no boundary: the token cut (the parts share no token)
    weights = {"low": 1.0, "high": 0.0}
    s = np.asarray(ds.tokens("train", "low"))
    cut = held_out_start(s, ds.eot_id)
    for part, lo, hi in (("fit", 0, cut), ("held_out", cut, len(s)), ("all", 0, len(s))):
        rows = _loader(ds, weights=weights, part=part).next_batch()
        region = s[lo:hi].tobytes()
        for x, y in zip(rows.x, rows.y):
            window = np.concatenate([x.numpy(), y.numpy()[-1:]]).astype(s.dtype).tobytes()
            assert region.find(window) >= 0, part
    assert torch.equal(_loader(ds).next_batch().x, _loader(ds, part="all").next_batch().x)
    # "fit" keeps the "all" loader's windows that end before the tail (paired seeds) and draws the others again
    kept = moved = 0
    for i in range(20):
        a, f = _loader(ds, weights=weights).draw(i), _loader(ds, weights=weights, part="fit").draw(i)
        for xa, xf in zip(a.x, f.x):
            inside = region_of(s[:cut], xa)
            kept, moved = kept + inside, moved + (not inside)
            assert torch.equal(xa, xf) == inside
    assert kept > 0 and moved > 0
    with pytest.raises(CheckpointError, match="part"):
        _loader(ds, part="fit").load_state_dict(_loader(ds).state_dict())
    old = {k: v for k, v in _loader(ds).state_dict().items() if k != "part"}  # a checkpoint from before parts
    with pytest.raises(CheckpointError, match="part=None"):  # eslm 0.x reads only its own format
        _loader(ds).load_state_dict(old)


def test_short_domain_with_positive_weight_is_an_error(ds):
    assert ds.num_tokens("train", "tiny") < 17
    with pytest.raises(DataError, match=r"'tiny'.*found \d+.*weight 0") as e:
        _loader(ds, weights={"low": 0.5, "high": 0.4, "tiny": 0.1})
    assert "\n" not in str(e.value)


def test_val_batches_fixed_capped_and_non_overlapping(ds):
    kw = dict(seq_len=16, batch_size_seqs=4, tokens_per_domain=160)
    with pytest.warns(UserWarning, match=r"'tiny'.*left out of validation; to evaluate it, .*--val-fraction"):
        v1 = val_batches(ds, **kw)
    with pytest.warns(UserWarning):
        v2 = val_batches(ds, **kw)
    assert set(v1) == {"low", "high"}  # tiny has no val window: left out, with a warning
    for d in v1:
        assert [b.x.tolist() for b in v1[d]] == [b.x.tolist() for b in v2[d]]
        assert sum(b.y.numel() for b in v1[d]) == 160  # 10 windows of 16 targets
        assert all(b.x.shape[0] <= 4 and (b.domain == ds.domains.index(d)).all() for b in v1[d])
    assert not torch.equal(v1["low"][0].x, val_batches(ds, seed=1, **kw)["low"][0].x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        big = val_batches(ds, seq_len=16, batch_size_seqs=10**4, tokens_per_domain=10**6)
    # capped at what the domain has, without a warning (nothing to act on); only 'tiny' (left out) warns
    assert [str(w.message) for w in caught if "tiny" not in str(w.message)] == []
    low = big["low"][0]
    n_val = ds.num_tokens("val", "low")
    assert low.y.numel() == ((n_val - 1) // 16) * 16
    # non-overlapping: the targets tile the val stream once
    stream = torch.from_numpy(ds.tokens("val", "low").astype(np.int64))
    assert torch.equal(low.y.reshape(-1), stream[1:1 + low.y.numel()])


# --------------------------------------------------------------------------------------------- bad input
@pytest.fixture
def copy_dir(data_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(data_dir, dst)
    return dst


def _one_line_data_error(path, match):
    with pytest.raises(DataError, match=match) as e:
        open_dataset(path)
    assert "\n" not in str(e.value) and "fix:" in str(e.value)


def test_missing_directory(tmp_path):
    _one_line_data_error(tmp_path / "nope", "no such directory.*eslm prepare")


def test_missing_manifest(copy_dir):
    (copy_dir / "manifest.json").unlink()
    _one_line_data_error(copy_dir, "without a manifest")


def test_bad_manifest_json(copy_dir):
    (copy_dir / "manifest.json").write_text("{not json")
    _one_line_data_error(copy_dir, "valid JSON")


def test_truncated_shard(copy_dir):
    path = copy_dir / "train-low.bin"
    path.write_bytes(path.read_bytes()[:-2])
    _one_line_data_error(copy_dir, "train-low.bin.*truncated")


def test_missing_shard(copy_dir):
    (copy_dir / "val-high.bin").unlink()
    _one_line_data_error(copy_dir, "val-high.bin.*missing")


def test_corrupt_shard_same_size(copy_dir):
    path = copy_dir / "train-high.bin"
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    _one_line_data_error(copy_dir, "train-high.bin.*corrupt")
    assert open_dataset(copy_dir, verify="size").num_tokens("train", "high") > 0  # sizes alone still pass


def test_check_vocab(ds):
    ds.check_vocab(257)
    ds.check_vocab(50304)  # a larger (padded) model vocabulary is fine
    with pytest.raises(DataError, match="vocab_size >= 257.*found 256") as e:
        ds.check_vocab(256)
    assert "\n" not in str(e.value)


def test_unknown_domain_or_split(ds):
    with pytest.raises(DataError, match="domain in"):
        ds.tokens("train", "poetry")
    with pytest.raises(ConfigError, match="unknown"):
        _loader(ds, weights={"low": 0.5, "poetry": 0.5})
