"""patch_model on Hugging Face causal LMs (tiny random models built from configs, no download): the head checks
of patch_causal_lm (softcap, logit scale, multipliers, MoE load-balancing loss) and HF's unshifted labels."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from eslm.api import patch_model  # noqa: E402
from eslm.errors import ConfigError  # noqa: E402

from .tiny import batch, grads, tiny  # noqa: E402


@pytest.mark.parametrize("kind", ["gpt2", "gemma2", "cohere", "granite", "minicpm3"])
def test_alpha_zero_equals_the_models_own_loss(kind):
    """At alpha = 0, patch_model's loss and gradients are the model's own (Gemma 2's softcap, Cohere's logit
    scale, Granite's logits scaling, MiniCPM3's hidden-state scaling
    before its head, all read from the config and checked against the model's logits)."""
    model = tiny(kind)
    model.train()
    b = batch(1, pad=3)
    ref = model(**b).loss
    ref.backward()
    want = grads(model)
    model.zero_grad()
    handle = patch_model(model, head=model.get_output_embeddings(), alpha=0.0)
    loss, stats = model(input_ids=b["input_ids"], eslm_labels=b["labels"])
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    for a, w in zip(grads(model), want):
        assert torch.allclose(a, w, atol=1e-6)
    handle.remove()
    assert "forward" not in model.__dict__


def test_a_head_transform_eslm_does_not_know_is_refused():
    class Doubled(transformers.LlamaForCausalLM):  # multiplies its logits by 2 under no config name eslm reads
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    model = Doubled(tiny("llama").config)
    with pytest.raises(ConfigError, match="apart") as e:
        patch_model(model, head=model.lm_head)
    assert "\n" not in str(e.value)
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__  # the patch undone


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_with_router_logits_is_refused(kind):
    """The load-balancing loss comes after the head, where patch_model stops the forward: refused, not dropped."""
    model = tiny(kind)
    with pytest.raises(ConfigError, match="patch_causal_lm") as e:
        patch_model(model, head=model.lm_head)
    assert "\n" not in str(e.value)
    model.config.output_router_logits = False  # trained without the auxiliary loss, as the user chose
    model.train()
    b = batch(2)
    patch_model(model, head=model.lm_head, alpha=0.0)
    loss, _ = model(input_ids=b["input_ids"], eslm_labels=b["labels"])
    assert float(loss.detach()) == pytest.approx(float(model(**b).loss.detach()), rel=1e-6)
    with pytest.raises(ConfigError, match="router logits"):
        model(input_ids=b["input_ids"], eslm_labels=b["labels"], output_router_logits=True)


def test_unshifted_labels_as_targets_are_refused_and_eslm_labels_shifts_them():
    """GPT-2: HF's labels (= input_ids, -100 on padding) passed as eslm_targets would train the model to copy its
    input: refused. eslm_labels= shifts them (targets[:, t] = labels[:, t + 1]), the same as eslm_targets= with
    the shifted targets and as the model's own loss."""
    model = tiny("gpt2")
    model.train()
    b = batch(3, pad=2)
    handle = patch_model(model, head=model.lm_head, alpha=0.0)
    with pytest.raises(ConfigError, match="unshifted") as e:
        model(input_ids=b["input_ids"], eslm_targets=b["labels"])
    assert "\n" not in str(e.value)
    shifted = torch.nn.functional.pad(b["labels"][:, 1:], (0, 1), value=-100)
    by_labels, _ = model(input_ids=b["input_ids"], eslm_labels=b["labels"])
    by_targets, _ = model(input_ids=b["input_ids"], eslm_targets=shifted)
    assert float(by_labels) == float(by_targets)
    assert float(by_labels) == pytest.approx(float(model(**b).loss), rel=1e-6)
    with pytest.raises(ConfigError, match="both"):
        model(input_ids=b["input_ids"], eslm_labels=b["labels"], eslm_targets=shifted)
    handle.remove()
