"""Calibration rows kept for training residual MLPs (``kvhub fit --map mlp``), taken from the fit's own pass.

The statistics pass sees every row once and keeps only moments; an MLP needs rows.  So pass 1 also copies
a bounded, evenly spread subset of each split's rows into a :class:`Reservoir`: every source layer's K
(RoPE stripped) and V and every target layer's, since which source layers a target layer reads is known
only after the solve.  A split of R rows (capture order: sequence by sequence, each sequence's kept
positions in order) keeps rows floor(i * R / capacity), i < capacity (all rows when R <= capacity).  The
choice depends on R and the capacity alone, so a fit resumed from a checkpoint fills the same rows, and
the reservoirs are checkpointed with the statistics (kvhub.fitting.checkpoint).

Memory, per split: 4 bytes x min(R, capacity) x 2 (K, V) x (Ls * Hs * Ds + Lt * Ht * Dt); for
Qwen2.5-Coder 0.5B -> 1.5B (24 x 128 + 28 x 256 = 10,240 columns) 80 KB a row, 640 MB at 8,192 rows.
"""

from __future__ import annotations

import torch

from kvhub.core.capture import CapturedKV, token_mask
from kvhub.core.stats import Layout
from kvhub.errors import FitError

NAMES = ("keys_x", "values_x", "keys_y", "values_y")  # source K~, source V, target K~, target V rows


def rows_per_sequence(seq_len: int, *, stride: int, skip_first: int) -> int:
    """Rows one unpadded sequence of ``seq_len`` tokens gives (:func:`kvhub.core.capture.token_mask`)."""
    return int(token_mask(torch.ones(1, seq_len), stride=stride, skip_first=skip_first).sum())


class Reservoir:
    """The kept rows of one split (module docstring): ``tensors[name]`` (n, width) fp32 on the CPU, for the
    :data:`NAMES`; ``rows`` (n,) int64, ascending, the row index of each within the split."""

    def __init__(self, layout: Layout, *, rows_per_sequence: int, sequences: int, capacity: int):
        total = rows_per_sequence * sequences
        kept = min(total, capacity)
        self.rows_per_sequence = rows_per_sequence
        self.rows = torch.arange(kept, dtype=torch.int64) * total // max(kept, 1)  # (n,)
        p, q = layout.src_layers * layout.src_width, layout.dst_layers * layout.dst_width
        self.tensors = {name: torch.zeros(kept, p if name.endswith("_x") else q) for name in NAMES}

    @property
    def size(self) -> int:
        return self.rows.shape[0]

    def add(self, first_sequence: int, source: CapturedKV, target: CapturedKV) -> None:
        """Copy the kept rows of one batch whose first sequence is ``first_sequence`` of the split."""
        start = first_sequence * self.rows_per_sequence
        if source.tokens % self.rows_per_sequence:
            raise FitError(
                f"a batch gave {source.tokens} rows, not a multiple of {self.rows_per_sequence} per "
                "sequence: --map mlp samples rows of unpadded sequences only"
            )
        low, high = (int(i) for i in torch.searchsorted(self.rows, torch.tensor([start, start + source.tokens])))
        local = self.rows[low:high] - start  # (n_batch,) rows of this batch
        if not len(local):
            return
        blocks = {"keys_x": source.keys, "values_x": source.values, "keys_y": target.keys, "values_y": target.values}
        for name, layers in blocks.items():
            index = local.to(layers[0].device)
            self.tensors[name][low:high] = torch.cat([layer[index].float().cpu() for layer in layers], dim=1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"rows": self.rows, **self.tensors}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take the tensors of :meth:`state_dict` (the caller checked their shapes against this one's)."""
        self.rows = state["rows"]
        self.tensors = {name: state[name] for name in NAMES}


def reservoirs(
    layout: Layout, splits: dict[str, torch.Tensor], *, capacity: int, stride: int, skip_first: int
) -> dict[str, Reservoir]:
    """An empty Reservoir per split of ``splits`` ({name: (N, T) ids})."""
    return {
        name: Reservoir(
            layout,
            rows_per_sequence=rows_per_sequence(ids.shape[1], stride=stride, skip_first=skip_first),
            sequences=ids.shape[0],
            capacity=capacity,
        )
        for name, ids in splits.items()
    }


def first_sequence(batches: list[tuple[str, torch.Tensor]], index: int) -> int:
    """The index, within its split, of the first sequence of ``batches[index]`` ((split, ids) in fit order)."""
    name = batches[index][0]
    return sum(int(ids.shape[0]) for split, ids in batches[:index] if split == name)
