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
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if kind == "hyperclovax":  # multiplies its logits by logits_scaling
        return transformers.HyperCLOVAXForCausalLM(transformers.HyperCLOVAXConfig(logits_scaling=4.0, **common))
    if kind == "minicpm3":  # divides the hidden states by hidden_size / dim_model_base = 4
        return transformers.MiniCPM3ForCausalLM(transformers.MiniCPM3Config(
            dim_model_base=4, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8,
            **{**common, "num_key_value_heads": 2}))
    if kind == "falcon_h1":  # multiplies its logits by lm_head_multiplier
        return transformers.FalconH1ForCausalLM(transformers.FalconH1Config(
            lm_head_multiplier=3.0, mamba_d_ssm=16, mamba_n_heads=2, mamba_d_head=8, mamba_d_state=4,
            mamba_chunk_size=4, **common))
    if kind == "mixtral":  # returns router logits: its loss adds router_aux_loss_coef x the load-balancing loss
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5,
            **common))
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, output_router_logits=True,
            router_aux_loss_coef=0.5, **common))
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
