"""``kvhub fit --distributed N``: the same fit started again under torchrun on N local processes.

Each rank then joins the job by itself (:func:`kvhub.fitting.distributed.launched`,
:func:`kvhub.fitting.distributed.init_group`); the launcher only runs torchrun and returns its exit code.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Callable

log = logging.getLogger(__name__)


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m kvhub ARGS``, where ARGS is a
    ``kvhub`` command line (without the program name) with its ``--distributed`` option dropped."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--distributed":
            skip = True
        elif not arg.startswith("--distributed="):
            kept.append(arg)
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "kvhub",
        *kept,
    ]


def launch_torchrun(nproc: int, args: list[str], *, notify: Callable[[str], None] | None = None) -> int:
    """Run the ``kvhub`` command line ``args`` under torchrun on ``nproc`` local processes; returns its exit
    code.  Refuse what the request shows will fail first (:func:`kvhub.fitting.job.check_request`).

    torchrun puts each rank in a session of its own, so a kill of this process reaches neither: torchrun
    gets SIGTERM when this process dies (it then stops its ranks), and each rank when torchrun dies
    (:func:`kvhub.fitting.distributed.die_with_launcher`)."""
    from kvhub.env import die_with_parent
    from kvhub.fitting.distributed import LAUNCHER

    command = torchrun_command(nproc, args)
    (notify or log.info)("running " + " ".join(command[1:]))
    return subprocess.call(command, env={**os.environ, LAUNCHER: str(os.getpid())}, preexec_fn=die_with_parent())
