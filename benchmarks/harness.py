"""Shared benchmark machinery: real training steps of several variants, timed round-robin in ONE process.

Each variant is a method built through the registry (``eslm.methods``) with its own config overrides, run
through the real shared step (``eslm.train.step.forward_backward``) plus gradient clipping and the AdamW
update, on one model. Variants are interleaved step by step (round-robin), so a slow spell of the machine hits
every variant alike; the figure per variant is the median step time after warm-up.

Step time: on CUDA, CUDA events recorded around the step on the current stream after a synchronize (the
time the GPU spent on the step's work, without the Python-side timer's launch jitter); on CPU, perf_counter.
MFU = tokens/s x the PaLM FLOPs per token (``eslm.flops``, what the trainer's progress line uses) / the peak
dense FLOP/s: the trainer's table by GPU name, or one the caller gives (e.g. a measured matmul peak).

Peak memory of a step = the highest resident memory during the step minus the resident memory just before it
(model, optimizer state and the data are resident before; activations, logits and gradients come and go).
On CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats, in the timing run. On Linux CPU:
VmHWM after writing "5" to /proc/self/clear_refs (resets the high-water mark); glibc must return freed blocks
to the system for this to track live tensors, so memory is measured in a separate child process started with
MALLOC_MMAP_THRESHOLD_=65536 (large blocks always mmap'ed and unmapped on free). Timing runs with the normal
allocator, as training does.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the eslm command line does (src/eslm/cli.py)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent
RESULTS = Path(os.environ.get("ESLM_BENCH_RESULTS", ROOT / "results"))  # the env var: for the smoke tests
_MALLOC_ENV = "MALLOC_MMAP_THRESHOLD_"


def cpu_peaks_in_child(argv: list[str], rounds: int = 1) -> dict[str, float]:
    """Run this script again as a child with glibc's mmap threshold pinned and ``--memory-only``; returns each
    variant's peak step memory (bytes, the max over ``rounds`` rounds after one warm-up; a step's allocations
    do not depend on the round, so one is enough)."""
    out = RESULTS / ".peaks.json"
    env = {**os.environ, _MALLOC_ENV: "65536"}
    subprocess.run([sys.executable, sys.argv[0], *argv, "--memory-only", str(out), "--steps", str(rounds)],
                   env=env, check=True)
    peaks = json.loads(out.read_text())
    out.unlink()
    return peaks


def run_and_measure(bench: Bench, variants: list, args, argv) -> bool:
    """Time the variants round-robin; on CPU then measure their peak memory in a child process. In that child
    (``args.memory_only`` set) write the peaks and return False: the caller stops there."""
    bench.run(variants, warmup=args.warmup, steps=args.steps, log=lambda m: print(m, flush=True))
    if args.memory_only:
        Path(args.memory_only).write_text(json.dumps({v.label: max(v.peaks) for v in variants if v.peaks}))
        return False
    if bench.device.type == "cpu" and not getattr(args, "no_cpu_memory", False):
        print("measuring peak step memory in a child process ...", flush=True)
        peaks = cpu_peaks_in_child(list(argv if argv is not None else sys.argv[1:]))
        for v in variants:
            v.peaks = [peaks[v.label]] if v.label in peaks else []
    return True


# ----------------------------------------------------------------------------------------------- memory probes


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


class MemoryProbe:
    """Peak memory of a region above what was resident when it started, in bytes."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = device.type == "cpu" and Path("/proc/self/clear_refs").exists()

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        elif self.cpu:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._base = _status_kb("VmRSS") * 1024

    def stop(self) -> float | None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return float(torch.cuda.max_memory_allocated(self.device) - self._base)
        if self.cpu:
            return float(_status_kb("VmHWM") * 1024 - self._base)
        return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Seconds between ``start`` and ``stop``: CUDA events on a GPU (read after a synchronize), else perf_counter."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        sync(self.device)
        if self.cuda:
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            t1 = torch.cuda.Event(enable_timing=True)
            t1.record()
            t1.synchronize()
            return self._t0.elapsed_time(t1) / 1000.0
        return time.perf_counter() - self._t0


def peak_flops(device: torch.device, given: float | None = None) -> tuple[float | None, str]:
    """(peak dense bf16 FLOP/s for MFU, where it came from): ``given`` if set, else the trainer's table by GPU
    name (``eslm.train.timing.PEAK_FLOPS``: one source for the benchmark's and the progress line's MFU), else
    None (CPU, or a GPU the table lacks)."""
    if given:
        return float(given), "given (--peak-flops)"
    if device.type != "cuda":
        return None, "none on CPU (pass --peak-flops)"
    from eslm.train.timing import PEAK_FLOPS

    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS.items():
        if key in name:
            return value, f"spec table: {key}"
    return None, f"{name} not in the trainer's table (pass --peak-flops)"


# ----------------------------------------------------------------------------------------------- variants


@dataclass
class Variant:
    label: str
    overrides: dict  # config overrides (method.name, method.alpha, train.loss_impl, ...)
    group: str = ""
    times: list = field(default_factory=list)
    peaks: list = field(default_factory=list)
    kept: list = field(default_factory=list)


