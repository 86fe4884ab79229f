"""``kvhub push`` / ``kvhub pull`` / ``kvhub search``: the Hugging Face Hub side of the store."""

from __future__ import annotations

import click

from kvhub.cli.console import console, say
from kvhub.cli.options import db_option, one_value, open_db
from kvhub.cli.output import echo_json, format_number, format_option, format_size, print_record, print_table


def token_option(command):
    """--token: a Hub token for this command (default: HF_TOKEN or `hf auth login`); never printed."""
    return click.option(
        "--token", default=None, metavar="TOKEN", help="Hub token (default: HF_TOKEN or the `hf auth login` token)."
    )(command)


@click.command()
@click.argument("ref")
@click.option("--repo", "repo_id", required=True, help="Hub repository OWNER/NAME (created if missing).")
@click.option("--private", is_flag=True, help="Create the repository private (refused if it exists and is public).")
@click.option(
    "--revision",
    "--branch",
    "branch",
    default="main",
    show_default=True,
    help="Branch that receives the commit (created if missing; --branch is its older name).",
)
@click.option(
    "--card",
    type=click.Choice(["auto", "keep", "replace"]),
    default="auto",
    show_default=True,
    help="README.md: auto = replace it unless it was edited on the Hub; keep; replace (also refreshes "
    "the card of a version published already, with the evaluations stored since).",
)
@click.option(
    "--base-model",
    default=None,
    metavar="SRC,DST",
    help="Hub ids of the source and target models: they name the models in everything published "
    "(card, mapper.json, search), needed when the mapper was fitted from local paths (a series' next "
    "version reuses those of its last push to the repository). Checked against the mapper's fingerprints "
    "where their configs can be read offline.",
)
@click.option(
    "--license",
    "license_id",
    default=None,
    metavar="ID",
    help="The card's licence, a Hub licence id (e.g. the base models' apache-2.0); default: the licence of "
    "the series' last push to the repository, else the calibration text's when it is one.",
)
@click.option("--license-name", default=None, metavar="SLUG", help="With --license other: the licence's name.")
@click.option(
    "--license-link",
    default=None,
    metavar="URL",
    help="With --license other: a link to the licence text (a URL or a file in the repository).",
)
@click.option(
    "--figures",
    default=None,
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="Add the figures in DIR (e.g. the --out of `kvhub report`) to the commit and the card; for a "
    "version published already, they are added with a refreshed card.",
)
@click.option("--commit-message", default=None, help="Title of the commit (default: kvhub vN: SRC -> DST (CALIB)).")
@click.option(
    "--create-pr",
    is_flag=True,
    help="Open a pull request instead of committing; push again once it is merged to tag the version.",
)
@token_option
@db_option
@format_option
def push(
    ref,
    repo_id,
    private,
    branch,
    card,
    base_model,
    license_id,
    license_name,
    license_link,
    figures,
    commit_message,
    create_pr,
    token,
    db,
    output_format,
):
    """Publish the mapper version REF to the Hub: one commit, tagged vN.

    \b
    kvhub push src:dst:calib@v1 --repo acme/kvmap --base-model Qwen/Qwen2.5-0.5B,Qwen/Qwen2.5-1.5B

    The commit holds mapper.safetensors, mapper.json and a generated model card (README.md), naming
    the models by their Hub ids (--base-model, or known from the model); the tag (v3 for version 3)
    keeps every published version reachable.  Pushing a version again does nothing, unless
    --card replace or --figures: then its card is refreshed on the branch (with every evaluation
    stored since).  A README.md edited on the Hub is kept unless --card replace.  Needs a write
    token (--token, HF_TOKEN or `hf auth login`).
    """
    from kvhub.hub import push as push_version
    from kvhub.hub.card import card_license
    from kvhub.hub.identity import BaseModelError

    from kvhub.cli.progress import hub_transfer

    chosen = card_license(license_id, name=license_name, link=license_link)
    with open_db(db, create=False) as store:
        size = format_size(store.resolve(ref).artifact_bytes)  # the upload reports no bytes to draw a bar from
        with hub_transfer(f"pushing {ref} ({size}) to {repo_id}"):
            try:
                result = push_version(
                    store,
                    ref,
                    repo_id,
                    private=private,
                    revision=branch,
                    card=card,
                    token=token,
                    base_model=_base_models(base_model),
                    license=chosen,
                    figures=figures,
                    commit_message=commit_message,
                    create_pr=create_pr,
                )
            except BaseModelError as exc:
                raise BaseModelError(exc.option_text, option_text=exc.option_text) from None
            full_ref = store.resolve(ref).ref
    for note in result.notes:
        say(note, label="note:")
    if not print_record(
        {
            "ref": full_ref,
            "repo_id": result.repo_id,
            "tag": result.tag,
            "commit_sha": result.commit_sha,
            "branch": result.branch,
            "url": result.url,
            "card": result.card,
            "already_published": result.already_published,
            "pull_request": result.pull_request,
        },
        output_format=output_format,
    ):
        console.print(_push_line(ref, result, size=size), highlight=False, markup=False, soft_wrap=True)


