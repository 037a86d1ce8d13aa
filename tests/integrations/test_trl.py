"""eslm.integrations.hf under TRL's SFTTrainer with padding-free packing: TRL keeps its own chunked per-token
log-probabilities (no full logits) and ESLM adds the selection; the gradient equals the exact mean CE over the
kept tokens, computed by hand from the model's full logits on the same packed batch."""

import math

import pytest
import torch
import torch.nn.functional as F

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from eslm.integrations.hf import use_eslm  # noqa: E402

from .tiny import V, grads, tiny  # noqa: E402


def sft_trainer(tmp_path, **kw):
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(V)}
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                               pad_token="t0", eos_token="t2")
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, V, (n,), generator=g).tolist()} for n in (5, 9, 7, 4, 6, 8, 5, 7)]
    args = trl.SFTConfig(output_dir=str(tmp_path), padding_free=True, packing=True, max_length=32,
                         per_device_train_batch_size=4, report_to=[], use_cpu=True, save_strategy="no",
                         disable_tqdm=True, logging_steps=1, **kw)
    model = tiny()
    return model, trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                 processing_class=tok)


def hand_grads(model, b, alpha, scope):
    """Full logits; entropy of every next-token prediction; the top K by entropy over the packed row (scope
    "batch") or within each packed sequence ("sequence"); the mean CE of the kept tokens."""
    model.zero_grad()
    logits = model(**{k: v for k, v in b.items() if k != "labels"}).logits[0, :-1].float()
    t = b["labels"][0, 1:]
    valid = t != -100
    ce = F.cross_entropy(logits, t.clamp(min=0), reduction="none")
    with torch.no_grad():
        logp = torch.log_softmax(logits, -1)
        s = (-(logp.exp() * logp).sum(-1)).masked_fill(~valid, float("-inf"))
    seg = torch.cumsum((b["position_ids"][0, :-1] == 0).long(), 0) if scope == "sequence" else torch.zeros_like(t)
    kept = []
    for sid in seg.unique():
        rows = torch.nonzero(seg == sid).flatten()
        n = int(valid[rows].sum())
        if n:
            kept.append(rows[torch.topk(s[rows], n - math.floor(alpha * n)).indices])
    kept = torch.cat(kept)
    ce[kept].mean().backward()
    return grads(model), len(kept)


@pytest.mark.parametrize("scope", ["batch", "sequence"])
def test_padding_free_packed_gradient_is_the_exact_kept_mean(tmp_path, scope):
    model, trainer = sft_trainer(tmp_path)
    sel = use_eslm(trainer, alpha=0.4, scope=scope)
    b = next(iter(trainer.get_train_dataloader()))
    assert b["input_ids"].shape[0] == 1 and (b["position_ids"] == 0).sum() > 1  # one packed row, several docs
    _, k_step = trainer.get_batch_samples(iter([b]), 1, torch.device("cpu"))
    model.train()
    model.zero_grad()
    trainer.compute_loss(model, dict(b), num_items_in_batch=k_step).backward()
    got = grads(model)
    sel.remove()
    want, k = hand_grads(model, b, 0.4, scope)
    assert int(k_step) == k
    for a, w in zip(got, want):
        assert torch.allclose(a, w, atol=1e-6)


def test_sft_trainer_trains_and_logs_both_metrics(tmp_path):
    model, trainer = sft_trainer(tmp_path, max_steps=2)
    use_eslm(trainer, alpha=0.2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all("eslm/kept_frac" in h and "mean_token_accuracy" in h for h in logs)


def test_trl_fused_head_keeps_the_moe_aux_loss():
    """On TRL's fused head (its own per-token log-probabilities) the selective loss keeps the MoE load-balancing
    term TRL adds: at alpha 0 the loss is TRL's own."""
    from trl.trainer.utils import add_fused_lm_head

    from eslm.integrations.hf import patch_causal_lm

    from .tiny import batch

    model = tiny("mixtral")
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    model.train()
    b = batch(1)
    own = model(**b, fused_lm_head=True)
    assert own.aux_loss is not None and float(own.aux_loss) > 0
    sel = patch_causal_lm(model, alpha=0.0)
    got = model(**b, fused_lm_head=True).loss
    sel.remove()
    assert float(got) == pytest.approx(float(own.loss), rel=1e-6)
