"""The head route chooser's coefficients per device and compute dtype (``eslm.ops.head_route``), and where
they come from.

Four coefficients price a route: seconds per FLOP of a head-shaped matmul, seconds per byte of copying fp32
rows (the compaction of ``kept_cached``, the bf16 conversion), seconds per element of the softmax chain over
fp32 logits (what a recompute repeats), and seconds per element of the entropy's extra elementwise work (the
product of the shifted logits with their exponentials and its sum), which the routes that do not form P W over
every row pay for the entropy scores.

Which table the chooser reads (``lookup``), first match:

1. ``ESLM_HEAD_COSTS=FILE``: a file ``eslm calibrate --out FILE`` wrote, over the shipped table;
   ``ESLM_HEAD_COSTS=shipped``: the shipped table, nothing measured or read.
2. The table measured on this machine: ``eslm calibrate``, or the first selective training run on a machine,
   measures the coefficients in a few seconds (``eslm.ops.calibrate.ensure_measured``) and caches them per
   machine: one file per key (processor model, torch threads, torch version, BLAS, CPU capability; the GPU's
   name and CUDA version on CUDA) in ``$ESLM_CACHE_DIR/head-costs/``, else ``$XDG_CACHE_HOME/eslm/head-costs/``,
   else ``~/.cache/eslm/head-costs/`` (never inside the package). A process reads its machine's file once, so a
   run keeps one table however long it runs. A file that is damaged (not JSON, not eslm's format, another
   machine's key, a coefficient that is not a positive number) is refused with one line.
3. The shipped table below, with a one-line note the first time it stands in for a measured one.

Shipped entries. CPU: measured with the command in ``source`` on a 2-core CI machine with one thread (on a busy
machine parallel ops waited for a descheduled partner thread); its processor model was not recorded (see
``_CPU``). Another processor differs several-fold per coefficient, and not by one factor (matmuls and
memory-bound work scale differently), which is why each machine measures its own. CUDA: NOT measured (no GPU
was available to the session that wrote this): defaults derived from the H100 SXM data sheet, labelled as such;
the first selective run on a GPU measures its own.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

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
_CPU = ("shipped: measured 2026-11-24 by eslm calibrate --device cpu --reps 15 --threads 1 on a 2-core CI machine "
        "(torch 2.13.0+cpu) whose processor model was not recorded (labelled AMD EPYC then; its one-core bf16 "
        "matmul rate, 451 GFLOP/s, is an AMX unit's, which AMD EPYCs lack: an Intel Xeon of the CI's Intel kind), "
        "idle (load average "
        "1.57), R,C,V=512,256,16384; a second run agreed within 6%")
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
    """The shipped coefficients, with the entries of ``ESLM_HEAD_COSTS``'s file over them (the machine's cache
    is per device: ``lookup``)."""
    out = dict(BUILTIN)
    path = os.environ.get(ENV)
    if path and path != SHIPPED:
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


# ------------------------------------------------------------------ the table measured on this machine (cached)

SHIPPED = "shipped"  # ESLM_HEAD_COSTS=shipped: the shipped table, nothing measured or read
CACHE_ENV = "ESLM_CACHE_DIR"  # eslm's cache directory (default: $XDG_CACHE_HOME/eslm, else ~/.cache/eslm)
CACHE_SUBDIR = "head-costs"
CACHE_FORMAT = "eslm-head-costs-v1"  # a cache file's marker format
DIR_MARKER, DIR_FORMAT = "eslm-cache.json", "eslm-head-costs-dir-v1"  # proves eslm made the directory
_CACHE_NAME = re.compile(r"^(cpu|cuda)-[0-9a-f]{16}\.json$")  # eslm's cache files, by name
_FIELDS = ("matmul_s_per_flop", "copy_s_per_byte", "softmax_s_per_elem", "entropy_s_per_elem")


def cache_dir() -> Path:
    """Where the measured tables live: ``$ESLM_CACHE_DIR/head-costs``, else ``$XDG_CACHE_HOME/eslm/head-costs``
    (an absolute XDG path only, as its specification says), else ``~/.cache/eslm/head-costs``."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        root = os.path.join(xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache"), "eslm")
    return Path(root).expanduser() / CACHE_SUBDIR


