"""Benchmark: the selective loss path, naive (full logits, the paper's way) against fused, in ONE run.

Variants (real training steps through the shared step, round-robin, median after warm-up):
CLM naive, CLM fused, and at each alpha: ESLM-entropy naive, ESLM-entropy fused on the route the chooser picks
(eslm.ops.head_route), ESLM-entropy fused with each head route forced (``eslm-entropy-fused[ROUTE]@alpha``:
kept_cached, all_rows, grads_in_pass, kept_recompute; --routes), ESLM-loss fused.
Prints and writes ratios against CLM naive and CLM fused, peak step memory, the route each variant ran (the
forced routes measure what the rule of eslm.ops.head_route picks against the others), and the cost of computing the scores, the VaR threshold and the mask (the entropy's extra
work in the head pass + the top-k selection and its statistics) as a fraction of the CLM fused step. Each row
also has tokens/s and MFU (``harness.peak_flops``: the trainer's table by GPU name, or --peak-flops; none on
CPU unless given).

    python benchmarks/loss_path.py --preset small --seq-len 128 --micro-batch 4 --steps 11
    python benchmarks/loss_path.py --preset gpt2-124m --seq-len 1024 --micro-batch 1 --steps 5
    python benchmarks/loss_path.py --preset gpt2-124m --seq-len 1024 --micro-batch 12 --device cuda --dtype bf16
    python benchmarks/loss_path.py --preset gpt2-124m --seq-len 1024 --micro-batch 12 --device cuda --dtype bf16 \
        --compile

Results: benchmarks/results/loss_path-<preset>-<device>-<dtype>-T<seq>-B<mb>[-compile].{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from eslm.ops.head_route import ROUTES  # noqa: E402  (the head routes, named once)
from harness import (  # noqa: E402
    Bench,
    Variant,
    environment,
    fmt_mb,
    fmt_ratio,
    median,
    peak_flops,
    run_and_measure,
    sync,
    write_results,
)


def variants(alphas: list[float], chunk: int, routes=ROUTES, gpu_backend: bool = False) -> list[Variant]:
    """CLM naive / fused; per alpha: ESLM-entropy naive, fused with the chooser's route (``auto``), fused with
    each route of ``routes`` forced (``eslm-entropy-fused[route]@alpha``), ESLM-loss fused (auto). With
    ``gpu_backend`` (a CUDA device with the gpu extra) also CLM, ESLM-entropy and ESLM-loss on the triton head
    backend (the default there)."""
    c = {"train.loss_chunk_size": chunk}
    fused = {"train.loss_impl": "fused", **c}  # named: "auto" is the triton backend on CUDA
    vs = [Variant("clm-naive", {"method.name": "clm", "train.loss_impl": "naive", **c}, "clm"),
          Variant("clm-fused", {"method.name": "clm", **fused}, "clm")]
    if gpu_backend:
        vs.append(Variant("clm-triton", {"method.name": "clm", "train.loss_impl": "triton", **c}, "clm"))
    for a in alphas:
        base = {"method.alpha": a, **fused}
        vs.append(Variant(f"eslm-entropy-naive@{a}", {"method.name": "eslm-entropy", **base,
                                                      "train.loss_impl": "naive"}, f"alpha {a}"))
        vs.append(Variant(f"eslm-entropy-fused@{a}", {"method.name": "eslm-entropy", **base}, f"alpha {a}"))
        for r in routes:
            vs.append(Variant(f"eslm-entropy-fused[{r}]@{a}", {"method.name": "eslm-entropy",
                                                              "train.loss_route": r, **base}, f"alpha {a}"))
        vs.append(Variant(f"eslm-loss-fused@{a}", {"method.name": "eslm-loss", **base}, f"alpha {a}"))
        if gpu_backend:
            for m in ("eslm-entropy", "eslm-loss"):
                vs.append(Variant(f"{m}-triton@{a}", {"method.name": m, **base, "train.loss_impl": "triton"},
                                  f"alpha {a}"))
    return vs


def route_of(bench: Bench, v: Variant) -> str | None:
    """The route a variant's micro-batches take (the chooser's, or the forced one; the triton backend's own:
    ``cached_logits`` after a scoring pass, ``kept_only`` without one); None for the naive path."""
    cfg, method = bench.method(v)
    if cfg.train.loss_impl == "naive":
        return None
    return method.objective.last_route


def selection_overhead(bench: Bench, alphas: list[float], chunk: int, reps: int) -> dict:
    """Seconds per micro-batch of what selection adds to the loss the step computes anyway, each timed on its
    own (a difference of two whole-pass timings drowns in this machine's noise): the entropy, and the
    selector's top-k + stats. The entropy's work depends on the route: with fp32 matmuls it is
    H = lse - h . (P W), where P W is the hidden-state gradient's matmul, formed either way, so its cost is the
    (N, C) row dot; otherwise the pass keeps the logits beside the softmax for a batched dot per row over
    (N, V). The pass and the gradients themselves are not counted: CLM runs them too."""
    from eslm.ops.fused_head import _rowdot, _scratch_rows, compute_dtype, head_pass
    from eslm.selection.risk import num_kept

    batch = bench.batches[0]
    autocast = bench.autocast() or contextlib.nullcontext()  # the pass runs in the step's precision (bf16 on GPU)
    _, auto = bench.method(Variant(f"eslm-entropy-fused@{alphas[0]}", {}))
    with torch.no_grad(), autocast:
        hidden = bench.raw(batch.x).flatten(0, 1)
        w, y = bench.raw.head_weight.detach(), batch.y.reshape(-1)
        route = auto.objective.head(hidden).choose(hidden.shape[0], num_kept(hidden.shape[0], alphas[0]),
                                                   scored=True)
        stats = head_pass(hidden, w, y, need_entropy=True, keep_probs=True, softmax_w=route == "all_rows",
                          chunk_size=chunk)
        cdt = compute_dtype(hidden)
    if stats.softmax_w is not None:
        route = f"{route}, fp32: lse - h . (P W)"
        h_c = hidden.float()

        def entropy():
            return stats.lse - _rowdot(h_c, stats.softmax_w)
    else:
        route = (f"{route}: shifted sum with the logits, through a scratch block "
                 f"({str(cdt).replace('torch.', '')} matmul)")
        z = (hidden.to(cdt) @ w.to(cdt).t()).float()
        scratch = torch.empty(_scratch_rows(z.shape[0], w.shape[1]), z.shape[1], device=z.device)
        m = z.amax(-1, keepdim=True)

        def entropy():  # what the pass adds for the entropy: the shifted logits and their product with exp
            for s in range(0, z.shape[0], scratch.shape[0]):
                e = min(s + scratch.shape[0], z.shape[0])
                t = torch.sub(z[s:e], m[s:e], out=scratch[: e - s])
                t.mul_(stats.probs[s:e]).sum(-1)

    def timed(fn) -> float:
        fn()
        ts = []
        for _ in range(reps):
            sync(bench.device)
            t0 = time.perf_counter()
            fn()
            sync(bench.device)
            ts.append(time.perf_counter() - t0)
        return median(ts)

    t_ent = timed(entropy)
    out = {}
    for a in alphas:
        _, method = bench.method(Variant(f"eslm-entropy-fused@{a}", {}))

        def select(method=method):
            sel = method.tokens.select(stats, batch)
            float(sel.stats.threshold)  # wait for the work

        out[a] = {"entropy_s": t_ent, "select_s": timed(select), "route": route}
    return out


def naive_twin_label(label: str) -> str:
    """The variant a row's "vs naive twin" columns divide by: the same method on the naive path (logits
    materialised), at the same alpha; ESLM-loss's is ESLM-entropy's (the naive path scores both alike). A fused or
    triton row is compared with the naive path, never with itself."""
    return (re.sub(r"\[.*\]", "", label).replace("-fused", "-naive").replace("-triton", "-naive")
            .replace("eslm-loss", "eslm-entropy"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per micro-step")
    p.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.2, 0.5])
    p.add_argument("--steps", type=int, default=5, help="timed rounds (each runs every variant once)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--compile", action="store_true", help="torch.compile the model (warm-up rounds compile it)")
    p.add_argument("--peak-flops", type=float, default=0.0,
                   help="peak FLOP/s for MFU (default: the trainer's table by GPU name; none on CPU)")
    p.add_argument("--chunk", type=int, default=1024, help="train.loss_chunk_size for the fused path")
    p.add_argument("--routes", nargs="*", default=list(ROUTES), choices=list(ROUTES),
                   help="routes forced as extra ESLM-entropy variants (default: all four)")
    p.add_argument("--name", default="", help="results file name (default from the settings)")
    p.add_argument("--no-cpu-memory", action="store_true",
                   help="on CPU, skip the peak-memory child process (peaks n/a; the GPU suite's smoke mode)")
    p.add_argument("--memory-only", default="", help=argparse.SUPPRESS)  # internal: the CPU memory child
    a = p.parse_args(argv)

    bench = Bench(preset=a.preset, seq_len=a.seq_len, micro_batch=a.micro_batch, device=a.device, dtype=a.dtype,
                  compile=a.compile)
    from eslm.ops.head_backend import available

    vs = variants(a.alphas, a.chunk, a.routes, gpu_backend=a.device.startswith("cuda") and available("triton"))
    tokens = a.seq_len * a.micro_batch
    print(f"loss-path benchmark: {a.preset}, {a.micro_batch}x{a.seq_len} = {tokens} tokens/step, {a.device} "
          f"{a.dtype}{' compiled' if a.compile else ''}, {torch.get_num_threads()} threads, {len(vs)} variants x "
          f"({a.warmup} warm-up + {a.steps}) rounds", flush=True)
    if not run_and_measure(bench, vs, a, argv):
        return 0  # the memory child's work is done
    overhead = selection_overhead(bench, a.alphas, a.chunk, reps=max(10, a.steps))

    by = {v.label: v for v in vs}
    t_naive, t_fused = median(by["clm-naive"].times), median(by["clm-fused"].times)
    m_naive, m_fused = median(by["clm-naive"].peaks), median(by["clm-fused"].peaks)
    peak, peak_source = peak_flops(bench.device, a.peak_flops)
    rows = []
    for v in vs:
        t, m = median(v.times), median(v.peaks)
        tok_s = tokens / t
        naive_twin = by.get(naive_twin_label(v.label))
        rows.append({"variant": v.label, "route": route_of(bench, v), "step_s": t, "peak_bytes": m,
                     "kept_frac": median(v.kept),
                     "tokens_per_s": tok_s, "mfu": tok_s * bench.flops_per_token / peak if peak else None,
                     "time_vs_clm_naive": t / t_naive, "time_vs_clm_fused": t / t_fused,
                     "mem_vs_clm_naive": (m / m_naive) if m and m_naive else None,
                     "mem_vs_clm_fused": (m / m_fused) if m and m_fused else None,
                     "time_vs_naive_twin": t / median(naive_twin.times) if naive_twin else None,
                     "mem_vs_naive_twin": (m / median(naive_twin.peaks)) if naive_twin and m else None})
    for o in overhead.values():
        o["fraction_of_clm_fused_step"] = (o["entropy_s"] + o["select_s"]) / t_fused

    name = a.name or (f"loss_path-{a.preset}-{a.device.split(':')[0]}-{a.dtype}-T{a.seq_len}-B{a.micro_batch}"
                      + ("-compile" if a.compile else ""))
    cmd = "python benchmarks/loss_path.py " + " ".join(argv if argv is not None else sys.argv[1:])
    payload = {"command": cmd.strip(), "settings": vars(a), "tokens_per_step": tokens,
               "environment": environment(bench), "flops_per_token": bench.flops_per_token,
               "peak_flops": peak, "peak_source": peak_source, "rows": rows,
               "selection_overhead": {str(k): v for k, v in overhead.items()}}
    md = [f"# Loss-path benchmark: {a.preset}, {a.micro_batch}x{a.seq_len} tokens, {a.device} {a.dtype}"
          f"{', torch.compile' if a.compile else ''}", "",
          f"Command: `{payload['command']}`  ",
          f"Environment: {payload['environment']}  ",
          f"Median of {a.steps} round-robin rounds after {a.warmup} warm-up; peak = step's peak memory above "
          "what was resident before it (MB). Route: the head route the variant ran (eslm.ops.head_route). "
          "MFU: tokens/s x "
          f"{bench.flops_per_token:.4g} FLOPs/token / peak ({peak_source}).", "",
          "| variant | route | kept | step s | tokens/s | MFU | vs CLM naive | vs CLM fused "
          "| vs naive twin | peak MB | mem vs CLM naive | mem vs naive twin |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        md.append(f"| {r['variant']} | {r['route'] or 'naive'} | {r['kept_frac']:.3f} | {r['step_s']:.4f} | "
                  f"{r['tokens_per_s']:,.0f} | {mfu} | {fmt_ratio(r['time_vs_clm_naive'])}"
                  f" | {fmt_ratio(r['time_vs_clm_fused'])} | "
                  f"{fmt_ratio(r['time_vs_naive_twin'])} | "
                  f"{fmt_mb(r['peak_bytes'])} | {fmt_ratio(r['mem_vs_clm_naive'])} | "
                  f"{fmt_ratio(r['mem_vs_naive_twin'])} |")
    md += ["", "Scores + threshold + mask (per micro-batch; fraction of the CLM fused step):", "",
           "| alpha | route | entropy s | top-k + stats s | fraction |", "|---|---|---|---|---|"]
    for alpha, o in overhead.items():
        md.append(f"| {alpha} | {o['route']} | {o['entropy_s']:.4f} | {o['select_s']:.4f} | "
                  f"{100 * o['fraction_of_clm_fused_step']:.2f}% |")
    write_results(name, payload, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
