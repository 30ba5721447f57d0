"""Data parallelism for evaluation and search: rank, world size, sharding and gathering."""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

__all__ = ["Distributed"]


class Distributed:
    """Rank, world size and gathering for ``accelerate launch`` / ``torchrun``; a no-op in one process."""

    def __init__(self) -> None:
        # torch.distributed directly, not accelerate's PartialState: on a machine without GPUs (accelerate
        # 1.15, `accelerate launch --multi_gpu`) PartialState reports one process on every rank.
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.world_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                backend = "nccl" if torch.cuda.is_available() else "gloo"
                if backend == "nccl":
                    torch.cuda.set_device(self.local_rank)
                dist.init_process_group(backend=backend)
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def default_device(self) -> str:
        if torch.cuda.is_available():
            return f"cuda:{self.local_rank}" if self.world_size > 1 else "cuda"
        return "cpu"

    def shard(self, items: Sequence[Any]) -> list[Any]:
        """This process's share of ``items`` (round robin)."""
        return list(items[self.rank :: self.world_size])

    def gather(self, local: list[Any]) -> list[Any]:
        """Concatenate every process's ``local`` list (same result on every process)."""
        if self.world_size == 1:
            return list(local)
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local)
        return [item for part in gathered for item in part]

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()
