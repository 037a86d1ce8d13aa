"""ESLM inside a Hugging Face ``Trainer``, through ``compute_loss_func`` (transformers 5.x).

    python examples/hf_trainer_eslm.py --steps 20 --alpha 0.1 --score entropy

Builds a tiny GPT2LMHeadModel from a config (no download), a toy dataset, and a Trainer whose loss is
``eslm.api.selective_loss``. Needs ``transformers`` and ``accelerate`` (the Trainer's own dependency).

The Trainer calls ``compute_loss_func(outputs, labels, num_items_in_batch=...)`` with the model outputs, the
UNSHIFTED labels (labels == input_ids, -100 where ignored) and the number of non-ignored next-token targets of
the whole accumulated batch. It does not divide that loss by the gradient-accumulation steps, so the function
below normalises by the step's expected kept count itself.
"""

from __future__ import annotations

import argparse

import torch

from eslm.api import selective_loss, shift_for_causal_lm


def build_model(vocab_size: int = 64, n_positions: int = 32, n_embd: int = 32, n_layer: int = 2,
                n_head: int = 2, seed: int = 0):
    """A freshly initialised tiny GPT-2 (no weights downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head)
    return GPT2LMHeadModel(cfg)


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


def make_compute_loss_func(score: str = "entropy", alpha: float = 0.1, log: list | None = None):
    """A ``compute_loss_func(outputs, labels, num_items_in_batch=None)`` running ESLM's selective loss.

    With ``num_items_in_batch`` (N_step: targets of the whole accumulated batch, from the Trainer) the loss is
    sum(kept CE) / ((1 - alpha) * N_step), i.e. a mean over the step's kept tokens that is correct under
    gradient accumulation; without it, the mean over this batch's kept tokens. ``log`` collects the
    SelectionStats of every call.
    """

    def compute_loss_func(outputs, labels, num_items_in_batch=None):
        logits, targets = shift_for_causal_lm(outputs.logits, labels)  # logits[t] predicts labels[t + 1]
        loss, stats = selective_loss(targets, logits=logits, score=score, alpha=alpha)
        if log is not None:
            log.append(stats)
        if num_items_in_batch is None:
            return loss
        return loss * stats.num_kept / ((1.0 - alpha) * num_items_in_batch)

    return compute_loss_func


def build_trainer(model, dataset, compute_loss_func, *, output_dir: str, max_steps: int = 3,
                  batch_size: int = 4, lr: float = 1e-3):
    """A CPU Trainer with no logging integrations, no checkpoints."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=batch_size,
                             learning_rate=lr, report_to=[], save_strategy="no", logging_steps=1,
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=dataset, compute_loss_func=compute_loss_func)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--score", choices=("entropy", "loss"), default="entropy")
    p.add_argument("--output-dir", default="runs/hf_trainer_eslm")
    a = p.parse_args(argv)
    log: list = []
    trainer = build_trainer(build_model(), ToyDataset(), make_compute_loss_func(a.score, a.alpha, log),
                            output_dir=a.output_dir, max_steps=a.steps)
    trainer.train()
    last = log[-1]
    print(f"last batch: kept {int(last.num_kept)}/{int(last.num_tokens)} tokens "
          f"(threshold {float(last.threshold):.3f}, CVaR {float(last.cvar):.3f})")


if __name__ == "__main__":
    main()
