"""Measure the head route chooser's coefficients on this machine (``eslm.ops.head_costs``) and cache them per
machine; the command is ``eslm calibrate`` (``eslm/cli/calibrate.py``):

    eslm calibrate                                  # cuda if available, else cpu; fp32 and bf16; cached
    eslm calibrate --device cuda --out head_costs.json
    ESLM_HEAD_COSTS=head_costs.json eslm train ...  # the chooser then uses that file's entries

The first selective training run on a machine calls ``ensure_measured`` (its device, its compute dtype, its
thread count): the coefficients are measured once (a few seconds) into the machine's cache file
(``eslm.ops.head_costs.cache_dir``), which later runs read.

Each coefficient is the fastest of ``--reps`` timed repetitions after a warm-up (the least disturbed by
other work on the machine), timed in process CPU time on CPU (all threads; time spent descheduled by other work
does not count, so a busy machine disturbs it less than wall time) and in wall time on CUDA, on head-shaped
work:
the three matmuls of a head step ((R, C) x (C, V), (R, V) x (V, C), (V, R) x (R, C)) for seconds per FLOP;
moving fp32 rows of V floats with index_select / index_copy_ (what ``kept_cached``'s compaction does) for
seconds per byte (read + write counted); the softmax chain over (R, V) fp32 logits (max, subtract, exp, sum,
divide) for seconds per element; the entropy's extra work over the same block (the product of the shifted
logits with their exponentials, and its row sums) for seconds per element of the entropy. Timings on a busy machine are slower than the machine; the chooser only
compares routes, so a uniform slowdown changes nothing, but calibrate on an idle machine.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import torch

from eslm.errors import ESLMError
from eslm.ops import head_costs as hc
from eslm.ops.head_costs import FILE_KIND, HeadCosts
from eslm.files import atomic_write, ensure_dir, new_marker, read_marker
from eslm.lock import DirLock, LOCK_NAME

SHAPES = {"cpu": (512, 256, 16384), "cuda": (8192, 1024, 65536)}  # (rows R, width C, vocabulary V)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BY_NAME = {str(d).replace("torch.", ""): d for d in DTYPES.values()}  # "float32" -> torch.float32


def _timed(fn, device: torch.device, reps: int) -> float:
    """The fastest of ``reps`` calls after a warm-up: on CPU in process CPU time (all threads; time the process
    was descheduled by other work does not count), on CUDA in wall time after a synchronize."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    clock = time.perf_counter if device.type == "cuda" else time.process_time
    fn()
    sync()
    out = []
    for _ in range(reps):
        t0 = clock()
        fn()
        sync()
        out.append(clock() - t0)
    return max(min(out), 1e-9)


def measure(device: torch.device, dtype: torch.dtype, reps: int = 5, shape=None) -> HeadCosts:
    """The three coefficients on ``device`` with matmuls in ``dtype`` (the softmax and the copies are fp32)."""
    rows, c, v = shape or SHAPES["cuda" if device.type == "cuda" else "cpu"]
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(rows, c, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(v, c, generator=g) * 0.05).to(device=device, dtype=dtype)
    dz = torch.randn(rows, v, generator=g).to(device=device, dtype=dtype)

    def matmuls():
        return h @ w.t(), dz @ w, dz.t() @ h

    t_mm = _timed(matmuls, device, reps)
    flops = 3 * 2.0 * rows * c * v

    z = torch.randn(rows, v, generator=g).to(device)
    p = torch.empty_like(z)

    def softmax():
        m = z.amax(-1, keepdim=True)
        torch.sub(z, m, out=p).exp_()
        p.div_(p.sum(-1, keepdim=True))

    t_sm = _timed(softmax, device, reps)
    scratch_e = torch.empty_like(z)

    def entropy():  # what _softmax_rows adds for the entropy: t * e (t = z - m, in a scratch) and its sum
        torch.mul(z, p, out=scratch_e).sum(-1)

    t_ent = _timed(entropy, device, reps)

    moved = rows // 2
    src = torch.arange(rows - moved, rows, device=device)
    dst = torch.arange(0, moved, device=device)
    scratch = torch.empty(max(1, min(moved, c)), v, device=device)  # as kept_cached's compaction does

    def copy():
        for s in range(0, moved, scratch.shape[0]):
            e = min(s + scratch.shape[0], moved)
            torch.index_select(z, 0, src[s:e], out=scratch[: e - s])
            z.index_copy_(0, dst[s:e], scratch[: e - s])

    t_cp = _timed(copy, device, reps)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else hc.cpu_name()
    load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    src_line = (f"measured {datetime.date.today().isoformat()} by eslm calibrate on {name} "
                f"(torch {torch.__version__}, {torch.get_num_threads()} threads{load}), R,C,V={rows},{c},{v}")
    return HeadCosts(matmul_s_per_flop=t_mm / flops, copy_s_per_byte=t_cp / (8.0 * moved * v),
                     softmax_s_per_elem=t_sm / (rows * v), entropy_s_per_elem=t_ent / (rows * v),
                     source=src_line)


def write(path: str, device_type: str, entries: dict[str, HeadCosts]) -> None:
    """Write (or update) a head-costs file; a file that is not one is never overwritten."""
    data: dict = {"kind": FILE_KIND, "costs": {}}
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f)
        except (OSError, json.JSONDecodeError):
            old = None
        if not isinstance(old, dict) or old.get("kind") != FILE_KIND:
            raise ESLMError(f"{path} exists and is not a head-costs file written by eslm calibrate; "
                            f"fix: choose another --out")
        data = old
    for dtype, c in entries.items():
        data["costs"][f"{device_type}/{dtype}"] = c.to_dict()

    atomic_write(Path(path), json.dumps(data, indent=1).encode())  # written whole, renamed over the old file


