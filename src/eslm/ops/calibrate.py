"""Measure the head route chooser's coefficients on this machine (``eslm.ops.head_costs``); the command is
``eslm calibrate`` (``eslm/cli/calibrate.py``):

    eslm calibrate                                  # cuda if available, else cpu; fp32 and bf16
    eslm calibrate --device cuda --out head_costs.json
    ESLM_HEAD_COSTS=head_costs.json eslm train ...  # the chooser then uses the measured entries

Each coefficient is the fastest of ``--reps`` timed repetitions after a warm-up (the least disturbed by
other work on the machine), on head-shaped work:
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
import platform
import time

import torch

from eslm.errors import ESLMError
from eslm.ops.head_costs import FILE_KIND, HeadCosts

SHAPES = {"cpu": (512, 256, 16384), "cuda": (8192, 1024, 65536)}  # (rows R, width C, vocabulary V)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _timed(fn, device: torch.device, reps: int) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return min(out)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    src_line = (f"measured {datetime.date.today().isoformat()} by eslm calibrate on {name} "
                f"(torch {torch.__version__}, {torch.get_num_threads()} threads{load}), R,C,V={rows},{c},{v}")
    return HeadCosts(matmul_s_per_flop=t_mm / flops, copy_s_per_byte=t_cp / (8.0 * moved * v),
                     softmax_s_per_elem=t_sm / (rows * v), entropy_s_per_elem=t_ent / (rows * v),
                     source=src_line)


def write(path: str, device_type: str, entries: dict[str, HeadCosts]) -> None:
    """Write (or update) a head-costs file; a file that is not one is never overwritten."""
    data = {"kind": FILE_KIND, "costs": {}}
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
    tmp = f"{path}.tmp-{os.getpid()}"  # written whole, then renamed over the old file
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # only when the write failed: os.replace moved it otherwise
            os.unlink(tmp)


def calibrate(device: str, dtypes: list[str], reps: int = 5, threads: int = 0) -> dict[str, HeadCosts]:
    """{compute dtype name ("float32", "bfloat16"): measured coefficients} on ``device`` ("cpu", "cuda[:N]")
    for each of ``dtypes`` ("fp32", "bf16"), with ``threads`` torch CPU threads (0: as set). The chooser
    compares routes, so only the coefficients' ratios matter: on a busy machine one thread measures them with
    less disturbance than threads that wait for each other."""
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
        return {str(DTYPES[n]).replace("torch.", ""): measure(dev, DTYPES[n], reps) for n in dtypes}
    finally:
        torch.set_num_threads(before)