def cpu_name() -> str:
    """The processor's model name (``lscpu``'s "Model name"), or what Python's platform module knows."""
    return _cpu_name()


@functools.lru_cache(maxsize=1)
def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown processor"


@functools.lru_cache(maxsize=1)
def _cpu_id() -> str:
    """"family F model M stepping S" from /proc/cpuinfo (a virtual machine's model name can be generic), or ""."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                k, _, v = line.partition(":")
                fields[k.strip()] = v.strip()
    except OSError:
        return ""
    return " ".join(f"{k} {fields[n]}" for k, n in (("family", "cpu family"), ("model", "model"),
                                                    ("stepping", "stepping")) if n in fields)


@functools.lru_cache(maxsize=1)
def _blas() -> str:
    """torch's BLAS as its build says (``BLAS_INFO``, with MKL's version), and oneDNN's version: "mkl 2024.2,
    oneDNN v3.12.0"."""
    import torch

    text = torch.__config__.show()
    info = re.search(r"BLAS_INFO=([^,\s]+)", text)
    mkl = re.search(r"Math Kernel Library Version ([0-9.]+)", text)
    dnn = re.search(r"MKL-DNN (v[0-9.]+)", text)
    blas = (info.group(1) if info else "unknown") + (f" {mkl.group(1)}" if mkl else "")
    return blas + (f", oneDNN {dnn.group(1)}" if dnn else "")


