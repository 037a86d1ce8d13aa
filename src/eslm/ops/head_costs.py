"""The head route chooser's coefficients per device and compute dtype (``eslm.ops.head_route``).

Four coefficients price a route: seconds per FLOP of a head-shaped matmul, seconds per byte of copying fp32
rows (the compaction of ``kept_cached``, the bf16 conversion), seconds per element of the softmax chain over
fp32 logits (what a recompute repeats), and seconds per element of the entropy's extra elementwise work (the
product of the shifted logits with their exponentials and its sum), which the routes that do not form P W over
every row pay for the entropy scores. ``python -m eslm.ops.calibrate`` measures them on the machine it runs
on; ``ESLM_HEAD_COSTS=FILE`` (a file that command wrote with ``--out``) replaces the built-in entries below for
the devices it has.

Built-in entries. CPU: measured by the command in ``source`` on a 2-core CPU that other work was loading, with
one thread: with two, every parallel op waited for a descheduled partner thread and the row copies came out 20x
slower than on one thread (the chooser compares routes, so the coefficients' ratios are what matters). CUDA: NOT measured (no GPU was
available to the session that wrote this): defaults derived from the H100 SXM data sheet, labelled as such;
run the calibration on the GPU and set ``ESLM_HEAD_COSTS`` to use measured ones.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass

from eslm.errors import ConfigError

ENV = "ESLM_HEAD_COSTS"
FILE_KIND = "eslm head costs"  # the marker of a file written by ``python -m eslm.ops.calibrate --out``


@dataclass(frozen=True)
class HeadCosts:
    matmul_s_per_flop: float
    copy_s_per_byte: float
    softmax_s_per_elem: float
    entropy_s_per_elem: float
    source: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


FLOPS_ONLY = HeadCosts(1.0, 0.0, 0.0, 0.0, "FLOPs only (no geometry known)")

# H100 SXM data sheet: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32 (no TF32: PyTorch's default for fp32 matmuls),
# 3.35 TB/s HBM3. The softmax chain reads and writes its fp32 row about seven times (28 bytes per element), the
# entropy's product and sum four times (16 bytes).
_H100 = "H100 SXM data-sheet default, NOT measured (run python -m eslm.ops.calibrate on the GPU)"
_CPU = ("measured 2026-11-24 by eslm calibrate --device cpu --reps 15 --threads 1 on the 2-core AMD EPYC CI "
        "machine (torch 2.13.0+cpu), idle (load average 1.57, the decay of a finished benchmark), R,C,V=512,256,16384; "
        "a second run agreed within 6%")
BUILTIN: dict[tuple[str, str], HeadCosts] = {
    ("cpu", "float32"): HeadCosts(9.468e-12, 4.26e-11, 1.002e-09, 3.099e-10, _CPU),
    ("cpu", "bfloat16"): HeadCosts(2.219e-12, 4.231e-11, 9.784e-10, 3.033e-10, _CPU),
    ("cuda", "bfloat16"): HeadCosts(1 / 989e12, 1 / 3.35e12, 28 / 3.35e12, 16 / 3.35e12, _H100),
    ("cuda", "float32"): HeadCosts(1 / 67e12, 1 / 3.35e12, 28 / 3.35e12, 16 / 3.35e12, _H100),
}


def _from_file(path: str) -> dict[tuple[str, str], HeadCosts]:
    fix = f"fix: write it with python -m eslm.ops.calibrate --out {path}, or unset {ENV}"
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"{ENV}={path}: cannot read it ({e.strerror}); {fix}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{ENV}={path}: expected JSON, found an error at line {e.lineno}; {fix}") from None
    if not isinstance(data, dict) or data.get("kind") != FILE_KIND or not isinstance(data.get("costs"), dict):
        raise ConfigError(f"{ENV}={path}: expected a head-costs file (kind {FILE_KIND!r}); found something else; "
                          f"{fix}")
    out = {}
    for key, entry in data["costs"].items():
        try:
            device, dtype = key.split("/")
            c = HeadCosts(**entry)
            ok = all(isinstance(v, (int, float)) and v >= 0 for v in (c.matmul_s_per_flop, c.copy_s_per_byte,
                                                                       c.softmax_s_per_elem, c.entropy_s_per_elem))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ConfigError(f"{ENV}={path}: entry {key!r} is not 'device/dtype' with four non-negative "
                              f"coefficients; {fix}")
        out[(device, dtype)] = c
    return out


def table() -> dict[tuple[str, str], HeadCosts]:
    """The built-in coefficients, with the entries of ``ESLM_HEAD_COSTS``'s file over them."""
    out = dict(BUILTIN)
    path = os.environ.get(ENV)
    if path:
        out.update(_file_entries(path))
    return out


def _file_entries(path: str) -> dict[tuple[str, str], HeadCosts]:
    """``_from_file``, read again only when the file changes (the chooser asks at every micro-batch); its errors
    are never cached."""
    try:
        st = os.stat(path)
    except OSError:
        return _from_file(path)  # its one-line error
    return _cached_file(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _cached_file(path: str, mtime_ns: int, size: int) -> dict[tuple[str, str], HeadCosts]:
    return _from_file(path)


def costs_for(device: str, dtype: str) -> HeadCosts:
    """The coefficients for a device type ("cpu", "cuda") and compute dtype ("float32", "bfloat16", ...): the
    device's entry for that dtype, else its fp32 entry, else the CPU's (a device nobody calibrated)."""
    t = table()
    for key in ((device, dtype), (device, "float32"), ("cpu", dtype), ("cpu", "float32")):
        if key in t:
            return t[key]
    raise KeyError(f"no head costs for {device}/{dtype}")  # unreachable: the CPU entries are built in
