"""eslm.integrations.hf: a causal LM trained by a Hugging Face Trainer with ESLM, without full logits.

Every gradient check compares with the exact mean cross-entropy over the step's kept tokens, computed by hand
from the model's own full logits on the same batch."""

import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from eslm.api import AdaAlpha  # noqa: E402
from eslm.integrations.hf import patch_causal_lm, use_eslm  # noqa: E402

from .tiny import V, batch, grads, tiny  # noqa: E402


def hand_step_grads(model, micro, alpha, score="entropy"):
    """The exact step loss by hand: each micro-batch keeps its own top K of its valid next-token targets
    (full logits, fp32), and the step's loss is the mean CE over all kept tokens of all micro-batches."""
    model.zero_grad()
    kept_ce = []
    for b in micro:
        logits = model(input_ids=b["input_ids"]).logits[:, :-1].reshape(-1, V).float()
        t = b["labels"][:, 1:].reshape(-1)
        valid = t != -100
        ce = F.cross_entropy(logits, t.clamp(min=0), reduction="none")
        with torch.no_grad():
            logp = torch.log_softmax(logits, -1)
            s = -(logp.exp() * logp).sum(-1) if score == "entropy" else ce.detach()
        s = s.masked_fill(~valid, float("-inf"))
        n = int(valid.sum())
        k = n - math.floor(alpha * n)
        kept_ce.append(ce[torch.topk(s, k).indices])
    torch.cat(kept_ce).mean().backward()
    out = grads(model)
    model.zero_grad()
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama", "gemma2", "cohere", "granite", "hyperclovax", "minicpm3",
                                  "falcon_h1", "mixtral", "qwen3_moe"])
def test_alpha_zero_equals_the_models_own_loss(kind):
    """The patched forward reads the head's softcap (Gemma 2), logit scale (Cohere), logits scaling (Granite and
    MiniCPM3 divide, HyperCLOVA X multiplies), lm_head_multiplier (Falcon-H1) from the config and adds the MoE
    load-balancing loss when the model returns router logits (Mixtral, Qwen3-MoE): at alpha = 0 loss and
    gradients are the model's own."""
    model = tiny(kind)
    model.train()
    b = batch(1, pad=3)
    ref = model(**b).loss
    ref.backward()
    want = grads(model)
    model.zero_grad()
    sel = patch_causal_lm(model, alpha=0.0)
    out = model(**b)
    assert out.logits is None  # no logits were built
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    for a, w in zip(grads(model), want):
        assert torch.allclose(a, w, atol=1e-6)
    sel.remove()
    assert "forward" not in model.__dict__


def _trainer(model, tmp_path, **kw):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, per_device_eval_batch_size=2,
                                          report_to=[],
                                          save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=1,
                                          dataloader_num_workers=0, **kw)
    data = [{k: v[i] for k, v in b.items()} for b in (batch(3), batch(4, pad=7)) for i in range(2)]
    return transformers.Trainer(model=model, args=args, train_dataset=data, eval_dataset=data)


@pytest.mark.parametrize("score", ["entropy", "loss"])
def test_accumulated_step_gradient_is_the_exact_kept_mean(tmp_path, score):
    """Two micro-batches with different padding: the Trainer's count (num_items_in_batch, made the step's kept
    tokens) and the patched forward give the gradient of the mean CE over the step's kept tokens."""
    model = tiny()
    trainer = _trainer(model, tmp_path, gradient_accumulation_steps=2)
    sel = use_eslm(trainer, alpha=0.3, score=score)
    micro = [batch(7, pad=0), batch(8, pad=8)]
    model.train()
    samples, k_step = trainer.get_batch_samples(iter(micro), 2, torch.device("cpu"))
    valid = [int((b["labels"][:, 1:] != -100).sum()) for b in micro]
    assert int(k_step) == sum(n - math.floor(0.3 * n) for n in valid)
    model.zero_grad()
    for b in samples:
        trainer.compute_loss(model, dict(b), num_items_in_batch=k_step).backward()
    got = grads(model)
    sel.remove()
    want = hand_step_grads(model, micro, 0.3, score)
    for a, w in zip(got, want):
        assert torch.allclose(a, w, atol=1e-6)


def test_trainer_trains_logs_runs_ada_and_keeps_plain_eval_loss(tmp_path):
    model = tiny()
    trainer = _trainer(model, tmp_path, max_steps=4, learning_rate=1e-2)
    ada = AdaAlpha(alpha=0.3, interval=1, gamma=5.0)
    sel = use_eslm(trainer, score="loss", ada=ada)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4 and all(0 < h["eslm/kept_frac"] <= 1 and "eslm/cvar" in h for h in logs)
    assert ada.steps == 4 and ada.alpha != 0.3  # Ada ran after every optimizer step and moved alpha
    assert logs[-1]["eslm/alpha"] == ada.alpha or logs[-2]["eslm/alpha"] != 0.3
    # eval_loss is the Trainer's own (the model's plain cross-entropy), not the selective loss
    with_eslm = trainer.evaluate()["eval_loss"]
    sel.remove()
    assert with_eslm == trainer.evaluate()["eval_loss"]


