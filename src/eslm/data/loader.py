"""Reading prepared data: the Dataset (validated, memory-mapped once), the training sampler, validation sets.

Batch ``i`` of rank ``r`` is drawn from a generator seeded with ``(seed, r, i)``: the batch counter is the
loader's only state, so a resumed loader yields the original batches. docs/data.md ("Training loader",
"Validation") describes the windows, the held-out part of the training split and the validation sets.
"""

from __future__ import annotations

import os
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from eslm.data import manifest as mf
from eslm.data.batch import Batch
from eslm.data.mixture import resolve_weights
from eslm.errors import CheckpointError, DataError

STATE_VERSION = 1
HELD_OUT_FRACTION = 0.05  # of each domain's training tokens (held_out_start)


class Dataset:
    """A prepared data directory (build it with :func:`open_dataset`); ``Batch.domain`` indexes ``domains``."""

    def __init__(self, path: Path, manifest: dict):
        self.path = path
        self.manifest = manifest
        self.domains: list[str] = list(manifest["domains"])
        tok = manifest["tokenizer"]
        self.tokenizer_name: str = tok["name"]
        self.vocab_size: int = int(tok["vocab_size"])
        self.eot_id: int = int(tok["eot_id"])
        self.dtype: str = manifest["dtype"]
        self.content_hash: str = manifest.get("content_hash", "")
        self._files = {(f["split"], f["domain"]): f for f in manifest["files"]}
        self._maps: dict[tuple[str, str], np.ndarray] = {}

    def num_tokens(self, split: str, domain: str) -> int:
        return int(self._file(split, domain)["num_tokens"])

    def token_counts(self, split: str = "train") -> dict[str, int]:
        """{domain: tokens} of ``split``, e.g. for the "natural" mixture."""
        return {d: self.num_tokens(split, d) for d in self.domains}

    def tokens(self, split: str, domain: str) -> np.ndarray:
        """The read-only token stream of (split, domain): a 1-D ``np.memmap`` of ``dtype``, mapped once."""
        key = (split, domain)
        if key not in self._maps:
            f = self._file(split, domain)
            dtype = np.dtype(self.dtype).newbyteorder("<")
            if int(f["num_tokens"]) == 0:
                self._maps[key] = np.empty(0, dtype=dtype)  # mmap cannot map an empty file
            else:
                self._maps[key] = np.memmap(self.path / f["path"], dtype=dtype, mode="r")
        return self._maps[key]

    def check_vocab(self, model_vocab_size: int) -> None:
        """DataError unless a model with ``model_vocab_size`` outputs can embed every id of this data (a larger
        vocabulary is fine: GPT-2 pads 50257 to 50304 for speed)."""
        if int(model_vocab_size) < self.vocab_size:
            raise DataError(f"expected a model vocab_size >= {self.vocab_size} ({self.tokenizer_name} data in "
                            f"{self.path}); found {model_vocab_size}; fix: set model.vocab_size >= the data's, or "
                            "prepare the data with the model's tokenizer")

    def _file(self, split: str, domain: str) -> dict:
        if (split, domain) not in self._files:
            raise DataError(f"expected split in {list(mf.SPLITS)} and domain in {self.domains}; found "
                            f"({split!r}, {domain!r}) in {self.path}; fix: use one of the listed names")
        return self._files[(split, domain)]

    def __getstate__(self) -> dict:
        # pickling (e.g. to worker processes) must not copy the mapped arrays; they are re-mapped on use
        return {**self.__dict__, "_maps": {}}


def open_dataset(data_dir: str | os.PathLike, *, verify: str = "auto") -> Dataset:
    """Open and validate a prepared directory (manifest schema, shard presence and sizes, token ids below the
    vocabulary size unless ``verify`` is "size", and content hashes when ``verify`` is "hash" or "auto" with small
    data). Problems raise one-line DataErrors."""
    path = Path(data_dir)
    manifest = mf.read_manifest(path)
    mf.verify_shards(path, manifest, verify=verify)
    if verify != "size":  # "size" asks for sizes only; "auto" range-checks the ids even where it skips the hash
        _range_checked(path, manifest)
    return Dataset(path, manifest)


_RANGE_CHECKED: set = set()


def _range_checked(path: Path, manifest: dict) -> None:
    """Token ids range-checked once per process per shard set (keyed by the files' sizes and mtimes)."""
    key = (str(path.resolve()),) + tuple((f["path"], os.stat(path / f["path"]).st_mtime_ns) for f in manifest["files"])
    if key not in _RANGE_CHECKED:
        mf.check_token_range(path, manifest)
        _RANGE_CHECKED.add(key)


