"""Benchmark: whole training runs, interleaved, CLM against ESLM, in process CPU time (issue 22).

Each arm is a real `eslm train` process (the `small` preset by default: 4 x 128 tokens per step, 60 steps,
fp32, CPU, no evaluation until the end, no checkpoints until the end) on the built-in stdlib corpus. The arms
run one after the other in rounds, A B C then C B A then A B C ..., so a slow spell of the machine or a drift
hits every arm alike; each round gives one ratio per arm against the CLM run of the same round. The figure is
the training's process CPU seconds (`cpu_s` of the run's result.json: user + system over all threads, the
training steps only, evaluation and start-up excluded); wall-clock is recorded too.

    python benchmarks/whole_runs.py                       # 6 rounds of clm, eslm-loss@0.5, eslm-loss@0.2
    python benchmarks/whole_runs.py --rounds 5 --arms clm eslm-loss@0.5 eslm-entropy@0.1 --steps 60
    python benchmarks/whole_runs.py --threads 1 --arms clm eslm-h-entropy@0.1 random-instance clm/b8 \
        --set method.instance.beta=0.5 --name whole_runs-instance-small-T128-B4-S60-threads1   # issue 46

An arm is ``method[@alpha][/bN]``: ``/bN`` trains N sequences per micro-batch instead of ``--micro-batch`` (CLM on
all the candidates that instance selection reads: ``clm/b8`` beside ``eslm-h-entropy`` at beta 0.5 and 4).
Instance-level selection (``eslm-h-*``, ``random-instance``, ``random-h``: a row selector that reads more
micro-batches than it trains) gets its bound from the executed FLOPs the trainer plans for it (the exit over every
candidate, the kept rows' step), and no profile.

Results: benchmarks/results/whole_runs-<preset>-T<seq>-B<mb>-S<steps>.{json,md}: per-round CPU seconds, the
ratios against CLM with their median and range, the ratio of the medians, and the bound: what the ratio can be
at best for the preset, from the executed FLOPs (only the LM head's two gradient matmuls shrink with alpha;
the trunk's backward runs on every token), with the arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the eslm command line does

from harness import write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def parse_arm(arm: str) -> tuple[str, float]:
    """'clm' -> ('clm', 0.0); 'eslm-loss@0.5' -> ('eslm-loss', 0.5); 'clm/b8' -> ('clm', 0.0)."""
    name, _, alpha = arm.split("/b")[0].partition("@")
    return name, float(alpha) if alpha else 0.0


def arm_batch(a, arm: str) -> int:
    """Sequences per micro-batch of an arm: N of '/bN', else --micro-batch."""
    _, _, rows = arm.partition("/b")
    return int(rows) if rows else a.micro_batch


def run_name(arm: str) -> str:
    return arm.replace("@", "_a").replace("/b", "_b")


def overrides(a, arm: str, data_dir: str, out_dir: str) -> list[str]:
    name, alpha = parse_arm(arm)
    ov = [f"method.name={name}", f"model.preset={a.preset}", f"data.dir={data_dir}", "data.tokenizer=gpt2",
          f"data.seq_len={a.seq_len}", f"train.micro_batch_size_seqs={arm_batch(a, arm)}", "train.grad_accum_steps=1",
          f"train.max_steps={a.steps}", "train.warmup_steps=10", "train.device=cpu", "train.dtype=fp32",
          f"train.num_threads={a.threads}", "eval.interval=0", "eval.tokens_per_domain=256",
          "eval.batch_size_seqs=2", "checkpoint.interval=0", "log.interval=1000", "log.tensorboard=false",
          f"run.out_dir={out_dir}", f"run.name={run_name(arm)}", "run.seed=1"]
    if alpha:
        ov.append(f"method.alpha={alpha}")
    return ov + list(a.set)


def run_one(a, arm: str, data_dir: str, work: Path, i: int) -> dict:
    out_dir = work / f"round{i}"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "eslm.cli", "train", *overrides(a, arm, data_dir, str(out_dir))],
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: the {arm} run of round {i} failed:\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    res = json.loads((out_dir / run_name(arm) / "result.json").read_text())
    load = (res.get("load_avg") or {})
    return {"cpu_s": res["cpu_s"], "train_wall_s": res["elapsed_s"], "process_wall_s": wall, "step": res["step"],
            "flops_executed": res.get("flops_executed"), "flops_dense": res.get("flops_dense"),
            "load_avg": load.get("mean_1m") if isinstance(load, dict) else None}


def planned_step(a, arm: str) -> tuple[float, object]:
    """(executed FLOPs of one optimizer step of the arm as the trainer plans it, its built method)."""
    import torch

    from eslm.config import build_config, method_context, model_config_for, training_flops_model
    from eslm.methods import build_method
    from eslm.train.optim import planned_micro_batch_flops

    name, alpha = parse_arm(arm)
    cfg = build_config(overrides=[f"method.name={name}", f"method.alpha={alpha}", f"model.preset={a.preset}",
                                  "data.tokenizer=gpt2", f"data.seq_len={a.seq_len}", "train.grad_accum_steps=1",
                                  f"train.micro_batch_size_seqs={arm_batch(a, arm)}",
                                  "flops.budget_counter=flops_executed",
                                  *(s for s in a.set if s.startswith(("method.", "train.loss")))])
    method = build_method(method_context(cfg, device=torch.device("cpu"), n_domains=3,
                                         model_config=model_config_for(cfg)))
    return planned_micro_batch_flops(cfg, method, training_flops_model(cfg)), method


def reads_more(a, arm: str) -> bool:
    """Whether the arm's row selector reads more micro-batches than it trains (instance-level selection)."""
    return planned_step(a, arm)[1].rows.candidate_batches(1) > 1


