"""The ``kvhub`` click group.  Each command family lives in its own module and is attached here."""

from __future__ import annotations

import logging
import sys

import click

from kvhub import __version__
from kvhub.errors import Interrupted, KVHubError, exit_codes

HELP_OPTIONS = ["-h", "--help"]


class KVHubGroup(click.Group):
    """Maps KVHubError to a one-line message on stderr and the error's exit code, Ctrl-C to exit 130
    (click's own handler says "Aborted!" and exits 1); a reader that closes the pipe early (``| head``)
    ends the command quietly."""

    def invoke(self, ctx):
        from kvhub.cli.console import say

        try:
            result = super().invoke(ctx)
            sys.stdout.flush()  # a closed pipe surfaces here, not at interpreter exit
            return result
        except KVHubError as exc:
            say(str(exc), label="error:", style="bold red")  # verbatim: never read as Rich markup
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:  # a command with more to say (fit: where to resume) said it already
            say("interrupted", label="error:", style="bold red")
            sys.exit(Interrupted.exit_code)
        except BrokenPipeError:
            # `kvhub show REF | head -2`: the reader has what it wanted; not an error.  Point stdout at
            # /dev/null so the interpreter's final flush does not raise again.
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)


def _exit_code_table() -> str:
    """The exit statuses of kvhub.errors as a help epilog (\b: click keeps its lines as they are)."""
    lines = [f"{code:>6}  {name:<24} {meaning}" for code, name, meaning in exit_codes()]
    return "\b\nExit codes (also in docs/cli.md):\n" + "\n".join([f"{'status':>6}  {'raised as':<24} meaning", *lines])


@click.group(cls=KVHubGroup, context_settings={"help_option_names": HELP_OPTIONS}, epilog=_exit_code_table())
@click.version_option(__version__, prog_name="kvhub")
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages to stderr.")
def main(verbose: bool) -> None:
    """kvhub: map one LLM's KV cache into a larger model of the same family.

    Fit a mapper (kvhub fit), keep its versions in the store (kvhub list/show/tag),
    publish it (kvhub push/pull), and load it in serving code (kvhub.load(src, dst).transfer(cache)).

    Data goes to stdout (tables never wrap or cut when piped; --format json|tsv for scripts), messages
    and progress to stderr: bars on a terminal, else a plain line per step every
    $KVHUB_PROGRESS_INTERVAL seconds (30) and when it completes; HF_HUB_DISABLE_PROGRESS_BARS=1 turns
    the bars into those lines too.  Ctrl-C exits with 130; every exit status is listed below.
    `kvhub COMMAND -h` shows a command's options.
    """
    # -v is kvhub's own debug log only: other libraries' DEBUG output (httpcore logs raw HTTP headers,
    # which can echo a token) stays off.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    from kvhub.hub.client import install_secret_filter

    install_secret_filter()  # a token a server echoes back never reaches stderr, whichever library logs it
    logging.getLogger("kvhub").setLevel(logging.DEBUG if verbose else logging.NOTSET)
    from kvhub.cli.progress import quiet_other_bars

    quiet_other_bars()  # before huggingface_hub is imported: its download bars only on a terminal


def _attach() -> None:
    """Attach each command family; every module defines ``attach(group)``."""
    from kvhub.cli import bench_cmd, calib_cmd, eval_cmd, eval_serve_cmd, fetch_cmd, fit_cmd, hub_cmd, plan_cmd
    from kvhub.cli import report_cmd, store_cmd

    main.add_command(fit_cmd.fit)
    main.add_command(plan_cmd.plan)
    calib_cmd.attach(main)  # calib list, show, fetch, build
    store_cmd.attach(main)  # list, show, tag, untag, rm, gc, export, import, db
    hub_cmd.attach(main)  # push, pull, search
    eval_cmd.attach(main)  # eval
    bench_cmd.attach(main)  # bench
    report_cmd.attach(main)  # report
    eval_serve_cmd.attach(main)  # eval-serve
    main.add_command(fetch_cmd.fetch)  # fetch models, evals
    from kvhub.cli import serve_cmd  # its own import line: the one above is shared with other command families

    serve_cmd.attach(main)  # serve


_attach()
