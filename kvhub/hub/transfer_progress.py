"""A download's bytes as kvhub progress: the ``tqdm_class`` kvhub hands ``snapshot_download``.

kvhub turns huggingface_hub's own bars off (one per file and stage, unreadable in a log), so it reports the
bytes itself through the :data:`kvhub.progress.Progress` protocol, which the CLI draws.  huggingface_hub
builds its bars from the class it is given (``cls(desc=..., total=..., unit="B", ...)``) and calls
``update(n)`` as bytes arrive; a class that is not huggingface_hub's own tqdm is built with exactly the
keywords given and drawn by nobody but itself.  The bar reported is the last byte bar huggingface_hub made:
in huggingface_hub 2.x the bytes written to the files of the snapshot (it makes a network-bytes bar first);
a version that makes no byte bar reports nothing, and the CLI's line stays without a size.
"""

from __future__ import annotations

import threading

from kvhub.progress import Progress, report


def byte_bars(progress: Progress, label: str) -> type:
    """A tqdm stand-in class whose byte bars (``unit="B"``) report ``progress(label, bytes, total)``."""
    state = {"current": None}
    lock = threading.Lock()  # files download in worker threads

    class ByteBar:
        def __init__(self, *args, total=None, initial=0, unit="it", desc=None, **kwargs):
            self.total, self.n, self.unit, self.desc, self.disable = total, initial or 0, unit, desc, False
            if unit == "B":
                state["current"] = self

        def update(self, n: float | None = 1) -> None:
            with lock:
                self.n += n or 0
                if state["current"] is self:
                    total = int(self.total) if self.total else None
                    report(progress, label, int(self.n) if total is None else min(int(self.n), total), total)

        def refresh(self, *args, **kwargs) -> None:
            pass

        def close(self) -> None:
            pass

        def set_description(self, desc=None, refresh=True) -> None:
            self.desc = desc

        set_description_str = set_description

        def set_postfix_str(self, s="", refresh=True) -> None:
            pass

        def set_postfix(self, *args, **kwargs) -> None:
            pass

        @property
        def format_dict(self) -> dict:
            return {"n": self.n, "total": self.total, "rate": None, "unit": self.unit}

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.close()

    return ByteBar