def planned_bound(a, arm: str) -> dict:
    """The ratio by the executed FLOPs the trainer plans per optimizer step (every declared pass: an exit over
    the candidates, the kept rows' step, the head's rows), against CLM at --micro-batch."""
    flops, method = planned_step(a, arm)
    clm, _ = planned_step(a, "clm")
    exit_flops = 0.0
    if reads_more(a, arm):
        from eslm.config import build_config, training_flops_model
        from eslm.flops import extra_flops

        fm = training_flops_model(build_config(overrides=[f"model.preset={a.preset}", "data.tokenizer=gpt2",
                                                          f"data.seq_len={a.seq_len}"]))
        exit_flops = extra_flops([method.rows.extra_work(arm_batch(a, arm) * a.seq_len)], fm)[1]
    return {"flops_ratio": flops / clm, "head_share": None,
            "arithmetic": (f"executed FLOPs per step {flops:.4g} against CLM's {clm:.4g} at {a.micro_batch} "
                           f"sequences: {flops / clm:.4f}"
                           + (f"; of it the exit over every candidate {exit_flops:.4g} ({exit_flops / clm:.3f} of "
                              f"CLM's step), against training every candidate with CLM: "
                              f"{flops / (clm * method.rows.candidate_batches(1)):.4f}" if exit_flops else ""))}


def bound(a, arm: str) -> dict:
    """The best ratio the route can reach for the preset, by executed FLOPs (eslm.flops): forward on every token,
    the trunk backward on every token, the head backward (4CV per token) on the kept tokens only. An arm at another
    batch (/bN) or one that selects sequences (instance selection): ``planned_bound``."""
    from eslm.flops import FlopsModel, step_flops
    from eslm.model.gpt import preset
    from eslm.selection.risk import num_kept

    if "/b" in arm or reads_more(a, arm):
        return planned_bound(a, arm)
    name, alpha = parse_arm(arm)
    cfg = preset(a.preset, vocab_size=50304)
    fm = FlopsModel.from_config(cfg, a.seq_len)
    n = a.seq_len * a.micro_batch
    k = num_kept(n, alpha)
    s = step_flops(fm, tokens_seen=n, tokens_kept=k, head_backward_tokens=k)
    head = fm.head_forward_per_token + fm.head_backward_per_token
    share = head / fm.train_per_token
    return {"flops_ratio": s.executed / s.dense, "head_share": share,
            "arithmetic": (f"head 6CV = 6*{cfg.n_embd}*{cfg.vocab_size} = {head:.4g} of {fm.train_per_token:.4g} "
                           f"FLOPs/token ({100 * share:.1f}%); its gradient matmuls are 2/3 of it, skipped for "
                           f"alpha = {alpha} of the tokens ({n - k} of {n}): 1 - {alpha} * 2/3 * {share:.4f} = "
                           f"{1 - alpha * 2 / 3 * share:.4f} (exact count {s.executed / s.dense:.4f})")}


