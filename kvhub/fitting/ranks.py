"""A rank's place in a distributed fit and what the ranks exchange: :class:`Group`, the target layers a rank
owns (:func:`owned_layers`), and the all-gather of a step's rows.  :mod:`kvhub.fitting.distributed` and
:mod:`kvhub.fitting.rank_phases` both build on it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhub.errors import ConfigError


@dataclass(frozen=True)
class Group:
    """This process's place in the job: ``rank`` of ``world``; ``device`` holds the exchanged tensors."""

    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def owned_layers(layers: int, rank: int, world: int) -> list[int]:
    """Target layers of ``rank``: contiguous blocks, the first ``layers % world`` ranks one layer more."""
    if world > layers:
        raise ConfigError(
            f"{world} ranks for {layers} target layers: every rank needs a target layer; run at most {layers} processes"
        )
    size, extra = divmod(layers, world)
    start = rank * size + min(rank, extra)
    return list(range(start, start + size + (1 if rank < extra else 0)))


def _all_gather_rows(group: Group, rows: torch.Tensor | None, width: int) -> list[torch.Tensor]:
    """Every rank's rows of this step (zero rows for a rank without a batch), padded for all_gather."""
    import torch.distributed as dist

    rows = torch.zeros(0, width) if rows is None else rows
    rows = rows.to(group.device, torch.float32)
    counts = [torch.zeros(1, dtype=torch.int64, device=group.device) for _ in range(group.world)]
    dist.all_gather(counts, torch.tensor([rows.shape[0]], dtype=torch.int64, device=group.device))
    longest = max(int(c) for c in counts)
    padded = torch.zeros(longest, width, device=group.device)
    padded[: rows.shape[0]] = rows
    out = [torch.empty_like(padded) for _ in range(group.world)]
    dist.all_gather(out, padded)
    return [block[: int(count)] for block, count in zip(out, counts)]
