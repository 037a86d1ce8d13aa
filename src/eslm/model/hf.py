"""Conversion to and from transformers' ``GPT2LMHeadModel`` (nanoGPT's parameter names are transformers'; Conv1D
weights are transposed both ways). docs/evaluation.md ("eslm export-hf", "Loading") gives the rules."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eslm.errors import CheckpointError
from eslm.model.gpt import GPT, ModelConfig
from eslm.model.state import load_error_line, load_state_checked

# Weights that are Conv1D (in, out) in transformers and nn.Linear (out, in) here.
_CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers some transformers versions keep in GPT-2's state dict (causal mask), not parameters.
_HF_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # not c_attn.bias
EXPORT_INFO_FILE = "eslm_export.json"
EXPORT_FORMAT = "eslm-hf-export-v1"


# ----------------------------------------------------------------------------------------- export


def hf_config(cfg: ModelConfig, vocab_size: int | None = None, eot_id: int | None = None):
    """The transformers ``GPT2Config`` of one of our configs (dropout off, GELU tanh, LayerNorm eps 1e-5)."""
    from transformers import GPT2Config

    v = vocab_size or cfg.vocab_size
    eot = eot_id if eot_id is not None and eot_id < v else None
    return GPT2Config(
        vocab_size=v, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=None, activation_function="gelu_new",
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        layer_norm_epsilon=1e-5, tie_word_embeddings=True, bos_token_id=eot, eos_token_id=eot,
    )


def to_hf_state_dict(model: GPT, vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Our state dict in HF GPT-2 layout (fp32 copies): Conv1D weights transposed, zero biases added, the first
    ``vocab_size`` rows of the tied embedding/head kept."""
    cfg = model.config
    v = vocab_size or cfg.vocab_size
    if v > cfg.vocab_size:
        raise CheckpointError(f"expected an export vocab_size <= the model's {cfg.vocab_size}, found {v}; "
                              "pass a smaller vocab_size or none")
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu", torch.float32)
        if not cfg.bias and name.startswith(("transformer.h.", "transformer.ln_f.")):  # a bias per layer output
            out[name.removesuffix("weight") + "bias"] = torch.zeros(t.shape[0])
        if name.endswith(_CONV1D_SUFFIXES):
            t = t.t()
        if name in ("transformer.wte.weight", "lm_head.weight"):
            t = t[:v]
        out[name] = t.contiguous().clone()
    return out


def to_hf(model: GPT, vocab_size: int | None = None, eot_id: int | None = None):
    """A transformers ``GPT2LMHeadModel`` (fp32, eval mode) computing the same logits as ``model``, its vocabulary
    trimmed to ``vocab_size`` (None: the model's), ``eot_id`` its bos/eos token id."""
    from transformers import GPT2LMHeadModel

    state = to_hf_state_dict(model, vocab_size)
    hf = GPT2LMHeadModel(hf_config(model.config, vocab_size, eot_id))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    # The only tolerated misses are non-persistent mask buffers of older transformers versions.
    missing = [k for k in missing if not k.endswith(_HF_BUFFER_SUFFIXES)]
    assert not missing and not unexpected, (missing, unexpected)
    hf.tie_weights()
    return hf.float().eval()


# ----------------------------------------------------------------------------------------- import


def _check_hf_config(hc, source: str) -> None:
    """Reject GPT-2 variants that our block does not compute (another activation, MLP width, ...)."""
    problems = []
    if hc.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function={hc.activation_function!r} (expected gelu_new)")
    if hc.n_inner not in (None, 4 * hc.n_embd):
        problems.append(f"n_inner={hc.n_inner} (expected 4*n_embd)")
    if abs(hc.layer_norm_epsilon - 1e-5) > 1e-12:
        problems.append(f"layer_norm_epsilon={hc.layer_norm_epsilon} (expected 1e-5)")
    if not getattr(hc, "scale_attn_weights", True) or getattr(hc, "scale_attn_by_inverse_layer_idx", False):
        problems.append("non-standard attention scaling")
    if not getattr(hc, "tie_word_embeddings", True):
        problems.append("untied LM head")
    if problems:
        raise CheckpointError(f"expected a standard GPT-2 config in {source}, found {'; '.join(problems)}; "
                              "only GPT-2-architecture models can be imported")


def _load_hf_model(path: str | Path):
    from transformers import GPT2LMHeadModel

    p = Path(path)
    if not (p / "config.json").is_file():
        raise CheckpointError(f"expected a HF model directory with config.json at {p}, found none; "
                              "save one with save_pretrained or 'eslm export-hf'")
    try:
        return GPT2LMHeadModel.from_pretrained(str(p), local_files_only=True, dtype=torch.float32)
    except Exception as e:
        raise CheckpointError(f"expected a GPT-2 (GPT2LMHeadModel) directory at {p}, but loading failed: "
                              f"{load_error_line(e, 'its weights file')}; "
                              "check config.json and the weights file") from None


def from_hf(path_or_model) -> GPT:
    """One of our models (fp32) from a local HF GPT-2 directory or a ``GPT2LMHeadModel``: the file's vocabulary
    is kept (a padded row of a tied head would put mass on ids that do not exist); bias=False when every bias is 0."""
    hf = path_or_model if not isinstance(path_or_model, (str, Path)) else _load_hf_model(path_or_model)
    source = str(path_or_model) if isinstance(path_or_model, (str, Path)) else type(hf).__name__
    hc = hf.config
    _check_hf_config(hc, source)
    state = {k: v.detach().to("cpu", torch.float32) for k, v in hf.state_dict().items()
             if not k.endswith(_HF_BUFFER_SUFFIXES)}
    has_bias = any(bool(v.any()) for k, v in state.items() if k.endswith(".bias"))
    cfg = ModelConfig(n_layer=hc.n_layer, n_head=hc.n_head, n_embd=hc.n_embd, vocab_size=hc.vocab_size,
                      block_size=hc.n_positions, bias=has_bias, dropout=0.0)
    ours = {k: v.t().contiguous() if k.endswith(_CONV1D_SUFFIXES) else v for k, v in state.items()
            if has_bias or not k.endswith(".bias")}  # the tied head: filled in by load_state_checked
    model = GPT(cfg)
    load_state_checked(model, ours, source=source)
    return model


def read_export_info(path: str | Path) -> dict:
    """Our metadata written next to an export (tokenizer, step, source); {} for foreign directories."""
    f = Path(path) / EXPORT_INFO_FILE
    try:
        info = json.loads(f.read_text()) if f.is_file() else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return info if isinstance(info, dict) else {}
