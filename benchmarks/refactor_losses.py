"""Refactor guard: a fixed short run of EVERY registered method on the tiny preset, per-step numbers to JSON.

A change that only moves code must leave every number here bit-identical (issue 16; docs/architecture.md,
"Contracts"). Each method trains 6 optimizer steps (2 micro-batches of 4 x 32 tokens, CPU, fp32, one thread)
on a small byte-level corpus built from three stdlib modules; the Rho-1 reference and the KD teacher are the
checkpoint of the CLM run, which runs first. A few variants cover the options whose code paths a refactor
touches (selection scope "step", global normalisation, domain standardisation, the naive loss, GREATS' pool).

Recorded per step: the optimised loss, the all-token CE, the gradient norm, the kept fraction and selection
statistics, tokens seen and the three FLOPs counters; per run, the final validation losses. Timing keys are
never recorded (they differ run to run).

    python benchmarks/refactor_losses.py                      # writes benchmarks/results/refactor_losses.json
    python benchmarks/refactor_losses.py --check benchmarks/results/refactor_losses.json   # compare, exit 1 if not identical
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "refactor_losses.json"
STEPS = 6

# (run name, method name, extra overrides). The CLM run comes first: its checkpoint is the reference/teacher.
VARIANTS_EXTRA = [
    ("eslm-entropy@scope=step", "eslm-entropy", {"method.scope": "step"}),
    ("eslm-loss@normalize=global,scope=step", "eslm-loss", {"method.scope": "step", "train.normalize": "global"}),
    ("eslm-entropy@normalize=global", "eslm-entropy", {"train.normalize": "global"}),
    ("eslm-entropy@standardize=domain", "eslm-entropy", {"method.standardize": "domain"}),
    ("eslm-loss@loss_impl=naive", "eslm-loss", {"train.loss_impl": "naive"}),
    ("eslm-entropy@cache_probs=false", "eslm-entropy", {"train.loss_cache_probs": "false"}),
    ("rho1@standardize=sequence", "rho1", {"method.standardize": "sequence"}),
    ("greats@pool", "greats", {"method.greats.pool": "pool"}),
    ("eslm-kd-loss@alpha=0.5", "eslm-kd-loss", {"method.alpha": 0.5}),
]

# what a train record keeps: every metric but the machine's measurements (eslm.metrics.TIMING_KEYS) and the record's
# kind and step (its place in the list), so a new deterministic metric is guarded without an edit here; an eval
# record keeps its validation losses (its counters repeat the train records')
EVAL_KEYS = ("val_loss",)
EVAL_PREFIXES = ("val_loss/",)


def _train_keys(rec: dict) -> dict:
    from eslm import metrics as M

    return {k: v for k, v in rec.items() if k not in (M.KIND, M.STEP, *M.TIMING_KEYS)}


def _write_corpus(root: Path) -> list[str]:
    """The tests' tiny corpus (tests/conftest.py): two domains from three stdlib modules' sources / docstrings."""
    import inspect
    import json as json_mod
    import textwrap

    code, prose = root / "code", root / "prose"
    code.mkdir(parents=True)
    prose.mkdir(parents=True)
    for mod in (json_mod, textwrap, inspect):
        (code / f"{mod.__name__}.py").write_text(Path(mod.__file__).read_text()[:20000])
        (prose / f"{mod.__name__}.txt").write_text((mod.__doc__ or "") * 20)
    return [f"code={code}", f"prose={prose}"]


def _overrides(data_dir: Path, out_dir: Path, name: str, method: str, extra: dict, teacher: str) -> list[str]:
    base = {
        "data.dir": str(data_dir), "data.tokenizer": "byte", "data.seq_len": 32, "model.preset": "tiny",
        "run.out_dir": str(out_dir), "run.name": name.replace("@", "_").replace(",", "_").replace("=", "-"),
        "run.seed": 1234, "train.device": "cpu", "train.dtype": "fp32", "train.num_threads": 1,
        "train.micro_batch_size_seqs": 4, "train.grad_accum_steps": 2, "train.max_steps": STEPS,
        "train.warmup_steps": 1, "train.lr": 3e-3, "eval.interval": 0, "eval.tokens_per_domain": 256,
        "eval.batch_size_seqs": 4, "log.interval": 1, "checkpoint.interval": 0, "log.tensorboard": "false",
        "method.name": method, "method.ada.interval": 2, "method.ada.gamma": 5.0, "method.alpha": 0.25,
    }
    from eslm.methods import METHODS

    for need in METHODS[method].frozen_models:  # rho1's reference, the KD methods' teacher: the CLM run
        base[need.key] = teacher
    if method == "salt":
        base["method.salt.kd_steps"] = 3  # three KD steps, then three CE steps: the switch is inside the run
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _keep(rec: dict, keys, prefixes) -> dict:
    return {k: v for k, v in rec.items() if k in keys or k.startswith(prefixes)}


def _run(data_dir: Path, out_dir: Path, name: str, method: str, extra: dict, teacher: str) -> dict:
    from eslm.config import build_config
    from eslm.train.trainer import train

    res = train(build_config(overrides=_overrides(data_dir, out_dir, name, method, extra, teacher)))
    records = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {"run_dir": str(res.run_dir),
            "train": [_train_keys(r) for r in records if r.get("kind") == "train"],
            "eval": [_keep(r, EVAL_KEYS, EVAL_PREFIXES) for r in records if r.get("kind") == "eval"]}


def _api_cases() -> dict:
    """``eslm.api.selective_loss`` on fixed random inputs (logits and hidden routes, ignored tokens), as
    pseudo-runs of one record each: the loss, its gradient's sum and every selection statistic."""
    import torch

    from eslm.api import selective_loss

    out = {}
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 40, 16, generator=g)
    weight = torch.randn(70, 16, generator=g)
    targets = torch.randint(0, 70, (3, 40), generator=g)
    targets[0, :7] = -100
    for score in ("entropy", "loss"):
        for alpha in (0.0, 0.29, 0.5):
            for route in ("logits", "hidden"):
                h = hidden.clone().requires_grad_(True)
                kw = {"logits": h @ weight.t()} if route == "logits" else {"hidden": h, "lm_weight": weight}
                loss, st = selective_loss(targets, score=score, alpha=alpha, chunk_size=32, **kw)
                loss.backward()
                rec = {"loss": float(loss.detach()), "grad_sum": float(h.grad.double().sum()),
                       "grad_abs_sum": float(h.grad.double().abs().sum())}
                rec.update({k: float(v) for k, v in vars(st).items() if v is not None})
                out[f"api/{route}/{score}/alpha={alpha}"] = {"train": [rec], "eval": []}
    return out


