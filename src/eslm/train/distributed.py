"""torchrun / DDP / FSDP2 plumbing (docs/training.md, "FSDP2"): process group, device, sharding, and the
checkpoint's plain state dicts under FSDP (a checkpoint does not depend on how it was trained)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from eslm.errors import CheckpointError
from eslm.model.gpt import GPT
from eslm.model.loading import check_device


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_pref: str, backend_pref: str) -> tuple[DistInfo, torch.device]:
    """Read torchrun's environment; start the process group when WORLD_SIZE > 1 (gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_pref, local)
    if world > 1:
        import torch.distributed as dist

        backend = backend_pref if backend_pref != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        if not dist.is_initialized():
            dist.init_process_group(backend=backend)
    return DistInfo(rank, world), device


def resolve_device(pref: str, local_rank: int = 0) -> torch.device:
    """The torch device of ``train.device`` (auto, cpu, cuda, cuda:N) for local rank ``local_rank``; one this
    machine does not have is a ConfigError (``eslm.model.loading.check_device``), not torch's error from deep inside."""
    if pref == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    return torch.device(check_device(f"cuda:{local_rank}" if pref == "cuda" else pref, f"train.device={pref}"))


def shutdown(info: DistInfo) -> None:
    if info.enabled:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------ FSDP2


def shard_fsdp(model: GPT, info: DistInfo, device: torch.device) -> GPT:
    """Shard a GPT in place with FSDP2 (one unit per block, then the root); returns the same module.

    Rank 0's parameters are broadcast first, so every rank starts from the same weights (DDP does the same at
    construction; the ranks' seeds differ). The root keeps its parameters unsharded from the forward to the end
    of the backward, so ``model.head_weight`` read after the forward (the step's loss) is the full (V, C)
    parameter the forward used, and its gradient is reduce-scattered with the root's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)
    mesh = init_device_mesh(device.type, (info.world_size,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


class FSDPModel:
    """The FSDP2-sharded model as the training step sees it: ``model(x)`` and ``with model.no_sync(): ...``; as
    with DDP, a forward inside ``no_sync()`` accumulates local gradients, the next one outside reduce-scatters."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._sync = True

    def __call__(self, *args, **kwargs):
        self.module.set_requires_gradient_sync(self._sync)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev


def _optimizer_fqns(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the order ``Optimizer.state_dict()`` numbers them (group by group)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def full_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The full (unsharded) model state dict and optimizer state dict, on CPU, on rank 0 (empty on the others),
    in the formats of ``model.state_dict()`` and ``optimizer.state_dict()`` without FSDP. A collective: every
    rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=opts)
    optim_sd: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer, options=opts))
    if not optim_sd:  # not rank 0
        return model_sd, optim_sd
    index = {fqn: i for i, fqn in enumerate(_optimizer_fqns(model, optimizer))}
    return model_sd, {
        "state": {index[fqn]: s for fqn, s in sorted(optim_sd["state"].items(), key=lambda kv: index[kv[0]])},
        "param_groups": [{**g, "params": [index[f] for f in g["params"]]} for g in optim_sd["param_groups"]],
    }


def load_full_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict,
                          optim_sd: dict) -> None:
    """Load full (unsharded, plain-format) state dicts, as written by ``full_state_dicts`` or by a run without
    FSDP, into the sharded model and its optimizer. Every rank passes the full dicts (each keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    fqns = _optimizer_fqns(model, optimizer)
    n_saved = sum(len(g["params"]) for g in optim_sd["param_groups"])
    if n_saved != len(fqns) or len(optim_sd["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer holds {n_saved} parameters in "
                              f"{len(optim_sd['param_groups'])} groups; this model's holds {len(fqns)} in "
                              f"{len(optimizer.param_groups)}; resume with the config it was written with")
    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_sd, options=opts)
    set_optimizer_state_dict(model, optimizer, {
        "state": {fqns[i]: s for i, s in optim_sd["state"].items()},
        "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in optim_sd["param_groups"]],
    }, options=opts)
    for group, saved in zip(optimizer.param_groups, optim_sd["param_groups"]):  # as Optimizer.load_state_dict
        group.update({k: v for k, v in saved.items() if k != "params"})  # (keeps e.g. betas a tuple)
