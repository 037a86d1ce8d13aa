"""Benchmark: one training step of EVERY registered method against CLM, in ONE run (round-robin).

Each method runs with its defaults (method.alpha 0.1, KD lambda 0.5 / rho 1, GREATS floor budget with a
validation batch of half the micro-batch) through the shared step. The Rho-1 reference and the KD teacher are
checkpoints of an untrained model of the same preset, written to a temporary directory (their cost, not their
quality, matters here; the paper's KD teacher is smaller than its student, which would make KD cheaper).
Prints step time and peak step memory relative to CLM (fused loss, the default) and writes them to
benchmarks/results/methods-<preset>-<device>-<dtype>-T<seq>-B<mb>.{json,md}.

    python benchmarks/methods.py --preset small --seq-len 128 --micro-batch 16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from harness import Bench, Variant, environment, fmt_mb, fmt_ratio, median, run_and_measure, write_results  # noqa: E402


class RandomLoader:
    """Validation windows for GREATS: fixed-seed random tokens, with the loader's state interface."""

    def __init__(self, rows: int, seq_len: int, device: torch.device):
        from eslm.data.batch import Batch

        g = torch.Generator().manual_seed(7)
        x = torch.randint(0, 50257, (rows, seq_len + 1), generator=g)
        self.micro_batch_size_seqs = rows
        self.batch = Batch(x=x[:, :-1].contiguous(), y=x[:, 1:].contiguous(),
                           domain=torch.zeros(rows, dtype=torch.long)).to(device)

    def next_batch(self):
        return self.batch

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


def frozen_checkpoint(bench: Bench, path: Path) -> str:
    """A checkpoint of an (untrained) model of the bench's preset, as eslm.model.loading reads it."""
    from eslm.train.checkpoint import CHECKPOINT_FORMAT

    sd = {k: v.detach().cpu().clone() for k, v in bench.raw.state_dict().items()}
    torch.save({"format": CHECKPOINT_FORMAT, "model": sd, "model_config": bench.model_config.to_dict(),
                "tokenizer": "gpt2", "step": 0}, path)
    return str(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per micro-step")
    p.add_argument("--steps", type=int, default=5, help="timed rounds (each runs every method once)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--methods", nargs="*", help="subset of the registry (default: all)")
    p.add_argument("--name", default="")
    p.add_argument("--memory-only", default="", help=argparse.SUPPRESS)  # internal: the CPU memory child
    a = p.parse_args(argv)
    from eslm.methods import METHODS

    device = torch.device(a.device)
    bench = Bench(preset=a.preset, seq_len=a.seq_len, micro_batch=a.micro_batch, device=a.device, dtype=a.dtype,
                  context={"val_loader_factory": lambda rows: RandomLoader(rows, a.seq_len, device)})
    tmp = tempfile.TemporaryDirectory()
    frozen = frozen_checkpoint(bench, Path(tmp.name) / "frozen.pt")
    names = a.methods or list(METHODS)
    vs = [Variant("clm-naive", {"method.name": "clm", "train.loss_impl": "naive"})]
    vs += [Variant(n, {"method.name": n, **{need.key: frozen for need in METHODS[n].frozen_models}}) for n in names]
    print(f"methods benchmark: {a.preset}, {a.micro_batch}x{a.seq_len} tokens/micro-step, {a.device} {a.dtype}, "
          f"{torch.get_num_threads()} threads, {len(vs)} variants x ({a.warmup} warm-up + {a.steps}) rounds",
          flush=True)
    if not run_and_measure(bench, vs, a, argv):
        return 0  # the memory child's work is done

    by = {v.label: v for v in vs}
    clm = by["clm"]
    t_clm, m_clm = median(clm.times), median(clm.peaks)
    rows = [{"method": v.label, "step_s": median(v.times), "peak_bytes": median(v.peaks),
             "kept_frac": median(v.kept), "time_vs_clm": median(v.times) / t_clm,
             "mem_vs_clm": (median(v.peaks) / m_clm) if m_clm and v.peaks else None} for v in vs]
    name = a.name or f"methods-{a.preset}-{a.device.split(':')[0]}-{a.dtype}-T{a.seq_len}-B{a.micro_batch}"
    cmd = "python benchmarks/methods.py " + " ".join(argv if argv is not None else sys.argv[1:])
    payload = {"command": cmd.strip(), "settings": vars(a), "environment": environment(bench), "rows": rows}
    md = [f"# Every method against CLM: {a.preset}, {a.micro_batch}x{a.seq_len} tokens, {a.device} {a.dtype}", "",
          f"Command: `{payload['command']}`  ", f"Environment: {payload['environment']}  ",
          f"Median of {a.steps} round-robin rounds after {a.warmup} warm-up; peak = step's peak memory above "
          "what was resident before it (MB). CLM = the default fused loss; clm-naive = full logits.", "",
          "| method | kept | step s | time vs CLM | peak MB | memory vs CLM |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['method']} | {r['kept_frac']:.3f} | {r['step_s']:.3f} | {fmt_ratio(r['time_vs_clm'])} | "
                  f"{fmt_mb(r['peak_bytes'])} | {fmt_ratio(r['mem_vs_clm'])} |")
    write_results(name, payload, md)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