class Bench:
    """One model, one optimizer, fixed random batches; variants built from config overrides."""

    def __init__(self, *, preset: str, seq_len: int, micro_batch: int, accum: int = 1, device: str = "cpu",
                 dtype: str = "fp32", compile: bool = False, seed: int = 0, context=None):
        from eslm.flops import FlopsModel
        from eslm.model.gpt import GPT
        from eslm.model.gpt import preset as model_preset
        from eslm.train.optim import build_optimizer

        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.preset, self.seq_len, self.micro_batch, self.accum = preset, seq_len, micro_batch, accum
        self.dtype, self.compile = dtype, compile
        self.model_config = model_preset(preset, vocab_size=50304)
        self.raw = GPT(self.model_config).to(self.device)
        self.model = torch.compile(self.raw) if compile else self.raw
        self.opt = build_optimizer(self.raw, lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95),
                                   device_type=self.device.type)
        g = torch.Generator().manual_seed(seed + 1)
        from eslm.data.batch import Batch

        def batch():
            x = torch.randint(0, 50257, (micro_batch, seq_len + 1), generator=g)
            return Batch(x=x[:, :-1].contiguous(), y=x[:, 1:].contiguous(),
                         domain=torch.zeros(micro_batch, dtype=torch.long)).to(self.device)

        self.batches = [batch() for _ in range(accum)]
        self.context = context or {}
        self.probe = MemoryProbe(self.device)
        self.timer = StepTimer(self.device)
        self.flops_per_token = FlopsModel.from_config(self.model_config, seq_len).train_per_token
        self.measure_memory = self.device.type == "cuda" or os.environ.get(_MALLOC_ENV) is not None
        self._methods: dict[str, object] = {}

    def autocast(self):
        if self.dtype == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return None

    def method(self, v: Variant):
        if v.label not in self._methods:
            from eslm.config import build_config, method_context
            from eslm.methods import build_method

            base = {"data.seq_len": self.seq_len, "train.micro_batch_size_seqs": self.micro_batch}
            cfg = build_config(overrides=[f"{k}={val}" for k, val in {**base, **v.overrides}.items()])
            ctx = method_context(cfg, device=self.device, n_domains=1, model_config=self.model_config,
                               **self.context)
            self._methods[v.label] = (cfg, build_method(ctx))
        return self._methods[v.label]

    def step(self, v: Variant) -> None:
        from eslm.train.step import StepOptions, forward_backward

        cfg, method = self.method(v)
        t = cfg.train
        opts = StepOptions(accum_steps=self.accum, normalize=t.normalize, autocast=self.autocast())
        if self.measure_memory:
            self.probe.start()
        self.timer.start()
        res = forward_backward(self.model, self.raw, method, self.batches, opts, step=1, lr=6e-4)
        torch.nn.utils.clip_grad_norm_(self.raw.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        v.times.append(self.timer.stop())
        peak = self.probe.stop() if self.measure_memory else None
        if peak is not None:
            v.peaks.append(peak)
        v.kept.append(res.tokens_kept / max(res.tokens_seen, 1))

    def run(self, variants: list[Variant], *, warmup: int, steps: int, log=print) -> None:
        """Round-robin: every round runs each variant once; the first ``warmup`` rounds are not recorded."""
        for r in range(warmup + steps):
            for v in variants:
                self.step(v)
                if r < warmup:
                    v.times.clear(), v.peaks.clear(), v.kept.clear()
            if r >= warmup:
                log(f"  round {r - warmup + 1}/{steps}: " + "  ".join(
                    f"{v.label} {v.times[-1]:.3f}s" for v in variants))


def median(xs: list) -> float | None:
    return statistics.median(xs) if xs else None


def cpu_info() -> dict:
    """The processor as /proc/cpuinfo names it ("model name") and its "family F model M stepping S" (a virtual
    machine's model name can be generic), torch's BLAS (with MKL's version) and oneDNN's version."""
    fields: dict = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                k, _, v = line.partition(":")
                fields[k.strip()] = v.strip()
    except OSError:
        pass
    text = torch.__config__.show()
    info = re.search(r"BLAS_INFO=([^,\s]+)", text)
    mkl = re.search(r"Math Kernel Library Version ([0-9.]+)", text)
    dnn = re.search(r"MKL-DNN (v[0-9.]+)", text)
    blas = (info.group(1) if info else "unknown") + (f" {mkl.group(1)}" if mkl else "")
    return {"cpu": fields.get("model name") or platform.processor() or platform.machine() or "unknown processor",
            "cpu_id": " ".join(f"{k} {fields[n]}" for k, n in (("family", "cpu family"), ("model", "model"),
                                                               ("stepping", "stepping")) if n in fields),
            "blas": blas + (f", oneDNN {dnn.group(1)}" if dnn else "")}


def environment(bench: Bench) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(bench.device),
           "threads": torch.get_num_threads(), **cpu_info(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_count": os.cpu_count()}
    if bench.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(bench.device)
        env["cuda"] = torch.version.cuda
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(bench.device)))
    try:
        env["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=ROOT).stdout.strip()
    except OSError:
        pass
    return env


def write_results(name: str, payload: dict, md_lines: list[str]) -> None:
    """Print the markdown table and write results/<name>.json and results/<name>.md."""
    text = "\n".join(md_lines) + "\n"
    print("\n" + text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    jp, mp = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    jp.write_text(json.dumps(payload, indent=2) + "\n")
    mp.write_text(text)
    print(f"wrote {jp} and {mp}")


def fmt_mb(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:,.0f}"


def fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