# -------------------------------------------------------------------------------------------- training
class TrainLoader:
    """Seeded, resumable sampler of training micro-batches. ``weights``: {domain: weight} or a spec for
    :func:`resolve_weights`; ``part``: where its windows lie in each stream: "all", "fit" (the training split
    without its held-out tail) or "held_out" (that tail: :func:`held_out_start`)."""

    def __init__(self, dataset: Dataset, *, seq_len: int, micro_batch_size_seqs: int,
                 weights: Mapping[str, float] | str, seed: int, rank: int = 0, world_size: int = 1,
                 split: str = "train", part: str = "all"):
        self.dataset, self.split, self.part = dataset, split, part
        self.seq_len, self.micro_batch_size_seqs = int(seq_len), int(micro_batch_size_seqs)
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        self.weights = resolve_weights(weights, dataset.domains, token_counts=dataset.token_counts(split))
        # only domains with positive weight are ever drawn (a zero weight is never sampled, not even by rounding)
        self._active = np.array([i for i, d in enumerate(dataset.domains) if self.weights[d] > 0], dtype=np.int64)
        p = np.array([self.weights[dataset.domains[i]] for i in self._active], dtype=np.float64)
        self._p = p / p.sum()
        streams = [dataset.tokens(split, d) for d in dataset.domains]
        cuts = [len(s) if part == "all" else held_out_start(s, dataset.eot_id) for s in streams]
        if part == "held_out":
            streams, cuts = [s[c:] for s, c in zip(streams, cuts)], [len(s) - c for s, c in zip(streams, cuts)]
        self._streams, self._ends = streams, cuts  # every window of domain i ends before self._ends[i] (draw)
        self.batch_index = 0
        for i in self._active:
            d, n = self.dataset.domains[i], self._ends[i]
            if n < self.seq_len + 1:
                where = self.split if self.part == "all" else f"{self.split} ({self.part} part)"
                raise DataError(f"expected >= seq_len+1 = {self.seq_len + 1} {where} tokens in domain {d!r} "
                                f"(weight {self.weights[d]:.4g}); found {n}; fix: give it weight 0, lower "
                                "seq_len, or prepare more data")

    def draw(self, batch_index: int) -> Batch:
        """Batch number ``batch_index`` of this rank (pure: does not move the loader)."""
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, self.rank, batch_index])))
        b, t = self.micro_batch_size_seqs, self.seq_len
        domain = self._active[rng.choice(len(self._active), size=b, p=self._p)]
        lengths = np.array([len(self._streams[i]) for i in domain], dtype=np.int64)
        starts = rng.integers(0, lengths - t)  # window [s, s+t] inclusive fits: s <= n-(t+1)
        if self.part == "fit":  # a window that reaches the held-out tail is drawn again before it, from its own
            ends = np.array([self._ends[i] for i in domain], dtype=np.int64)  # generator: the others stay the
            out = starts + t >= ends  # "all" loader's windows (paired seeds), and every start is uniform
            if out.any():
                redraw = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
                    [self.seed, self.rank, batch_index, 1])))
                starts[out] = redraw.integers(0, ends[out] - t)
        buf = np.empty((b, t + 1), dtype=np.int64)
        for row, (i, s) in enumerate(zip(domain, starts)):
            buf[row] = self._streams[i][s:s + t + 1]
        tokens = torch.from_numpy(buf)
        return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), torch.from_numpy(domain))

    def next_batch(self) -> Batch:
        batch = self.draw(self.batch_index)
        self.batch_index += 1
        return batch

    def state_dict(self) -> dict:
        """Plain Python types only (safe for ``torch.load(weights_only=True)``)."""
        return {"version": STATE_VERSION, "batch_index": self.batch_index, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "seq_len": self.seq_len,
                "micro_batch_size_seqs": self.micro_batch_size_seqs, "split": self.split, "part": self.part,
                "domains": list(self.dataset.domains), "weights": dict(self.weights),
                "content_hash": self.dataset.content_hash}

    def load_state_dict(self, state: Mapping) -> None:
        """Resume at ``state["batch_index"]``. Every rank may load the same (e.g. rank 0's) state: the
        counter is shared, and each rank's windows come from its own rank. Settings that would change
        the batches raise a one-line CheckpointError."""
        mine = self.state_dict()
        if state.get("version") != STATE_VERSION:
            raise CheckpointError(f"expected loader state version {STATE_VERSION}; found {state.get('version')!r}; "
                                  "fix: resume with the eslm version that wrote the checkpoint")
        for key in ("seed", "seq_len", "micro_batch_size_seqs", "split", "part", "domains", "content_hash"):
            if state.get(key) != mine[key]:
                raise CheckpointError(f"expected the checkpoint's data {key}={state.get(key)!r} to resume exactly; "
                                      f"found {mine[key]!r}; fix: resume with the original data and settings")
        if any(abs(state["weights"].get(d, -1.0) - w) > 1e-12 for d, w in mine["weights"].items()):
            raise CheckpointError(f"expected the checkpoint's mixture {state['weights']}; found {mine['weights']}; "
                                  "fix: resume with the original weights")
        if state.get("world_size") != self.world_size:
            warnings.warn(f"loader resumed with world_size {self.world_size} (checkpoint: {state.get('world_size')}):"
                          " batches continue but differ from the original run's; to continue its exact batches, "
                          f"resume on as many processes (torchrun --nproc_per_node {state.get('world_size')})",
                          stacklevel=2)
        self.batch_index = int(state["batch_index"])


