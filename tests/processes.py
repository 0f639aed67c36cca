"""Tests on several gloo processes: a worker spawned on each, which join and leave cleanly."""

from __future__ import annotations

import gc
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def spawn(worker: Callable[..., None], folder: Path | str, *args: Any, world: int = 2) -> None:
    """Run the module-level function ``worker(rank, folder, *args)`` on ``world`` gloo
    processes joined through a file in ``folder``."""
    where = (worker.__module__, worker.__name__)
    mp.spawn(_joined, args=(where, str(folder), world, args), nprocs=world, join=True)


def _joined(rank: int, where: tuple[str, str], folder: str, world: int, args: tuple) -> None:
    init = f"file://{folder}/init"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    getattr(importlib.import_module(where[0]), where[1])(rank, folder, *args)
    # What holds the process group (DDP's reducer, FSDP2's modules, DCP's writers) goes while
    # the group is still registered: freed last by one of them, gloo's destructor joins its
    # threads under the GIL one of them waits for, and the process hangs or aborts.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
