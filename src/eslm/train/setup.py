"""Building what a run trains: torch settings, the data, the model (and its init_from weights), its wrapping
(compile, DDP, FSDP2) and the data streams. Called in this order by the Trainer; the order fixes the random
draws, so a run and its resumed twin start identically."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import torch

from eslm import seeds
from eslm.config import Config, model_config_for
from eslm.data.loader import TrainLoader, open_dataset, val_batches
from eslm.data.mixture import resolve_weights
from eslm.data.prepare import ensure_prepared
from eslm.errors import ConfigError
from eslm.methods import holds_out
from eslm.model.gpt import GPT
from eslm.model.loading import load_model
from eslm.train import checkpoint as ckpt
from eslm.train.distributed import FSDPModel, shard_fsdp


def setup_torch(cfg: Config, rank: int, device: torch.device) -> None:
    if cfg.train.num_threads > 0:
        torch.set_num_threads(cfg.train.num_threads)
    seed = seeds.process(cfg.run.seed, rank)
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        enable_tf32()


def enable_tf32() -> None:
    """TF32 for fp32 matmuls and convolutions on CUDA, through torch's ``fp32_precision`` settings where it has
    them (2.9 and later, where the legacy ``allow_tf32`` flags are deprecated and mixing the two APIs is an
    error), else through the legacy flags."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"  # type: ignore[attr-defined]  # torch >= 2.9 only
    else:
        matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def autocast_for(dtype: str, device: torch.device):
    """bf16 autocast for train.dtype=bf16, or auto on CUDA; None (fp32) otherwise."""
    if dtype == "bf16" or (dtype == "auto" and device.type == "cuda"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return None


def open_data(cfg: Config, dist):
    """The prepared dataset: data.dir, or data.source prepared once (rank 0 prepares, the others wait)."""
    d = cfg.data
    if d.dir:
        return open_dataset(d.dir)

    if dist.enabled:
        import torch.distributed as tdist

        if dist.is_main:
            ensure_prepared(d.source, d.tokenizer)
        tdist.barrier()
    return open_dataset(ensure_prepared(d.source, d.tokenizer))


def checked_model_config(cfg: Config, dataset):
    """The model ``cfg`` trains (``eslm.config.model_config_for``), checked against the data: its tokenizer,
    a vocabulary that embeds every id, a context that holds ``data.seq_len``."""
    if dataset.tokenizer_name != cfg.data.tokenizer:
        raise ConfigError(f"data.tokenizer={cfg.data.tokenizer!r}, but {dataset.path} was prepared with the "
                          f"{dataset.tokenizer_name!r} tokenizer; set data.tokenizer={dataset.tokenizer_name} "
                          f"(or prepare the data with {cfg.data.tokenizer!r})")
    mc = model_config_for(cfg)
    dataset.check_vocab(mc.vocab_size)
    if cfg.data.seq_len > mc.block_size:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's context "
                          f"{mc.block_size}; lower data.seq_len or set model.block_size")
    return mc


def init_from(cfg: Config, dataset, model_config, raw_model: GPT, device: torch.device, log):
    """model.init_from: (model config, model) holding the source's weights. The source's tokenizer must be the
    data's; with model.vocab_size=0 (auto) the source's vocabulary is used when it covers the data's (an
    export-hf or HF GPT-2 directory holds 50257 rows, not the padded 50304: padding a tied head with rows would
    put mass on ids that do not exist), and the model is then rebuilt with it."""
    src, info = load_model(cfg.model.init_from, device=device)
    src_vocab, src_tokenizer = src.config.vocab_size, info.get("tokenizer")
    if src_tokenizer is not None and src_tokenizer != dataset.tokenizer_name:
        raise ConfigError(f"model.init_from {cfg.model.init_from!r} was trained with the {src_tokenizer!r} "
                          f"tokenizer, the data ({dataset.path}) with {dataset.tokenizer_name!r}; "
                          "use data prepared with the same tokenizer, or another model.init_from")
    if cfg.model.vocab_size == 0 and src_vocab != model_config.vocab_size and src_vocab >= dataset.vocab_size:
        log(f"model.init_from: vocabulary of {src_vocab} rows taken from the source "
            f"(model.vocab_size=0 would pad to {model_config.vocab_size})")
        model_config = replace(model_config, vocab_size=src_vocab)
        raw_model = GPT(model_config).to(device)
    sd = src.state_dict()
    ckpt.check_model_matches({"model_config": src.config.to_dict()}, model_config.to_dict(),
                             cfg.model.init_from, fix="set model.preset / model.block_size / "
                             "model.vocab_size to the source model's, or point model.init_from elsewhere")
    raw_model.load_state_dict(sd)
    return model_config, raw_model


def compile_blocks(model: GPT, **options) -> GPT:
    """``torch.compile`` each transformer block in place (``options``: torch.compile's): one graph that every
    block reuses instead of the whole GPT unrolled, and the raw model's own forward (the selection scope "step"'s
    scoring forward, evaluation) runs compiled too. Returns ``model``."""
    for block in model.transformer.h:
        block.compile(**options)
    return model


def wrap(model: GPT, cfg: Config, dist, device: torch.device, fsdp: bool) -> torch.nn.Module | FSDPModel:
    """The module the step calls: FSDP2-sharded or DDP-wrapped, its blocks compiled with train.compile."""
    if cfg.train.compile:
        compile_blocks(model)
    if fsdp:
        return FSDPModel(shard_fsdp(model, dist, device))
    if dist.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    return model


def data_streams(cfg: Config, dataset, dist, device: torch.device):
    """(mixture weights, the training loader, the fixed validation batches per domain on the device). The
    training loader of a method that needs held-out data (``eslm.methods.holds_out``) leaves out the training
    split's held-out tail (``eslm.data.loader.held_out_start``), which ``val_loader_factory`` draws from."""

    d, t, e = cfg.data, cfg.train, cfg.eval
    weights = resolve_weights(d.weights, dataset.domains, token_counts=dataset.token_counts("train"))
    loader = TrainLoader(dataset, seq_len=d.seq_len, micro_batch_size_seqs=t.micro_batch_size_seqs,
                         weights=weights, seed=cfg.run.seed, rank=dist.rank, world_size=dist.world_size,
                         part="fit" if holds_out(cfg.method.name) else "all")
    val = {dom: [b.to(device) for b in bs] for dom, bs in val_batches(
        dataset, seq_len=d.seq_len, batch_size_seqs=e.batch_size_seqs,
        tokens_per_domain=e.tokens_per_domain, seed=seeds.VAL_WINDOWS).items()}
    return weights, loader, val


def val_loader_factory(cfg: Config, dataset, weights: dict, dist):
    """A function batch_size_seqs -> a loader over the training split's held-out tail (GREATS' validation
    gradient): never the validation split the run is evaluated on, and never what its training loader draws
    (``data_streams``)."""
    def factory(batch_size_seqs: int):
        return TrainLoader(dataset, seq_len=cfg.data.seq_len, micro_batch_size_seqs=batch_size_seqs,
                           weights=weights, seed=seeds.greats_val(cfg.run.seed), rank=dist.rank,
                           world_size=dist.world_size, split="train", part="held_out")

    return factory

