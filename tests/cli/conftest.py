"""Tests of the command line's shared behaviour (kvhub.cli): output formats, tables, numbers, progress, option
names, -h and exit codes.  Shared helpers stay at tests/ (from tests.x import ...); fixtures only these files
use live here."""
