"""Two-phase capture against one-phase on a real pair: the same mapper, the peak memory of each phase, the time.

    python benchmarks/two_phase_fit.py --samples 16 --dtype float32 --out docs/results/two_phase_fit.json

Each capture (one-phase, two-phase, and two-phase with the target layer by layer) runs ``kvhub.fitting.job.fit_by_names`` (what ``kvhub fit`` runs) in its own process, so each
peak resident set (RSS) is that fit's alone: a thread samples /proc/self/status every 20 ms and files the
largest VmRSS under the phase the progress callback last named (loading and calibration; phase 1, the source
alone; the statistics passes; the solve).  ``--capture one-phase`` holds both models throughout;
``two-phase`` the source, then the target.  The report gives every phase's peak, the wall time of each fit,
its forward and statistics seconds, the spool's bytes, and max |dW| over every tensor of the two mappers
(the claim: 0, the statistics are the same sums).  The rows name the machine (CPU model, cores, torch).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SRC = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
DST = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
CAPTURES = ("one-phase", "two-phase", "layer-outer")  # the last: two phases and the target layer by layer


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class PhasePeaks:
    """The largest RSS seen while each phase ran; ``phase`` is set by the fit's progress lines."""

    def __init__(self, interval: float = 0.02):
        self.phase, self.peaks, self.interval = "load", {}, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            rss = rss_bytes()
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def phase_of(description: str, previous: str) -> str:
    """The phase a progress line belongs to (the labels of kvhub.fitting.fit, phases and core.solve)."""
    if description.startswith("phase 1"):
        return "phase 1: source alone"
    if description.startswith("phase 2"):
        return "phase 2: target loading"
    if description.startswith("target layer"):
        return "statistics: target layer by layer"
    if description.startswith("capture"):
        return "statistics: target alone" if CHILD_CAPTURE == "two-phase" else "statistics: both models"
    if description.startswith("solve"):
        return "solve"
    return previous


CHILD_CAPTURE = "one-phase"


def child(capture: str, samples: int, dtype: str, out: Path, report: Path) -> None:
    """One fit by names in this process; writes its phases' peaks and timings to ``report``."""
    global CHILD_CAPTURE
    CHILD_CAPTURE = capture
    import torch

    from kvhub.fitting.job import FitRequest, fit_by_names
    from kvhub.fitting.options import FitOptions

    torch.manual_seed(0)
    with PhasePeaks() as peaks:

        def progress_factory(unit):
            from contextlib import nullcontext

            def callback(description, completed, total):
                peaks.phase = phase_of(description, peaks.phase)

            return nullcontext(callback)

        request = FitRequest(
            src=SRC,
            dst=DST,
            calib="legal-docs",
            samples=samples,
            dtype=dtype,
            device="cpu",
            restart=True,
            options=FitOptions(capture=capture) if capture != "layer-outer" else FitOptions(target_layout=capture),
        )
        started = time.perf_counter()
        mapper = fit_by_names(request, progress=progress_factory)
        wall = time.perf_counter() - started
        peaks.phase = "save"
    mapper.save(out)
    report.write_text(
        json.dumps(
            {
                "capture": capture,
                "wall_s": round(wall, 1),
                "peak_rss_bytes": peaks.peaks,
                "timings": mapper.metadata["fit"]["timings"],
                "recorded_capture": mapper.metadata["fit"].get("capture"),
            }
        )
    )


def machine() -> dict:
    import torch

    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return {"cpu": model, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=Path("docs/results/two_phase_fit.json"))
    parser.add_argument("--child", nargs=3, metavar=("CAPTURE", "MAPPER_DIR", "REPORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        capture, out, report = args.child
        child(capture, args.samples, args.dtype, Path(out), Path(report))
        return
    from safetensors.torch import load_file

    rows = {}
    with tempfile.TemporaryDirectory(prefix="kvhub-two-phase-") as tmp:
        for capture in CAPTURES:
            mapper_dir, report = Path(tmp) / capture, Path(tmp) / f"{capture}.json"
            command = [sys.executable, __file__, "--samples", str(args.samples), "--dtype", args.dtype]
            subprocess.run([*command, "--child", capture, str(mapper_dir), str(report)], check=True)
            rows[capture] = json.loads(report.read_text())
            rows[capture]["tensors"] = load_file(str(mapper_dir / "mapper.safetensors"))
        tensors = {c: rows[c].pop("tensors") for c in CAPTURES}
        one = tensors["one-phase"]
        max_dw = {
            c: max(float((one[name].double() - tensors[c][name].double()).abs().max()) for name in one)
            for c in CAPTURES[1:]
        }
    peak = {c: max(rows[c]["peak_rss_bytes"].values()) for c in CAPTURES}
    result = {
        "command": f"python benchmarks/two_phase_fit.py --samples {args.samples} --dtype {args.dtype}",
        "pair": [SRC, DST],
        "calibration": "legal-docs",
        "samples": args.samples,
        "dtype": args.dtype,
        "machine": machine(),
        "max_abs_dW_against_one_phase": max_dw,
        "peak_rss_bytes": peak,
        "peak_ratio_over_one_phase": {c: round(peak[c] / peak["one-phase"], 3) for c in CAPTURES[1:]},
        "wall_ratio_over_one_phase": {
            c: round(rows[c]["wall_s"] / rows["one-phase"]["wall_s"], 3) for c in CAPTURES[1:]
        },
        "fits": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    gib = 1024**3
    print("max |dW| against one-phase: " + ", ".join(f"{c} {v:.3g}" for c, v in max_dw.items()))
    for capture in CAPTURES:
        phases = ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in rows[capture]["peak_rss_bytes"].items())
        print(f"{capture}: wall {rows[capture]['wall_s']} s, peak {peak[capture] / gib:.2f} GiB ({phases})")


if __name__ == "__main__":
    main()
