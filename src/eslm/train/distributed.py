"""torchrun / DDP plumbing: process group, device, per-rank seeds, rank-0-only output."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
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
    return DistInfo(rank, local, world), device


def resolve_device(pref: str, local_rank: int = 0) -> torch.device:
    if pref == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if pref == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(pref)


def all_reduce_mean(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        import torch.distributed as dist

        t = t.clone()
        dist.all_reduce(t)
        t /= info.world_size
    return t


def barrier(info: DistInfo) -> None:
    if info.enabled:
        import torch.distributed as dist

        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.enabled:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
