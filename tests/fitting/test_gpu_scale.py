"""benchmarks/gpu_scale.py end to end on the CPU with its scaled-down Qwen3-14B/32B configs (a smoke test:
the GPU run is the same code on the real configs)."""

import json
import math

import torch

from tests.benchmark_scripts import load_benchmark


def test_cpu_scaled_run_writes_every_measurement(tmp_path):
    from kvhub.fitting.plan import statistics_bytes

    gpu_scale = load_benchmark("gpu_scale")
    out = tmp_path / "gpu_scale.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only contend on a busy machine
    try:
        gpu_scale.main(
            [
                "--cpu-scaled",
                "--lengths",
                "24,48",
                "--repeats",
                "1",
                "--batch",
                "2",
                "--seq-len",
                "32",
                "--solve-rows",
                "192",
                "--out",
                str(out),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    small, large = (report["configs"][m] for m in (gpu_scale.SRC, gpu_scale.DST))
    assert (small["num_hidden_layers"], large["num_hidden_layers"]) == (4, 6)
    assert [row["tokens"] for row in report["transfer"]] == [24, 48]
    assert all(row["transfer_median_s"] > 0 and row["speedup"] > 0 for row in report["transfer"])
    assert report["capture"]["tokens_per_s"] > 0 and "peak_bytes" not in report["capture"]  # CUDA only
    stats = report["statistics"]
    assert stats["layout"] == [4, 32, 6, 32]  # 8 stats layers cover the scaled models: no extrapolation
    assert math.isclose(stats["full_layout_rows_per_s"], stats["rows_per_s"])
    assert report["solve"]["layout"] == [4, 32, 6, 32] and report["solve"]["seconds"] > 0
    # the job plan's 8 ranks own ceil(6 / 8) = 1 target layer each
    assert report["plan"]["memory"]["statistics"] == statistics_bytes(4 * 32, 1 * 32)
