"""Tiny causal LMs built from configs (no download) and toy batches, shared by the integration tests."""

import torch
import transformers

V = 50


def tiny(kind="gpt2", seed=0):
    torch.manual_seed(seed)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=V, n_positions=32, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
    common = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=32, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    if kind == "gemma2":
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(final_logit_softcapping=2.0, **common))
    if kind == "cohere":
        return transformers.CohereForCausalLM(transformers.CohereConfig(logit_scale=0.5, **common))
    return transformers.GraniteForCausalLM(transformers.GraniteConfig(logits_scaling=4.0, **common))


def batch(seed, B=2, T=12, pad=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, V, (B, T), generator=g)
    labels = x.clone()
    labels[0, T - pad:] = -100
    return {"input_ids": x, "labels": labels}


def grads(model):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
