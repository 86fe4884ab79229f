"""Fetch the known models without the Hugging Face Hub: a wrapper of ``kvhub fetch models`` (kvhub.models.fetch).

    python benchmarks/fetch_models.py [ARGS]     # = kvhub fetch models [ARGS]
    python benchmarks/fetch_models.py --evals    # also kvhub fetch evals

Kept so that older notes and scripts still work; use ``kvhub fetch`` directly.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import click

from kvhub.cli.main import main


def run(argv: list[str]) -> int:
    """Run ``kvhub fetch models`` with ``argv`` (old ``--model NAME`` spelling accepted), then
    ``kvhub fetch evals`` when ``--evals`` is among them; the first non-zero exit code wins."""
    evals = "--evals" in argv
    args = [arg for arg in argv if arg not in ("--evals", "--model")]
    for command in (["fetch", "models", *args], ["fetch", "evals"] if evals else None):
        if command is None:
            continue
        try:
            main(command, standalone_mode=False)
        except click.ClickException as exc:  # a usage error
            exc.show()
            return exc.exit_code
        except SystemExit as exc:  # a KVHubError, already reported by kvhub's group
            if exc.code:
                return int(exc.code)
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