def test_refuses_what_it_cannot_normalise(tmp_path):
    from eslm.errors import ConfigError

    trainer = _trainer(tiny(), tmp_path)
    trainer.compute_loss_func = lambda *a, **k: None
    with pytest.raises(ConfigError, match="compute_loss_func"):
        use_eslm(trainer)


def test_label_smoothing_factor_is_applied_to_the_kept_tokens(tmp_path):
    """label_smoothing_factor: the Trainer pops the labels and smooths the full logits itself, which would have
    bypassed ESLM entirely (it was refused). Now its epsilon goes to the selective loss: at alpha 0 the loss and
    gradients equal the Trainer's own smoothed loss; remove() restores its smoother."""
    model = tiny()
    model.train()
    trainer = _trainer(model, tmp_path, label_smoothing_factor=0.1)
    b = batch(5, pad=3)
    model.zero_grad()
    own = trainer.compute_loss(model, dict(b))
    own.backward()
    want = grads(model)
    model.zero_grad()
    sel = use_eslm(trainer, alpha=0.0)
    assert trainer.label_smoother is None
    got = trainer.compute_loss(model, dict(b))
    got.backward()
    assert float(got) == pytest.approx(float(own), rel=1e-6)
    for a, w in zip(grads(model), want):
        assert torch.allclose(a, w, atol=1e-6)
    sel.remove()
    assert trainer.label_smoother is not None and trainer.label_smoother.epsilon == 0.1


def test_an_lm_head_eslm_does_not_reproduce_is_refused():
    """A model whose forward transforms its logits in a way the config does not say (here x 3 in the forward)
    is refused on the first training forward, in one line; a config naming a transform eslm does not apply is
    refused when patching."""
    from eslm.errors import ConfigError

    class Mystery(transformers.LlamaForCausalLM):
        def forward(self, *args, labels=None, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3.0
            if labels is not None:
                out.loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
            return out

    model = Mystery(tiny("llama").config)
    model.train()
    with pytest.raises(ConfigError, match="apart") as e:
        patch_causal_lm(model, alpha=0.1)
    assert "\n" not in str(e.value)
    assert model.training and "forward" not in model.__dict__  # training mode restored, the patch undone
    capped = tiny("llama")
    capped.config.logits_soft_cap = 30.0
    with pytest.raises(ConfigError, match="logits_soft_cap"):
        patch_causal_lm(capped)


def test_moe_without_a_findable_aux_loss_is_refused(monkeypatch):
    import sys

    from eslm.errors import ConfigError

    model = tiny("mixtral")
    model.train()
    patch_causal_lm(model, alpha=0.0)
    monkeypatch.delattr(sys.modules[type(model).__module__], "load_balancing_loss_func")
    with pytest.raises(ConfigError, match="output_router_logits = False"):
        model(**batch(1))


@pytest.mark.parametrize("score", ["entropy", "loss"])
def test_compute_loss_func_hook_gives_the_exact_kept_mean(tmp_path, score):
    """SelectiveLossFunc as the Trainer's compute_loss_func on a tiny GPT-2: the Trainer pops the labels, runs
    the model's own forward, counts the step's valid tokens (two micro-batches, equal valid tokens) and calls
    the hook; the accumulated gradient is the hand computation's (the mean CE over the step's kept tokens)."""
    from eslm.integrations.hf import SelectiveLossFunc

    model = tiny()
    hook = SelectiveLossFunc(alpha=0.3, score=score)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[],
                                          save_strategy="no", use_cpu=True, disable_tqdm=True,
                                          gradient_accumulation_steps=2)
    trainer = transformers.Trainer(model=model, args=args, compute_loss_func=hook)
    micro = [batch(7, pad=0), batch(8, pad=0)]
    model.train()
    samples, n_step = trainer.get_batch_samples(iter(micro), 2, torch.device("cpu"))
    assert int(n_step) == sum(int((b["labels"] != -100).sum()) for b in micro)  # the Trainer's own count
    model.zero_grad()
    for b in samples:
        trainer.compute_loss(model, dict(b), num_items_in_batch=n_step).backward()
    got = grads(model)
    want = hand_step_grads(model, micro, 0.3, score)
    for a, w in zip(got, want):
        assert torch.allclose(a, w, atol=1e-6)
    assert 0.6 < hook.metrics.pop()["eslm/kept_frac"] < 0.8
    from eslm.errors import ConfigError

    with pytest.raises(ConfigError, match="SelectiveLossFunc"):
        use_eslm(trainer)
