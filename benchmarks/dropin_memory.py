"""Peak memory of the loss's forward + backward in each drop-in stack, ESLM against the stack's own loss.

    python benchmarks/dropin_memory.py                  # prints a table, writes benchmarks/results/dropin_memory.json

One GPT-2-shaped layer (C = 768, V = 50257, tied head), B = 2 sequences of T = 1024 tokens (N = 2048), fp32,
CPU. Each case runs in its own child process (MALLOC_MMAP_THRESHOLD_=65536, so freed blocks leave the resident
set) and reports the peak resident memory of one forward + backward above what was resident before it (the
model, its inputs). Memory, not time: the machine's load does not change it.

Cases (own = the stack's own loss, eslm = the same stack with ESLM, alpha = 0.1, score entropy):
  loop/own           F.cross_entropy over full logits (nanoGPT's forward(idx, targets), a Lightning training_step,
                     torchtitan's cross_entropy_loss on the model's logits)
  loop/eslm-logits   selective_loss(logits=...) on the same full logits
  loop/eslm-hidden   selective_loss(hidden=..., lm_weight=...): no full logits
  hf/own             GPT2LMHeadModel(**batch, labels).loss
  hf/eslm            the same model after eslm.integrations.hf.patch_causal_lm (what use_eslm installs)
  trl/own            TRL's fused per-token LM head (add_fused_lm_head, SFTTrainer's outputs), its loss
  trl/eslm           the same with ESLM's selection on top (use_eslm under SFTTrainer)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CASES = ["loop/own", "loop/eslm-logits", "loop/eslm-hidden", "hf/own", "hf/eslm", "trl/own", "trl/eslm"]
OUT = Path(__file__).resolve().parent / "results" / "dropin_memory.json"
C, V, B, T = 768, 50257, 2, 1024


def _model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_embd=C, n_layer=1, n_head=12, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0))
    return m.train()


def run_case(case: str) -> float:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from eslm.api import selective_loss, shift_for_causal_lm
    from harness import MemoryProbe

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (B, T), generator=g)
    probe = MemoryProbe(torch.device("cpu"))
    if case.startswith("loop/"):
        hidden = torch.randn(B, T, C, generator=g, requires_grad=True)
        w = (torch.randn(V, C, generator=g) * 0.02).requires_grad_(True)
        _, targets = shift_for_causal_lm(hidden, x)
        probe.start()
        if case == "loop/own":
            loss = F.cross_entropy((hidden @ w.t()).view(-1, V), targets.view(-1), ignore_index=-100)
        elif case == "loop/eslm-logits":
            loss, _ = selective_loss(targets, logits=hidden @ w.t(), alpha=0.1)
        else:
            loss, _ = selective_loss(targets, hidden=hidden, lm_weight=w, alpha=0.1)
        loss.backward()
        return probe.stop()
    model = _model()
    kwargs = {}
    if case.startswith("trl/"):
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
        kwargs["fused_lm_head"] = True
    if case.endswith("/eslm"):
        from eslm.integrations.hf import patch_causal_lm

        patch_causal_lm(model, alpha=0.1)
    probe.start()
    model(input_ids=x, labels=x, **kwargs).loss.backward()
    return probe.stop()


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        print(json.dumps(run_case(sys.argv[2])))
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = {}
    for case in CASES:
        res = subprocess.run([sys.executable, __file__, "--case", case], env=env, capture_output=True, text=True)
        if res.returncode != 0:
            print(f"{case}: failed\n{res.stderr[-2000:]}")
            return 1
        out[case] = json.loads(res.stdout.strip().splitlines()[-1]) / 2**20
        print(f"{case:<18} {out[case]:8.0f} MiB", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"setup": f"C={C} V={V} B={B} T={T} fp32 CPU, 1 GPT-2 layer, alpha=0.1 entropy",
                               "peak_mib": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