def machine_key(device_type: str, threads: int | None = None) -> dict:
    """What the measured coefficients depend on beside the code: on CPU the processor model, torch's thread
    count, torch version, BLAS and CPU capability (the vector ISA torch dispatches to); on CUDA the GPU's name,
    torch and CUDA versions."""
    import torch

    if device_type == "cuda":
        return {"device": "cuda", "processor": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cuda": torch.version.cuda}
    return {"device": "cpu", "processor": _cpu_name(), "cpu_id": _cpu_id(), "threads": threads or torch.get_num_threads(), "torch": torch.__version__,
            "blas": _blas(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def describe_key(key: dict) -> str:
    if key.get("device") == "cuda":
        return f"{key['processor']}, torch {key['torch']}, CUDA {key.get('cuda')}"
    n = key.get("threads")
    return (f"{key.get('processor')} ({key.get('cpu_id')}), {n} thread{'s' if n != 1 else ''}, torch {key.get('torch')}, "
            f"{key.get('blas')}, {key.get('cpu_capability')}")


def cache_file(key: dict) -> Path:
    """The cache file of a machine key: ``<cache_dir>/<device>-<16 hex digits of the key's SHA-256>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"{key['device']}-{digest}.json"


def read_cache(path: Path, key: dict) -> tuple[dict[tuple[str, str], HeadCosts], str | None]:
    """({(device, dtype): coefficients}, None) from a cache file; ({}, None) when there is none; ({}, the
    problem in a few words) when it is there but damaged or not eslm's."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return {}, None
    if path.is_symlink() or not path.is_file():
        return {}, "not a regular file"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        return {}, f"cannot read it ({getattr(e, 'strerror', None) or e})"
    except json.JSONDecodeError as e:
        return {}, f"not JSON (error at line {e.lineno})"
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
        return {}, f"not an eslm head-costs cache (format {CACHE_FORMAT!r})"
    if data.get("key") != key:
        return {}, "it was measured for another machine key"
    costs = data.get("costs")
    if not isinstance(costs, dict) or not costs:
        return {}, "it holds no coefficients"
    out = {}
    for name, entry in costs.items():
        try:
            device, dtype = name.split("/")
            c = HeadCosts(**entry)
            ok = device == key["device"] and all(
                isinstance(getattr(c, f), (int, float)) and not isinstance(getattr(c, f), bool)
                and math.isfinite(getattr(c, f)) and getattr(c, f) > 0 for f in _FIELDS)
        except (TypeError, ValueError, AttributeError):
            ok = False
        if not ok:
            return {}, f"entry {name!r} is not '{key['device']}/dtype' with four positive coefficients"
        out[(device, dtype)] = c
    return out, None


_MEMO: dict[str, tuple[dict[tuple[str, str], HeadCosts], str | None]] = {}  # cache file -> what this process read
_NOTED: set = set()  # the one-line notes already printed by this process


def machine_entries(device_type: str, threads: int | None = None
                    ) -> tuple[dict[tuple[str, str], HeadCosts], Path, str | None]:
    """This machine's measured table for ``threads`` torch threads (default: the current count), read once per
    process and cache file, its file, and the problem that made a damaged file refused (None otherwise)."""
    key = machine_key(device_type, threads)
    path = cache_file(key)
    if str(path) not in _MEMO:
        _MEMO[str(path)] = read_cache(path, key)
    entries, problem = _MEMO[str(path)]
    return entries, path, problem


def remember(path: Path, entries: dict[tuple[str, str], HeadCosts]) -> None:
    """What this process wrote to (or measured for) a cache file: later lookups use it without reading."""
    _MEMO[str(path)] = (dict(entries), None)


def note(msg: str) -> None:
    """A one-line note on stderr, printed once per process."""
    if msg not in _NOTED:
        _NOTED.add(msg)
        print(f"note: {msg}", file=sys.stderr, flush=True)


def lookup(device: str, dtype: str, *, quiet: bool = False, threads: int | None = None) -> tuple[HeadCosts, dict]:
    """The coefficients for a device type ("cpu", "cuda") and compute dtype ("float32", "bfloat16", ...), and
    which table gave them: {"table": "file" | "measured" | "shipped", "entry", "path", "machine", "source", the
    four coefficients}. In a table, the device's entry for that dtype, else its fp32 entry, else the CPU's (a
    device nobody calibrated). The shipped table standing in for a measured one prints a one-line note (once;
    ``quiet``: not). ``threads``: the machine table of that many torch threads (default: the current count)."""
    path = os.environ.get(ENV)
    keys = [(device, dtype), (device, "float32"), ("cpu", dtype), ("cpu", "float32")]
    if path and path != SHIPPED:
        t = table()
        found = next(k for k in keys if k in t)
        given = _file_entries(path)
        return t[found], _record("file" if found in given else "shipped", found, t[found], path=path)
    if not path and _measurable(device):
        entries, cfile, problem = machine_entries(device, threads)
        measured = next((k for k in keys[:2] if k in entries), None)
        if measured is not None:
            return entries[measured], _record("measured", measured, entries[measured], path=str(cfile),
                                           machine=machine_key(device, threads))
        if not quiet:
            why = (f"the cache {cfile} was refused: {problem}" if problem else
                   f"none measured for this machine ({describe_key(machine_key(device, threads))}) yet")
            note(f"head-route costs for {device}/{dtype}: {why}; the route chooser uses the shipped table; "
                 f"fix: eslm calibrate (a few seconds)")
    t = BUILTIN
    found = next(k for k in keys if k in t)
    return t[found], _record("shipped", found, t[found])


def _measurable(device: str) -> bool:
    if device == "cpu":
        return True
    if device != "cuda":
        return False
    import torch

    return torch.cuda.is_available()


def _record(kind: str, entry: tuple[str, str], c: HeadCosts, *, path: str | None = None,
            machine: dict | None = None) -> dict:
    return {"table": kind, "entry": "/".join(entry), "path": path, "machine": machine, "source": c.source,
            **{f: getattr(c, f) for f in _FIELDS}}


def costs_for(device: str, dtype: str) -> HeadCosts:
    """The coefficients the chooser uses for a device type and compute dtype (``lookup``)."""
    return lookup(device, dtype)[0]
