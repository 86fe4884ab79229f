"""Helpers for the tests that fit: the tiny ``kvhub fit`` command line, and two ranks of a distributed fit.

``tiny_fit_args`` spells the command line once: a few short sequences of the tiny pair in float32 on the CPU
(``--samples 12 --seq-len 24 --stride 1``).  A test names only what it changes; ``None`` drops a flag.
``run_two_ranks`` forks the two gloo ranks that the checkpoint and sharded-fit tests run.
"""

from __future__ import annotations

import socket

TINY_FIT = {"samples": 12, "seq_len": 24, "stride": 1, "dtype": "float32", "device": "cpu"}


def _flag(name: str) -> str:
    return "--" + name.rstrip("_").replace("_", "-")  # lambda_ -> --lambda, batch_size -> --batch-size


def tiny_fit_args(src, dst, *extra, calib=None, **overrides) -> list[str]:
    """``kvhub fit`` arguments (after the program name) for the tiny pair ``src`` -> ``dst``.

    ``overrides`` set or replace options by their name (``seq_len=16``, ``lambda_="1e-9"``, ``db=url``):
    ``None`` or ``False`` leaves the option out, ``True`` gives a bare flag (``json=True``: ``--json``).
    ``extra`` arguments go last, as they are.
    """
    options = {**TINY_FIT, **overrides}
    args = ["fit", "--src", str(src), "--dst", str(dst)]
    if calib is not None:
        args += ["--calib", str(calib)]
    for name, value in options.items():
        if value is None or value is False:
            continue
        args += [_flag(name)] if value is True else [_flag(name), str(value)]
    return args + [str(arg) for arg in extra]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_two_ranks(target, *args, timeout: float = 60) -> list[int]:
    """Fork ranks 0 and 1 as ``target(rank, port, *args)`` (``port``: a free one for the gloo rendezvous), wait
    up to ``timeout`` seconds for each and kill one still running; returns their exit codes."""
    import multiprocessing

    port = free_port()
    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=target, args=(rank, port, *args)) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    return [proc.exitcode for proc in procs]


def token_ids(n: int, t: int, seed: int):
    """(n, t) random token ids below 128 (the tiny models' vocabularies), seeded."""
    import torch

    return torch.randint(0, 128, (n, t), generator=torch.Generator().manual_seed(seed))


def fit_tiny(
    source,
    target,
    *,
    train=(24, 32),
    heldout=(6, 32),
    source_id="tiny/src",
    target_id="tiny/dst",
    progress=None,
    **options,
):
    """``kvhub.fitting.fit.fit`` of two in-memory models on random ids: ``train`` and ``heldout`` (sequences,
    tokens) seeded 0 and 1, or the id tensors themselves; every token a row (``stride=1``), batches of 8;
    ``options`` set the other :class:`kvhub.fitting.options.FitOptions` fields (``ridge_lambda=1e-9``, ...)."""
    from kvhub.fitting.fit import fit
    from kvhub.fitting.options import FitOptions

    return fit(
        source,
        target,
        token_ids(*train, 0) if isinstance(train, tuple) else train,
        token_ids(*heldout, 1) if isinstance(heldout, tuple) else heldout,
        source_id=source_id,
        target_id=target_id,
        options=FitOptions(**{"stride": 1, "batch_size": 8, **options}),
        progress=progress,
    )


def live_and_spooled(source, target, train, heldout, options, *, job: str):
    """The fit's statistics two ways over the same batches: with the source live beside the target (one-phase
    capture) and a spool the source alone filled (phase 1 of the two-phase capture), for a test to read back.
    Returns (layout, batches, live outcome, spool)."""
    from kvhub.core.rope import Rotary
    from kvhub.fitting.fit import accumulate_passes, fit_batches, layout_for
    from kvhub.fitting.modes import ONE_PASS
    from kvhub.fitting.phases import LiveSource, fill_spool
    from kvhub.fitting.spool import Spool

    layout = layout_for(source.config, target.config)
    batches = fit_batches(train, heldout, options.batch_size)
    live = accumulate_passes(
        LiveSource(source, Rotary.from_model(source), stride=options.stride, skip_first=0),
        target,
        batches,
        layout,
        mode=ONE_PASS,
        options=options,
        progress=None,
        job="j",
    )
    spool = Spool.for_job(job * 24, batches=len(batches), layers=layout.src_layers)
    fill_spool(source, batches, spool, stride=options.stride, skip_first=0)
    return layout, batches, live, spool


def assert_same_statistics(expected, actual, *, atol: float) -> None:
    """Every train and held-out statistic of ``actual`` equals ``expected``'s to ``atol`` (in float64)."""
    import torch

    for split in ("train", "heldout"):
        a, b = expected.stats[split].state_dict(), actual.stats[split].state_dict()
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(b[key].double(), a[key].double(), rtol=0, atol=atol, msg=key)
