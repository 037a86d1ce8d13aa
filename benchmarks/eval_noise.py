"""How noisy is one validation evaluation? Evaluate checkpoints on K disjoint sets of validation windows.

Every run of a study is evaluated on the same fixed windows (``eval.tokens_per_domain`` per domain), so the
choice of windows is a source of error the seeds do not show. This script partitions each domain's
validation windows into K disjoint sets of the study's size (domains with fewer windows than K sets need
reuse their one set: said in the output), evaluates each given checkpoint on every set, and reports the
spread across sets of the mixed validation loss and, for two or more runs, of the paired differences
against the first run (the quantity the report's verdicts rest on).

    python benchmarks/eval_noise.py RUN_DIR [RUN_DIR ...] --tokens-per-domain 6144 --sets 4 --out FILE.json

Data: the run's own ``data.dir`` / built-in corpus (``ESLM_DATA_DIR``), its own seq_len and mixture weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch


def disjoint_sets(dataset, *, seq_len: int, tokens_per_domain: int, sets: int, batch_size_seqs: int, seed: int = 0):
    """[{domain: [Batch, ...]}] * sets: per domain, a random permutation of its non-overlapping windows cut
    into ``sets`` disjoint chunks of tokens_per_domain // seq_len windows (a domain with too few windows
    gives every set the same chunk, listed in the returned ``shared`` domains)."""
    from eslm.data.batch import Batch

    want = max(1, tokens_per_domain // seq_len)
    out, shared = [dict() for _ in range(sets)], []
    rng = np.random.default_rng(seed)
    for di, dom in enumerate(dataset.domains):
        stream = dataset.tokens("val", dom)
        available = max(0, len(stream) - 1) // seq_len
        if available == 0:
            continue
        perm = rng.permutation(available)
        k = min(want, available)
        if available < k * sets:
            shared.append(dom)
        for i in range(sets):
            slots = np.sort(perm[:k] if dom in shared else perm[i * k:(i + 1) * k])
            batches = []
            for lo in range(0, len(slots), batch_size_seqs):
                rows = slots[lo:lo + batch_size_seqs]
                buf = np.stack([np.asarray(stream[s * seq_len:s * seq_len + seq_len + 1], dtype=np.int64)
                                for s in rows])
                t = torch.from_numpy(buf)
                batches.append(Batch(t[:, :-1].contiguous(), t[:, 1:].contiguous(),
                                     torch.full((len(rows),), di, dtype=torch.int64)))
            out[i][dom] = batches
    return out, shared


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--tokens-per-domain", type=int, default=6144)
    p.add_argument("--sets", type=int, default=4)
    p.add_argument("--batch-size-seqs", type=int, default=24)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)

    from eslm.analysis.rundir import load_run
    from eslm.config import from_dict
    from eslm.data.loader import open_dataset
    from eslm.data.mixture import parse_weight_string, resolve_weights
    from eslm.data.prepare import ensure_prepared
    from eslm.eval.val_loss import evaluate
    from eslm.model.loading import load_model

    runs = [load_run(d) for d in args.run_dirs]
    cfg = from_dict(runs[0].config)
    data_dir = cfg.data.dir or ensure_prepared(cfg.data.source, cfg.data.tokenizer)
    ds = open_dataset(data_dir)
    counts = {d: ds.num_tokens("train", d) for d in ds.domains}
    spec = parse_weight_string(cfg.data.weights) if "=" in cfg.data.weights else cfg.data.weights
    weights = resolve_weights(spec, ds.domains, token_counts=counts)
    sets, shared = disjoint_sets(ds, seq_len=cfg.data.seq_len, tokens_per_domain=args.tokens_per_domain,
                                 sets=args.sets, batch_size_seqs=args.batch_size_seqs)
    losses = {}
    for r in runs:
        model, info = load_model(r.path)
        losses[r.name] = [evaluate(model, s, weights, impl="fused")["val_loss"] for s in sets]
        print(f"{r.name} (step {info.get('step')}): " + " ".join(f"{v:.4f}" for v in losses[r.name]), flush=True)
    names = [r.name for r in runs]
    res = {"tokens_per_domain": args.tokens_per_domain, "sets": args.sets, "shared_domains": shared,
           "seq_len": cfg.data.seq_len, "runs": names, "val_loss": losses,
           "std_val_loss": {n: statistics.stdev(v) for n, v in losses.items()}}
    first = losses[names[0]]
    res["std_paired_difference"] = {n: statistics.stdev([a - b for a, b in zip(losses[n], first)])
                                    for n in names[1:]}
    res["mean_paired_difference"] = {n: statistics.fmean([a - b for a, b in zip(losses[n], first)])
                                     for n in names[1:]}
    print(json.dumps({k: v for k, v in res.items() if k.startswith(("std", "mean", "shared"))}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
