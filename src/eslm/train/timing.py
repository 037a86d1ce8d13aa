"""What the machine measured while training (time, throughput, load, MFU): differs between two identical runs
(``metrics.TIMING_KEYS``); nothing that is trained depends on it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from eslm.files import atomic_write

# peak dense bf16 FLOP/s for MFU, by a key contained in the GPU's name; the first key that matches wins, so a
# variant's key comes before its family's (H100 PCIe: 756 TFLOP/s; H100 SXM / H200: 989; A100: 312)
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


def timed(fn, device: torch.device, synchronize: bool = True):
    """(fn(), wall-clock seconds, process CPU seconds): the device is synchronised before the clocks stop, unless
    ``fn`` ends with a blocking read of its own (``synchronize=False``: the training step, whose one host read
    comes after its update is queued)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    if synchronize and device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0, time.process_time() - c0


class Throughput:
    """Training tokens per second of training time over the steps since the previous reading: each step adds
    its tokens and its own wall time, so evaluation, checkpoints and logging between steps do not count."""

    def __init__(self) -> None:
        self.seconds, self.tokens = 0.0, 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def read(self) -> float:
        rate = self.tokens / max(self.seconds, 1e-9)
        self.seconds, self.tokens = 0.0, 0
        return rate


def mfu(tokens_per_s: float, train_flops_per_token: float, device: torch.device, world_size: int) -> float | None:
    """Model FLOPs utilisation against the GPU's peak dense bf16 rate; None off CUDA or for an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return None if peak is None else tokens_per_s * train_flops_per_token / (peak * world_size)


def load_avg() -> list[float] | None:
    """The machine's (1, 5, 15)-minute load averages, or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


class LoadSampler:
    """The 1-minute load average sampled at every log line of this process, so that a report can tell runs
    taken on an idle machine from runs taken on a busy one."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    def sample(self) -> float | None:
        load = load_avg()
        if load is None:
            return None
        self.samples.append(load[0])
        return load[0]

    def summary(self) -> dict | None:
        s = self.samples
        if not s:
            return None
        return {"mean_1m": sum(s) / len(s), "max_1m": max(s), "samples": len(s)}

    def record_in_env(self, run_dir: Path, step: int) -> None:
        """env.json gains this process's summary (one entry per start or resume)."""
        path = run_dir / "env.json"
        summary = self.summary()
        if summary is None or not path.is_file():
            return
        try:
            env = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return
        env.setdefault("load_avg_during_run", []).append({"until_step": step, **summary})

        atomic_write(path, (json.dumps(env, indent=2) + "\n").encode())  # replaces a link, never follows it
