"""How long a study will take on this machine's CPU, estimated before it runs (``eslm study ... --dry-run``).

Each run's CPU seconds = K x (its matmul FLOPs x the machine's seconds per head-matmul FLOP + its softmax
elements x seconds per softmax element) + a per-run overhead; the two rates are timed when the estimate is made
(``rates``, well under a second). Wall time on idle cores: the runs' CPU time over ``min(jobs x threads, cores)``
cores, plus the study's own serial work (its process, corpus preparation, the report).

The constants, measured on a 2-core Intel Xeon (family 6 model 207, torch 2.13.0+cpu, MKL 2024.2):
``K`` from the idle figures of the small model (benchmarks/RESULTS.md: a CLM step of 4 x 128 tokens takes
0.286 s of CPU, against 0.240 s that the same two rates, timed idle on the same shapes, predict), so K = 1.19; the
overheads under load (load average ~19, process CPU time): a run's process start, imports and set-up about
3 s, the study's process 3 s, ``eslm report`` of six runs 12 s, preparing the stdlib corpus 8 s. The model
is checked against the demo in README.md (which names the processors): it is an estimate, expected within
about 20-30% where the head dominates a step (the small and 124M presets), not a promise.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from eslm import metrics as M
from eslm.config import method_context, model_config_for, training_flops_model
from eslm.data.manifest import MANIFEST_NAME
from eslm.data.prepare import default_data_root
from eslm.methods import METHODS
from eslm.train.optim import budget_steps, planned_micro_batch_flops

K = 1.19  # a step's CPU time / the timed rates' matmul + softmax prediction (Intel Xeon, idle)
RUN_OVERHEAD_S = 3.0  # process start, imports, model and data set-up of one run
STUDY_OVERHEAD_S = 3.0  # the study's own process
REPORT_S = 12.0  # eslm report of the demo's six runs
PREP_STDLIB_S = 8.0  # eslm prepare stdlib (gpt2 tokenizer)


RATE_SHAPE = (512, 256, 16384)  # rows R, width C, vocabulary V of the timed head step


@functools.lru_cache(maxsize=4)
def rates(threads: int, bf16: bool) -> tuple[float, float]:
    """(seconds per head-matmul FLOP, seconds per fp32 softmax element) on this CPU with ``threads`` torch
    threads: the fastest of three timings in process CPU time (time descheduled by other work does not count),
    after a warm-up, of a head step's three matmuls (in bf16 with ``bf16``) and of the softmax chain over
    (R, V) fp32 logits. Timed once per process."""
    r, c, v = RATE_SHAPE
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    h, w = torch.randn(r, c, generator=g).to(dtype), torch.randn(v, c, generator=g).to(dtype)
    dz, z = torch.randn(r, v, generator=g).to(dtype), torch.randn(r, v, generator=g)

    def fastest(fn) -> float:
        fn()
        out = []
        for _ in range(3):
            t0 = time.process_time()
            fn()
            out.append(time.process_time() - t0)
        return max(min(out), 1e-9)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        mm = fastest(lambda: (h @ w.t(), dz @ w, dz.t() @ h))
        sm = fastest(lambda: torch.softmax(z, -1))
    finally:
        torch.set_num_threads(before)
    return mm / (3 * 2.0 * r * c * v), sm / (r * v)


def _data_dir(cfg) -> Path:
    d = cfg.data
    return Path(d.dir) if d.dir else Path(default_data_root()) / f"{d.source}-{d.tokenizer}"


def _domains(cfg) -> int:
    """The corpus's number of domains (each evaluated): from its manifest when prepared, else stdlib's 3."""
    try:
        return max(1, len(json.loads((_data_dir(cfg) / MANIFEST_NAME).read_text())["domains"]))
    except (OSError, ValueError, KeyError, TypeError):
        return 3  # stdlib: code, docs, reference


def run_seconds(cfg, s_per_flop: float, s_per_elem: float) -> float:
    """Estimated CPU seconds of one run of ``cfg`` at these rates (``rates``)."""
    fm, t, e = training_flops_model(cfg), cfg.train, cfg.eval
    tokens_per_step = t.micro_batch_size_seqs * cfg.data.seq_len * t.grad_accum_steps
    dense_step = fm.train_per_token * tokens_per_step
    train_flops = t.max_flops if t.max_flops else dense_step * t.max_steps
    dense_steps = train_flops / dense_step
    train_tokens = dense_steps * tokens_per_step
    evals = (math.floor(dense_steps / e.interval) + 1) if e.interval else 1
    eval_tokens = evals * _domains(cfg) * e.tokens_per_domain
    flops = train_flops + eval_tokens * fm.forward_per_token
    softmax = (train_tokens + eval_tokens) * fm.vocab_size
    return K * (flops * s_per_flop + softmax * s_per_elem) + RUN_OVERHEAD_S


def step_flops_of(cfg) -> tuple[float, str] | None:
    """(FLOPs of one micro-batch of a run of ``cfg`` as its ``flops.budget_counter`` counts them, how exact:
    "exact" | "about"), as the trainer plans it (``eslm.train.optim.planned_micro_batch_flops``) for the
    registry's method built from the config alone; "about" where a controller moves alpha (planned at
    ``method.alpha``). None for a method that needs a frozen model or held-out data (``MethodSpec.needs``): its
    work depends on a model not loaded here, or on the data."""
    spec = METHODS[cfg.method.name]
    if spec.needs:
        return None
    method = spec.build(method_context(cfg, device=torch.device("cpu"), n_domains=_domains(cfg),
                                       model_config=model_config_for(cfg)))
    return (planned_micro_batch_flops(cfg, method, training_flops_model(cfg)),
            "about" if method.controllers else "exact")


def run_steps(cfg, start: tuple[int, float] | None = (0, 0.0)) -> tuple[int | None, str]:
    """(the optimizer step a run of ``cfg`` ends at, how exact: "exact" | "about"; or None and why not):
    ``train.max_steps`` without a FLOPs budget; with one, the step whose counted FLOPs reach ``train.max_flops``
    (``eslm.train.optim.budget_steps``), capped by ``train.max_steps``. ``start``: (step, counted FLOPs) a
    branched run continues from (its trunk's), None when unknown."""
    t = cfg.train
    if t.max_flops <= 0:
        return t.max_steps, "exact"
    spent = step_flops_of(cfg)
    if spent is None or start is None:
        needs = METHODS[cfg.method.name].needs
        what = " and ".join(n.words for n in needs) if needs else "its trunk"
        return None, f"steps not estimated before it runs (the work of {what} decides how many the budget pays for)"
    steps = budget_steps(cfg, spent[0], *start)
    return min(steps, t.max_steps), spent[1] if steps <= t.max_steps else "exact"


def steps_by_run(planned: list) -> dict:
    """{config: ``run_steps``} for every run of the study's stages (``eslm.study.stages``); a branched run starts
    from its trunk's last step and the FLOPs its trunk counted (as the branched run's counter counts them)."""
    trunks = {c.run.seed: c for stage in planned if stage.name == "trunks" for c in stage.runs}
    out = {}
    for stage in planned:
        for c in stage.runs:
            start: tuple[int, float] | None = (0, 0.0)
            if c.train.branch_from:
                trunk = trunks.get(c.run.seed)
                per = None if trunk is None else step_flops_of(replace(trunk, flops=c.flops))
                micro_batches = c.train.grad_accum_steps if c.flops.count_per == "global" else 1
                start = None if per is None or trunk is None else (
                    trunk.train.max_steps, trunk.train.max_steps * micro_batches * per[0])
            out[c] = run_steps(c, start)
    return out


def describe_steps(steps: tuple[int | None, str]) -> str:
    n, how = steps
    if n is None:
        return how
    return f"{'' if how == 'exact' else how + ' '}{n} step{'s' if n != 1 else ''}"


def estimate(configs: list, jobs: int) -> dict | None:
    """{"cpu_s", "wall_s", "rates" (``rates``), "prep" (whether stdlib preparation is counted), "cores",
    "unpriced": {method: runs} whose frozen model's forwards or held-out gradients are not priced} for the
    planned runs on this machine's CPU; None when they run on a GPU (no model for that here)."""
    device = configs[0].train.device if configs else "cuda"
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return None

    threads = configs[0].train.num_threads or max(1, (os.cpu_count() or 1) // max(1, jobs))
    timed = rates(threads, configs[0].train.dtype == "bf16")
    runs = sum(run_seconds(c, *timed) for c in configs)
    serial = STUDY_OVERHEAD_S + REPORT_S
    prep = False
    d = configs[0].data
    if not d.dir and d.source == "stdlib":
        prep = not (_data_dir(configs[0]) / MANIFEST_NAME).is_file()
        serial += PREP_STDLIB_S if prep else 0.0
    cores = max(1, min(len(configs), jobs * threads, os.cpu_count() or 1))
    unpriced = dict(Counter(c.method.name for c in configs if METHODS[c.method.name].needs))
    return {M.CPU_S: runs + serial, "wall_s": runs / cores + serial, "rates": timed, "prep": prep,
            "cores": cores, "unpriced": unpriced}


def describe(est: dict | None) -> str | None:
    """The estimate in one line (None for none)."""
    if est is None:
        return None
    flop, elem = est["rates"]
    where = f"this CPU's {1e-9 / flop:.0f} GFLOP/s head matmuls and {1e-6 / elem:.0f} M softmax elements/s"
    low = est.get("unpriced") or {}
    return (f"estimate: {'at least ' if low else ''}about {est[M.CPU_S] / 60:.1f} CPU-minutes, "
            f"{'at least ' if low else ''}about {est['wall_s'] / 60:.1f} min on "
            f"{est['cores']} idle core{'s' if est['cores'] > 1 else ''}"
            + (" (corpus preparation included)" if est["prep"] else "") + f", from {where}"
            + (f"; low: the extra work of {', '.join(f'{m} ({n} runs)' for m, n in sorted(low.items()))} (a "
               "frozen model's forwards, held-out gradients) is not priced, only their dense steps" if low else ""))
