"""``python -m kvhub``: the CLI, so that ``torchrun -m kvhub fit ...`` starts one fit per rank."""

from kvhub.cli.main import main

main()