def profile_steps(a, reps: int = 3) -> dict:
    """Where a step's time goes, per arm, in this process (torch.profiler, CPU; ``reps`` profiled steps after
    two warm-up steps of the same model and random batches, the median of each category): the LM head's
    matmuls (an operand with the vocabulary's width), the head's other work (softmax, loss, the optimizer's
    update of the (V, C) embedding), the compaction of the kept rows, and the rest (trunk, optimizer).
    Self CPU time of the main thread, ms."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from harness import Bench, Variant

    if a.threads:  # as the runs (train.num_threads)
        torch.set_num_threads(a.threads)
    bench = Bench(preset=a.preset, seq_len=a.seq_len, micro_batch=a.micro_batch)
    vocab = bench.model_config.vocab_size
    out = {}
    for arm in a.arms:
        if "/b" in arm or reads_more(a, arm):  # another batch, or more micro-batches read than trained: not here
            continue
        name, alpha = parse_arm(arm)
        v = Variant(arm, {"method.name": name, **({"method.alpha": alpha} if alpha else {})})
        bench.step(v), bench.step(v)
        per = []
        for _ in range(reps):
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                bench.step(v)
            cats = {"head matmuls": 0.0, "head compaction": 0.0, "head other": 0.0, "rest": 0.0}
            for e in prof.key_averages(group_by_input_shape=True):
                head = str(vocab) in str(e.input_shapes)
                if head and e.key in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm"):
                    cats["head matmuls"] += e.self_cpu_time_total
                elif head and e.key in ("aten::index_select", "aten::index_copy_"):
                    cats["head compaction"] += e.self_cpu_time_total
                else:
                    cats["head other" if head else "rest"] += e.self_cpu_time_total
            per.append(cats)
        out[arm] = {k: statistics.median(c[k] for c in per) / 1e3 for k in per[0]}
        out[arm]["step"] = sum(out[arm][k] for k in per[0])
    return out


def time_bound(prof: dict, base: str, arm: str) -> dict:
    """The bound from the baseline's profile: of its head matmuls (the logits and the two gradient matmuls, equal
    FLOPs), the gradient two thirds shrink with the kept fraction; everything else stays."""
    alpha = parse_arm(arm)[1]
    b = prof[base]
    share = b["head matmuls"] / b["step"]
    return {"time_ratio": 1 - alpha * 2 / 3 * share,
            "arithmetic": f"head matmuls {b['head matmuls']:.0f} of {b['step']:.0f} ms of a {base} step "
                          f"({100 * share:.1f}%): 1 - {alpha} * 2/3 * {share:.4f} = {1 - alpha * 2 / 3 * share:.4f}"}


def prepare_data(a, work: Path) -> str:
    if a.data:
        return a.data
    out = work / "data"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print(f"preparing the stdlib corpus in {out} ...", flush=True)
    subprocess.run([sys.executable, "-m", "eslm.cli", "prepare", "stdlib", "--tokenizer", "gpt2", "--out", str(out)],
                   env=env, check=True, capture_output=True)
    return str(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", nargs="+", default=["clm", "eslm-loss@0.5", "eslm-loss@0.2"],
                   help="method[@alpha] per arm; the first is the baseline of the ratios")
    p.add_argument("--rounds", type=int, default=6, help="rounds (each runs every arm once)")
    p.add_argument("--preset", default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=0, help="train.num_threads (0: torch's default)")
    p.add_argument("--data", default="", help="a prepared corpus directory (default: prepare stdlib in a temp dir)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="further overrides for every arm")
    p.add_argument("--profile-reps", type=int, default=3, help="profiled steps per arm in-process (0: none)")
    p.add_argument("--name", default="", help="results file name (default from the settings)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1; found {a.rounds}")
    cmd = "python benchmarks/whole_runs.py " + " ".join(argv if argv is not None else sys.argv[1:])
    t_start = time.perf_counter()
    runs: dict[str, list[dict]] = {arm: [] for arm in a.arms}
    with tempfile.TemporaryDirectory(prefix="eslm-whole-runs-") as tmp:
        work = Path(tmp)
        data = prepare_data(a, work)
        for i in range(a.rounds):
            order = a.arms if i % 2 == 0 else a.arms[::-1]
            for arm in order:
                r = run_one(a, arm, data, work, i)
                runs[arm].append(r)
                print(f"round {i + 1}/{a.rounds} {arm:18s} cpu {r['cpu_s']:7.2f} s  wall {r['train_wall_s']:7.2f} s"
                      f"  load {r['load_avg'] if r['load_avg'] is not None else float('nan'):.2f}", flush=True)
    base = a.arms[0]
    prof = profile_steps(a, a.profile_reps) if a.profile_reps > 0 else {}
    summary = {}
    for arm in a.arms:
        ratios = [r["cpu_s"] / b["cpu_s"] for r, b in zip(runs[arm], runs[base])]
        wall = [r["train_wall_s"] / b["train_wall_s"] for r, b in zip(runs[arm], runs[base])]
        med = statistics.median(r["cpu_s"] for r in runs[arm])
        summary[arm] = {"median_cpu_s": med, "ratios": ratios, "median_ratio": statistics.median(ratios),
                        "min_ratio": min(ratios), "max_ratio": max(ratios),
                        "ratio_of_medians": med / statistics.median(r["cpu_s"] for r in runs[base]),
                        "median_wall_ratio": statistics.median(wall), "bound": bound(a, arm),
                        "time_bound": time_bound(prof, base, arm) if prof and arm in prof else None}
    minutes = (time.perf_counter() - t_start) / 60
    payload = {"command": cmd.strip(), "settings": vars(a), "runs": runs, "summary": summary, "profile_ms": prof,
               "minutes": minutes, "load_avg_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    name = a.name or f"whole_runs-{a.preset}-T{a.seq_len}-B{a.micro_batch}-S{a.steps}"
    md = [f"# Whole runs, interleaved: {', '.join(a.arms)} ({a.preset}, {a.micro_batch}x{a.seq_len} tokens, "
          f"{a.steps} steps, CPU fp32)", "", f"Command: `{payload['command']}`  ",
          f"{a.rounds} rounds (orders alternate A B C / C B A), {minutes:.1f} min in all. Ratio = the arm's "
          f"training CPU seconds / {base}'s in the same round. Bound = executed FLOPs / CLM's (the head's "
          "gradient matmuls skipped for the dropped tokens; nothing else shrinks; for an arm at another batch "
          "(/bN) or one that selects sequences, the executed FLOPs the trainer plans for its step, the exit over "
          "every candidate included); bound (profile) = the same "
          f"from the measured share of the head's matmuls in a {base} step (below).", "",
          f"| arm | median CPU s | ratio vs {base}: median | range | ratio of medians | wall ratio (median) | "
          "bound (executed FLOPs) | bound (profile) | mean load |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, s in summary.items():
        loads = [r["load_avg"] for r in runs[arm] if r["load_avg"] is not None]
        md.append(f"| {arm} | {s['median_cpu_s']:.2f} | {s['median_ratio']:.3f} | {s['min_ratio']:.3f}-"
                  f"{s['max_ratio']:.3f} | {s['ratio_of_medians']:.3f} | {s['median_wall_ratio']:.3f} | "
                  f"{s['bound']['flops_ratio']:.3f} | "
                  f"{s['time_bound']['time_ratio'] if s['time_bound'] else float('nan'):.3f} | "
                  f"{statistics.mean(loads) if loads else float('nan'):.2f} |")
    md += ["", "Per round, CPU s: " + "; ".join(f"{arm}: " + ", ".join(f"{r['cpu_s']:.2f}" for r in runs[arm])
                                                for arm in a.arms), "", "Bounds:"]
    md += [f"- {arm}: {s['bound']['arithmetic']}" for arm, s in summary.items()
           if parse_arm(arm)[1] or s["bound"]["head_share"] is None]
    md += [f"- {arm}, from the profile: {s['time_bound']['arithmetic']}" for arm, s in summary.items()
           if parse_arm(arm)[1] and s["time_bound"]]
    if prof:
        cats = [k for k in next(iter(prof.values())) if k != "step"]
        md += ["", f"Where a step's time goes (torch.profiler, self CPU ms of the main thread, median of "
               f"{a.profile_reps} steps per arm in one process after two warm-up steps):", "",
               "| arm | step ms | " + " | ".join(cats) + " |", "|---|---|" + "---|" * len(cats)]
        md += [f"| {arm} | {c['step']:.0f} | " + " | ".join(f"{c[k]:.0f} ({100 * c[k] / c['step']:.0f}%)"
                                                      for k in cats) + " |" for arm, c in prof.items()]
    write_results(name, payload, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