def record(only: list[str] | None = None) -> dict:
    """Run every registered method (and the variants) and return {run name: {"train": [...], "eval": [...]}}."""
    import contextlib
    import io

    import torch

    from eslm.data.prepare import prepare
    from eslm.methods import METHODS

    torch.set_num_threads(1)
    runs = [(m, m, {}) for m in METHODS]
    runs.sort(key=lambda r: r[0] != "clm")  # CLM first: its checkpoint is the reference / teacher
    runs += VARIANTS_EXTRA
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="eslm-guard-") as tmp:
        root = Path(tmp)
        data = root / "prepared"
        with contextlib.redirect_stdout(io.StringIO()):
            prepare("text", data, tokenizer="byte", paths=_write_corpus(root / "text"), progress=False, workers=1)
        teacher = ""
        for name, method, extra in runs:
            if only and name not in only and name != "clm":
                continue
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                run = _run(data, root / "runs", name, method, extra, teacher)
            if name == "clm":
                teacher = run["run_dir"]
            del run["run_dir"]
            out[name] = run
            print(f"{name:<40} {time.perf_counter() - t0:5.1f} s", file=sys.stderr)
    if not only:
        out.update(_api_cases())
    return out


def _same(a, b) -> bool:
    """Bit-identical floats (NaN equal to NaN), equal everything else."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    return a == b and type(a) is type(b)


def differences(want: dict, got: dict) -> list[str]:
    """Every difference between two recordings, as 'run/record i/key: want -> got' lines."""
    out = []
    for name in sorted(set(want) | set(got)):
        if name not in got or name not in want:
            out.append(f"{name}: {'missing now' if name not in got else 'not in the baseline'}")
            continue
        for part in ("train", "eval"):
            w, g = want[name][part], got[name][part]
            if len(w) != len(g):
                out.append(f"{name}/{part}: {len(w)} records in the baseline, {len(g)} now")
            for i, (rw, rg) in enumerate(zip(w, g)):
                for key in sorted(set(rw) | set(rg)):
                    if key not in rw or key not in rg or not _same(rw[key], rg[key]):
                        out.append(f"{name}/{part}[{i}]/{key}: {rw.get(key, '<absent>')!r} -> "
                                   f"{rg.get(key, '<absent>')!r}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the recording (default: %(default)s)")
    p.add_argument("--check", metavar="FILE", help="compare a fresh recording with FILE instead of writing one")
    p.add_argument("--only", nargs="*", help="record only these runs (plus clm, the teacher); for debugging")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    got = record(args.only)
    if args.check:
        want = json.loads(Path(args.check).read_text())["runs"]
        if args.only:
            want = {k: v for k, v in want.items() if k in got}
        diffs = differences(want, got)
        print(f"{len(got)} runs in {time.perf_counter() - t0:.1f} s: ", end="")
        if diffs:
            print(f"{len(diffs)} difference(s) against {args.check}:")
            print("\n".join("  " + d for d in diffs))
            return 1
        print(f"bit-identical to {args.check}")
        return 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"steps": STEPS, "runs": got}, indent=1) + "\n")
    print(f"{len(got)} runs in {time.perf_counter() - t0:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