def calibrate(device: str, dtypes: list[str], reps: int = 5, threads: int = 0,
              cache: bool = False) -> dict[str, HeadCosts]:
    """{compute dtype name ("float32", "bfloat16"): measured coefficients} on ``device`` ("cpu", "cuda[:N]")
    for each of ``dtypes`` ("fp32", "bf16"), with ``threads`` torch CPU threads (0: as set); ``cache``: also
    stored in this machine's cache file for that thread count (``store``), which runs with that many threads
    then use."""
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ESLMError(f"--device {device}: expected cpu | cuda | cuda:N; found an error ({e}); "
                        f"fix: --device cpu") from None
    if dev.type not in SHAPES:
        raise ESLMError(f"--device {device}: expected cpu | cuda | cuda:N; fix: --device cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ESLMError(f"--device {device}: CUDA is not available here; fix: --device cpu, or run on the GPU")
    if reps < 1:
        raise ESLMError(f"--reps must be >= 1; found {reps}; fix: --reps 5")
    if threads < 0:
        raise ESLMError(f"--threads must be >= 0; found {threads}; fix: --threads 0 (torch's default)")
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        out = {str(DTYPES[n]).replace("torch.", ""): measure(dev, DTYPES[n], reps) for n in dtypes}
        if cache:
            store(hc.machine_key(dev.type), out)
        return out
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------ the machine's cache


def _cache_problem(directory: Path) -> str | None:
    """None when eslm may write its cache files in ``directory`` (its marker is there, or it is new or empty,
    and gets the marker now); else why not, in a few words."""

    ensure_dir(directory)
    if read_marker(directory / hc.DIR_MARKER, hc.DIR_FORMAT) is not None:
        return None
    if any(p.name != LOCK_NAME for p in directory.iterdir()):
        return f"{directory} holds files and no {hc.DIR_MARKER}: eslm did not make it"
    atomic_write(directory / hc.DIR_MARKER, (json.dumps(new_marker(hc.DIR_FORMAT), indent=1) + "\n").encode())
    return None


def store(key: dict, entries: dict[str, HeadCosts]) -> Path:
    """Add ``{dtype: coefficients}`` measured for machine ``key`` to its cache file (written whole, then renamed
    over the old one; a damaged or foreign file of that name in eslm's cache directory is replaced, anything
    else is never touched); this process's later lookups use them. Raises ESLMError (one line) when the
    directory is not eslm's, OSError when it cannot be written."""
    path = hc.cache_file(key)
    problem = _cache_problem(path.parent)
    if problem:
        raise ESLMError(f"cannot cache the head-route costs: {problem}; fix: remove it, or set "
                        f"{hc.CACHE_ENV} to another directory")
    old, _ = hc.read_cache(path, key)
    merged = {**{f"{d}/{t}": c for (d, t), c in old.items()},
              **{f"{key['device']}/{dtype}": c for dtype, c in entries.items()}}
    data = new_marker(hc.CACHE_FORMAT, key=key, costs={k: c.to_dict() for k, c in merged.items()})
    atomic_write(path, (json.dumps(data, indent=1) + "\n").encode())
    hc.remember(path, {(k.split("/")[0], k.split("/")[1]): c for k, c in merged.items()})
    return path


def ensure_measured(device: torch.device | str, dtype: str, *, reps: int = 5, log=print) -> dict:
    """The table the chooser will use on ``device`` for compute dtype ``dtype`` ("float32", "bfloat16"),
    measuring it first when this machine has none cached (or its file is damaged: refused with one line and
    measured again), under the cache directory's lock (concurrent runs measure once); returns
    ``eslm.ops.head_costs.lookup``'s record. With ``ESLM_HEAD_COSTS`` set nothing is measured. The measurement
    runs at torch's current thread count, which is part of the machine key."""
    import os

    dev = torch.device(device)
    if os.environ.get(hc.ENV) or dev.type not in SHAPES:
        return hc.lookup(dev.type, dtype)[1]
    entries, path, problem = hc.machine_entries(dev.type)
    if (dev.type, dtype) in entries:
        return hc.lookup(dev.type, dtype)[1]
    if dtype not in BY_NAME:  # a dtype calibrate does not measure: the chooser's fallback (the fp32 entry)
        return hc.lookup(dev.type, dtype)[1]

    key = hc.machine_key(dev.type)
    try:
        ensure_dir(path.parent)
        with DirLock(path.parent, what="head-costs cache").acquire(wait=True):
            got, problem = hc.read_cache(path, key)  # another process may have measured while we waited
            if problem:
                log(f"the head-route costs cache {path} was refused ({problem}); measuring them again")
            if (dev.type, dtype) not in got:
                t0 = time.perf_counter()
                measured = {dtype: measure(dev, BY_NAME[dtype], reps)}
                store(key, measured)
                log(f"measured the head-route costs of {dev.type}/{dtype} on this machine in "
                    f"{time.perf_counter() - t0:.1f} s ({hc.describe_key(key)}); cached in {path}")
            else:
                hc.remember(path, got)
    except (OSError, ESLMError) as e:  # no cache: the shipped table, said in one line
        hc.note(f"head-route costs not measured here: {e}; the route chooser uses the shipped table")
        return hc.lookup(dev.type, dtype, quiet=True)[1]
    return hc.lookup(dev.type, dtype)[1]
