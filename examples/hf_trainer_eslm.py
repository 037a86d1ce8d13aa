"""ESLM inside a Hugging Face ``Trainer`` with one call, ``eslm.integrations.hf.use_eslm`` (no full logits).

    python examples/hf_trainer_eslm.py --steps 20 --alpha 0.1 --score entropy [--ada]

Builds a tiny GPT2LMHeadModel from a config (no download), a toy dataset with prompt tokens masked (-100), and
a Trainer with gradient accumulation; ``use_eslm`` makes its loss the mean cross-entropy over the kept tokens
of each optimizer step, computed from the hidden states and the LM head in chunks. Needs ``transformers`` and
``accelerate`` (the Trainer's own dependency): ``pip install 'eslm[hf]'``.
"""

from __future__ import annotations

import argparse

import torch

from eslm.api import AdaAlpha
from eslm.integrations.hf import use_eslm


def build_model(vocab_size: int = 64, n_positions: int = 32, n_embd: int = 32, n_layer: int = 2,
                n_head: int = 2, seed: int = 0):
    """A freshly initialised tiny GPT-2 (no weights downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd,
                                      n_layer=n_layer, n_head=n_head))


class ToyDataset(torch.utils.data.Dataset):
    """Sequences following x_{t+1} = (3 x_t + 1) mod V, with 10% random tokens; the first ``prompt_len``
    labels are -100 (as for a prompt that should not be trained on). Items: input_ids, labels (seq_len,)."""

    def __init__(self, n: int = 64, seq_len: int = 32, vocab_size: int = 64, prompt_len: int = 2, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        x = torch.empty(n, seq_len, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab_size, (n,), generator=g)
        for t in range(1, seq_len):
            x[:, t] = (3 * x[:, t - 1] + 1) % vocab_size
        noise = torch.rand(n, seq_len, generator=g) < 0.1
        x = torch.where(noise, torch.randint(0, vocab_size, (n, seq_len), generator=g), x)
        self.input_ids = x
        self.labels = x.clone()
        self.labels[:, :prompt_len] = -100

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


def build_trainer(model, dataset, *, output_dir: str, max_steps: int = 3, batch_size: int = 4,
                  accumulation: int = 2, lr: float = 1e-3):
    """A CPU Trainer with no logging integrations, no checkpoints."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=batch_size,
                             gradient_accumulation_steps=accumulation, learning_rate=lr, report_to=[],
                             save_strategy="no", logging_steps=1, use_cpu=True, dataloader_num_workers=0,
                             disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=dataset, eval_dataset=dataset)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--score", choices=("entropy", "loss"), default="entropy")
    p.add_argument("--ada", action="store_true", help="Ada-ESLM: alpha steered by the kept tokens' CVaR")
    p.add_argument("--output-dir", default="runs/hf_trainer_eslm")
    a = p.parse_args(argv)
    trainer = build_trainer(build_model(), ToyDataset(), output_dir=a.output_dir, max_steps=a.steps)
    ada = AdaAlpha(alpha=a.alpha, interval=5) if a.ada else None
    use_eslm(trainer, alpha=a.alpha, score=a.score, ada=ada)
    trainer.train()
    last = [h for h in trainer.state.log_history if "loss" in h][-1]
    print(f"step {last['step']}: loss {last['loss']:.3f}, kept {last['eslm/kept_frac']:.2f}, "
          f"VaR {last['eslm/var']:.3f}, CVaR {last['eslm/cvar']:.3f}, alpha {last['eslm/alpha']:.3f}; "
          f"eval_loss (plain CE) {trainer.evaluate()['eval_loss']:.3f}")
    return last


if __name__ == "__main__":
    main()
