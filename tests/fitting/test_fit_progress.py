"""The solve reports progress a target layer at a time (ux-3 U3-8): on a large pair it runs for minutes
after the capture bar completes, and kvhub fit shows it as a `solve` step with its own bar or lines."""

from __future__ import annotations

import torch

from kvhub.progress import unit_of
from tests.fixtures_fit import fit_tiny
from tests.tinymodels import exact_family_target, make_model


def test_fit_reports_each_target_layer_of_the_solve():
    source = make_model("qwen2", vocab_size=640, num_hidden_layers=2, seed=4)
    target, _ = exact_family_target(source, insert_before=(1,))
    ids = torch.randint(0, 640, (8, 16), generator=torch.Generator().manual_seed(0))
    heard = []
    fit_tiny(
        source,
        target,
        train=ids[:6],
        heldout=ids[6:],
        source_id="src",
        target_id="dst",
        ridge_lambda=1e-6,
        top_k=1,
        batch_size=4,
        progress=lambda label, done, total: heard.append((label, done, total)),
    )
    solve = [(label, done, total) for label, done, total in heard if label.startswith("solve")]
    layers = target.config.num_hidden_layers
    assert [done for _, done, _ in solve] == list(range(layers + 1))
    assert solve[0] == ("solve: target layer 1/3", 0, layers) and solve[-1] == ("solve: done", layers, layers)
    assert heard.index(solve[0]) > max(i for i, (label, *_) in enumerate(heard) if label.startswith("capture"))


def test_the_solve_counts_layers():
    assert unit_of("solve: target layer 3/28", "tok") == "layers"


def test_plain_lines_name_the_layer():
    from kvhub.cli.progress import LineProgress

    lines = []
    progress = LineProgress("tok", interval=30, clock=iter([0, 1, 2, 60]).__next__, write=lines.append)
    for done in range(3):
        progress(f"solve: target layer {done + 1}/3", done, 3)
    progress("solve: done", 3, 3)
    assert lines[0].startswith("solve: target layer 1/3: 0/3") and lines[-1].startswith("solve: done: 3/3 (100%)")
