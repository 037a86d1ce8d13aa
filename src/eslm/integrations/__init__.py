"""ESLM inside other training stacks, one small module each, each importing its stack only when used:

* ``hf``         Hugging Face ``Trainer`` and TRL's ``SFTTrainer``: ``use_eslm(trainer, ...)``, no full logits
* ``lightning``  PyTorch Lightning: ``SelectiveLossMixin`` for a ``LightningModule``'s ``training_step``
* ``torchtitan`` a torchtitan-style ``loss_fn(pred, labels, global_valid_tokens) -> (loss, metrics)``

A nanoGPT-style loop needs no adapter: ``examples/nanogpt_eslm.py``. docs/dropin.md has the table (stack,
snippet, normalisation, scope, memory)."""