def held_out_start(stream: np.ndarray, eot_id: int, fraction: float = HELD_OUT_FRACTION) -> int:
    """Where a training stream's held-out tail starts: at the start of the document that holds token
    ``floor((1 - fraction) * len(stream))`` (just after the end-of-text before it), so the tail holds at least
    ``fraction`` of the tokens and no document lies on both sides; at that token itself when one document
    spans it from the stream's start (the two parts still share no token)."""
    cut = int(len(stream) * (1.0 - fraction))
    ends = np.flatnonzero(np.asarray(stream[:cut]) == eot_id)
    return int(ends[-1]) + 1 if len(ends) else cut


# ------------------------------------------------------------------------------------------ validation
def val_batches(dataset: Dataset, *, seq_len: int, batch_size_seqs: int, tokens_per_domain: int,
                seed: int = 0) -> dict[str, list[Batch]]:
    """A fixed validation set per domain: {domain: [Batch, ...]} of ``max(1, tokens_per_domain // seq_len)``
    windows, picked (seeded by ``seed`` and the domain name) from its non-overlapping windows, capped at what the
    domain has (silently: a small domain such as the default data's 'reference' is evaluated whole). A domain
    without a window is skipped with a warning; a DataError if none has one."""
    out: dict[str, list[Batch]] = {}
    for di, domain in enumerate(dataset.domains):
        stream = dataset.tokens("val", domain)
        available = max(0, len(stream) - 1) // seq_len  # an empty stream has no window, not -1
        if available == 0:
            warnings.warn(f"val: domain {domain!r} has {len(stream)} val tokens, fewer than seq_len+1 = "
                          f"{seq_len + 1}; it is left out of validation; to evaluate it, prepare the data again "
                          "with a larger --val-fraction (eslm prepare) or lower data.seq_len", stacklevel=2)
            continue
        count = min(max(1, tokens_per_domain // seq_len), available)
        # seeded by the domain NAME, so a domain's windows do not change when other domains are added
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), zlib.crc32(domain.encode())])))
        slots = np.sort(rng.choice(available, size=count, replace=False))
        out[domain] = []
        for lo in range(0, count, batch_size_seqs):
            rows = slots[lo:lo + batch_size_seqs]
            tokens = torch.from_numpy(np.stack([np.asarray(stream[s * seq_len:s * seq_len + seq_len + 1],
                                                           dtype=np.int64) for s in rows]))
            out[domain].append(Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(),
                                     torch.full((len(rows),), di, dtype=torch.int64)))
    if not out:
        raise DataError(f"expected a val stream of >= seq_len+1 = {seq_len + 1} tokens in some domain of "
                        f"{dataset.path}; found none; fix: re-prepare with a larger --val-fraction or lower seq_len")
    return out


class StepBatches:
    """The training loader's micro-batches on the device, one optimizer step ahead on CUDA (copied from pinned memory
    while the current step's kernels are queued); the saved position is that of the batches handed out.
    ``per_step``: micro-batches per optimizer step. ``ahead`` (draw the next step's batches at ``prefetch``)
    defaults to whether ``device`` is a CUDA device; copies to CUDA go through pinned memory."""

    def __init__(self, loader: TrainLoader, device: torch.device, per_step: int, *, ahead: bool | None = None):
        self.loader, self.device, self.per_step = loader, device, per_step
        self.pin = device.type == "cuda"
        self.ahead = self.pin if ahead is None else ahead
        self._next: list[Batch] = []

    def next_step(self) -> list[Batch]:
        """This optimizer step's micro-batches on the device: those drawn ahead, or drawn now."""
        out = self._next or [self._to_device(self.loader.next_batch()) for _ in range(self.per_step)]
        self._next = []
        return out

    def prefetch(self) -> None:
        """Draws the next step's micro-batches and queues their copies (with ``ahead``; otherwise nothing)."""
        if self.ahead and not self._next:
            self._next = [self._to_device(self.loader.next_batch()) for _ in range(self.per_step)]

    def _to_device(self, batch: Batch) -> Batch:
        return (batch.pin_memory() if self.pin else batch).to(self.device)

    def state_dict(self) -> dict:
        """The loader's state at the first batch not yet handed out."""
        state = self.loader.state_dict()
        state["batch_index"] -= len(self._next)
        return state

    def load_state_dict(self, state: dict) -> None:
        self._next = []
        self.loader.load_state_dict(state)