def _push_line(ref: str, result, *, size: str) -> str:
    """What `kvhub push` did, in one line (and the URL)."""
    if result.pull_request:
        return f"opened a pull request on {result.repo_id} for {ref}: {result.pull_request}"
    if result.already_published and result.card == "replaced":
        return (
            f"refreshed the card of {ref} on {result.repo_id}@{result.branch} (commit {result.commit_sha[:12]}; "
            f"tag {result.tag} keeps its commit)\n{result.url}"
        )
    if result.already_published:
        return (
            f"{ref} is already published as {result.repo_id}@{result.tag} (commit {result.commit_sha[:12]}); "
            "nothing to do"
        )
    return (
        f"pushed {ref} ({size}) to {result.repo_id}@{result.tag} (commit {result.commit_sha[:12]} on {result.branch}, "
        f"card {result.card})\n{result.url}"
    )


@click.command()
@click.argument("repo", required=False)
@click.option(
    "--repo",
    "repo_option",
    default=None,
    metavar="OWNER/NAME[@REVISION]",
    help="The repository, as push names it (the same as the REPO argument).",
)
@click.option("--revision", default=None, help="Branch, tag or commit (same as OWNER/NAME@REVISION; default main).")
@token_option
@db_option
@format_option
def pull(repo, repo_option, revision, token, db, output_format):
    """Download a mapper from the Hub, verify it, and register it in the store.

    \b
    kvhub pull acme/kvmap-qwen-legal@v3
    kvhub pull --repo acme/kvmap-qwen-legal@v3

    Checks the artifact format version, the sha256 of the tensors and the fingerprints before anything
    is registered; records where it came from (repository, tag, commit) in the version's lineage.  The
    version keeps the Hub's number (v3 above) when the store never used it for these models and
    calibration set; otherwise alias hub-v3 names it.  Weights the store already holds are that version
    (pulling again is a no-op).  The models are named as the publisher named them on the Hub, so
    `kvhub list --src OWNER/MODEL` finds the version.  With HF_HUB_OFFLINE=1 only the local Hugging
    Face cache is used.
    """
    from kvhub.hub import pull as pull_repo

    repo = one_value(repo, repo_option, what="the repository", argument="REPO", option="--repo")

    from kvhub.cli.progress import hub_transfer

    with open_db(db) as store, hub_transfer(f"pulling {repo}", sized=True) as progress:
        result = pull_repo(store, repo, revision=revision, token=token, progress=progress)
        reference = store.reference(result.version)
    if print_record(
        {
            "ref": result.version.ref,
            "version": result.version.version,
            "alias": result.alias,
            "repo_id": result.repo_id,
            "revision": result.revision,
            "commit_sha": result.commit_sha,
            "already_registered": result.already_registered,
        },
        output_format=output_format,
    ):
        return
    also = (
        f" (also @{result.alias}: the store's v{result.version.version} is the Hub's {result.revision})"
        if result.alias
        else ""
    )
    if result.already_registered:
        say(
            f"{result.repo_id}@{result.revision} is already in the store as {reference}{also}; nothing to do",
            to=console,
        )
    else:
        say(
            f"pulled {result.repo_id}@{result.revision} (commit {result.commit_sha[:12]}) -> registered "
            f"{reference}{also}",
            to=console,
        )


@click.command()
@click.option("--src", default=None, help="Source model id (as in the card's base_model).")
@click.option("--dst", default=None, help="Target model id.")
@click.option("--calib", default=None, help="Calibration-set name.")
@click.option("--author", default=None, help="Only repositories of this user or organisation.")
@click.option("--limit", type=int, default=100, show_default=True, help="Most repositories to look at.")
@token_option
@format_option
def search(src, dst, calib, author, limit, token, output_format):
    """List mappers published on the Hub (library_name: kvhub), e.g. for a model pair.

    \b
    kvhub search --src Qwen/Qwen2.5-Coder-0.5B-Instruct --dst Qwen/Qwen2.5-Coder-1.5B-Instruct
    """
    from dataclasses import asdict

    from kvhub.hub import search as search_hub

    found = search_hub(source=src, target=dst, calibration=calib, author=author, limit=limit, token=token)
    if output_format == "json":
        echo_json([dict(asdict(m), ref=f"{m.repo_id}@{m.version}" if m.version else m.repo_id) for m in found])
        return
    if not found and output_format == "table":
        say("no kvhub mappers on the Hub match; publish one with `kvhub push`")
        return
    rows = []
    for m in found:
        r2 = [m.metrics.get(f"heldout_r2_{kind}_mean") for kind in ("k", "v")]
        rows.append(
            [
                m.repo_id,
                "private" if m.private else "public",
                m.source,
                m.target,
                m.calibration or "-",
                m.version or "-",
                m.k if m.k is not None else "-",
                *(format_number(x, exact=output_format == "tsv") if isinstance(x, (int, float)) else "-" for x in r2),
                (m.last_modified or "")[:10],
            ]
        )
    print_table(
        ["REPOSITORY", "VISIBILITY", "SOURCE", "TARGET", "CALIBRATION", "VERSION", "K", "R2 K", "R2 V", "UPDATED"],
        rows,
        output_format=output_format,
        right=("K", "R2 K", "R2 V"),
    )


def _base_models(option: str | None) -> tuple[str, str] | None:
    """--base-model SRC,DST as a pair of ids."""
    from kvhub.errors import ConfigError

    if option is None:
        return None
    parts = [part.strip() for part in option.split(",")]
    if len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"--base-model {option!r}: give two Hub model ids, SRC,DST, e.g. "
            "--base-model Qwen/Qwen2.5-Coder-0.5B-Instruct,Qwen/Qwen2.5-Coder-1.5B-Instruct"
        )
    return parts[0], parts[1]


def attach(group: click.Group) -> None:
    """Register push, pull and search on the ``kvhub`` group."""
    for command in (push, pull, search):
        group.add_command(command)
