"""``kvhub calib``: the calibration-set catalog (list, show), fetching corpora, building token sequences."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click

from kvhub.errors import ConfigError
from kvhub.cli.console import console, say
from kvhub.cli.output import echo_json, format_option, print_table


@click.group()
def calib() -> None:
    """Calibration sets: the text a mapper is fitted on.

    Built-in sets are recipes in registry/calibration/*.toml.  Anywhere a set is named (here, or
    `kvhub fit --calib`), you may instead pass a directory of text files, a .txt file, a .jsonl file
    (a `text` field per line), a recipe .toml, or hf:<dataset>[:<config>]:<split>:<field>.
    See docs/calibration.md.
    """


def _recipe_row(recipe) -> dict:
    sequences = recipe.sequences
    return {
        "name": recipe.name,
        "version": recipe.version,
        "sequences": sequences.samples,
        "heldout_sequences": sequences.heldout_samples,
        "seq_len": sequences.seq_len,
        "licence": recipe.licence,
        "description": recipe.description,
    }


@calib.command("list")
@format_option
def list_command(output_format: str) -> None:
    """List the built-in calibration sets with their default sizes.

    \b
    kvhub calib list
    """
    from kvhub.calib import list_calibration_sets

    rows = [_recipe_row(recipe) for recipe in list_calibration_sets()]
    if output_format == "json":
        echo_json(rows)
        return
    table = []
    for row in rows:
        size = f"{row['sequences']} + {row['heldout_sequences']} x {row['seq_len']}"
        what = re.split(r": | \(|\. ", row["description"], maxsplit=1)[0].strip()
        licence = re.split(r"; | \(", row["licence"], maxsplit=1)[0]
        table.append([row["name"], row["version"], size, licence, what])
    print_table(["NAME", "V", "SEQUENCES", "LICENCE", "WHAT"], table, output_format=output_format)


@calib.command("show")
@click.argument("name")
@format_option
def show_command(name: str, output_format: str) -> None:
    """Show a calibration recipe and where each of its sources is on this machine.

    \b
    kvhub calib show legal-docs
    kvhub calib show ./my-set.toml
    """
    from kvhub.calib import recipe_from_spec, source_status

    recipe = recipe_from_spec(name)
    data = {**recipe.to_dict(), "origin": recipe.origin, "status": source_status(recipe)}
    if output_format == "json":
        echo_json(data)
        return
    sequences = recipe.sequences
    if output_format == "tsv":
        fields = [
            ("name", recipe.name),
            ("version", recipe.version),
            ("origin", recipe.origin or ""),
            ("licence", recipe.licence),
            ("samples", sequences.samples),
            ("seq_len", sequences.seq_len),
        ]
        fields += [(f"source.{i}", f"{s['source']} ({s['where']})") for i, s in enumerate(data["status"])]
        print_table(None, fields, output_format="tsv")
        return
    say(
        f"v{recipe.version}  ({recipe.origin or 'synthesised from a path'})",
        label=recipe.name,
        style="bold",
        to=console,
    )
    say(recipe.description, to=console)
    say(f"licence: {recipe.licence}", to=console)
    say(
        f"sequences: {sequences.samples} train + {sequences.heldout_samples} held-out x {sequences.seq_len} tokens, "
        f"seed {sequences.seed}, stride {sequences.stride}, max {sequences.max_document_tokens or 'all'} tokens "
        f"per document",
        to=console,
    )
    for status in data["status"]:
        optional = "" if status["required"] else " (optional)"
        say(f"- {status['source']}{optional}\n    {status['where']}", to=console)


@calib.command("fetch")
@click.argument("names", nargs=-1, required=True)
@format_option
def fetch_command(names: tuple[str, ...], output_format: str) -> None:
    """Download the corpora of calibration sets into the cache (nothing is installed).

    \b
    kvhub calib fetch legal-docs medical
    """
    from kvhub.calib import fetch_corpus
    from kvhub.cli.progress import progress_callback

    rows = []
    for name in names:
        with progress_callback("items") as callback:
            rows += [[name, line] for line in fetch_corpus(name, progress=callback)]
    if output_format == "json":
        echo_json([{"name": name, "source": line} for name, line in rows])
    else:
        print_table(["NAME", "SOURCE"], rows, output_format=output_format)


def load_tokenizer(spec: str):
    """A tokenizer from a model directory, a .gguf file, a tokenizer.json, or a (cached/Hub) model id."""
    from kvhub.models.loading import find_known, resolve_model_path

    path = Path(spec).expanduser()
    resolved = resolve_model_path(spec)
    known = find_known(spec)
    if isinstance(resolved, str) and known is not None:  # not fetched: fail now, not after Hub retries
        raise ConfigError(f"{spec} is not fetched on this machine; fetch it with `{known.fetch_command}`")
    try:
        if path.is_file() and path.name.endswith(".json"):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        from transformers import AutoTokenizer

        from kvhub.hub.client import one_line_per_record

        one_line_per_record(load=True)  # a Hub download's retry warnings once each, as kvhub search prints them
        if isinstance(resolved, Path) and resolved.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(resolved.parent, gguf_file=resolved.name)
        return AutoTokenizer.from_pretrained(str(resolved))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot load a tokenizer from {spec!r} ({exc}); pass a model directory, a .gguf file or a "
            "tokenizer.json (known models are fetched with `kvhub fetch models`)"
        ) from exc


@calib.command("build")
@click.argument("name")
@click.option(
    "--tokenizer",
    "tokenizer_spec",
    required=True,
    help="Model whose tokenizer packs the text: a model directory, .gguf file, tokenizer.json or model id.",
)
@click.option("--samples", type=int, help="Train sequences (overrides the recipe).")
@click.option("--seq-len", type=int, help="Tokens per sequence (overrides the recipe).")
@click.option("--heldout-fraction", type=float, help="Held-out share of all sequences (overrides the recipe).")
@click.option("--seed", type=int, help="Document shuffle seed (overrides the recipe).")
@click.option("--allow-fewer", is_flag=True, help="Use fewer sequences when the corpus is too small (with a warning).")
@format_option
def build_command(name, tokenizer_spec, samples, seq_len, heldout_fraction, seed, allow_fewer, output_format) -> None:
    """Fetch, tokenize and pack a calibration set into the cache; print its content hash.

    \b
    kvhub calib build legal-docs --tokenizer Qwen/Qwen2.5-Coder-0.5B-Instruct
    kvhub calib build ./notes --tokenizer ./my-model --samples 32
    """
    from kvhub.calib import resolve_calibration
    from kvhub.calib.packing import NO_CHAT_TEMPLATE
    from kvhub.cli.progress import progress_callback

    tokenizer = load_tokenizer(tokenizer_spec)
    with progress_callback("items") as callback:
        calibration_set = resolve_calibration(
            name,
            tokenizer=tokenizer,
            tokenizer_id=tokenizer_spec,
            samples=samples,
            seq_len=seq_len,
            heldout_fraction=heldout_fraction,
            seed=seed,
            progress=callback,
            allow_fewer=allow_fewer,
        )
    metadata = {**calibration_set.to_metadata(), "cache_path": calibration_set.cache_path}
    for note in calibration_set.notes:
        if note != NO_CHAT_TEMPLATE:  # resolve_calibration warns of that one itself, each time a set is used
            say(note, label="warning:", style="yellow")
    if output_format == "json":
        echo_json(metadata)
        return
    if output_format == "tsv":
        print_table(
            None,
            [
                (key, json.dumps(value) if isinstance(value, (dict, list)) else value)
                for key, value in sorted(metadata.items())
            ],
            output_format="tsv",
        )
        return
    console.print(
        f"{metadata['name']} v{metadata['version']}: {metadata['sequences']} train + "
        f"{metadata['heldout_sequences']} held-out sequences x {metadata['seq_len']} tokens "
        f"({metadata['documents']['train']} + {metadata['documents']['heldout']} documents)",
        highlight=False,
    )
    console.print(f"content hash {metadata['content_hash']}", highlight=False)
    if metadata["cache_path"]:  # None: the disk was full (a warning said so)
        console.print(f"cached at {metadata['cache_path']}", highlight=False)


def attach(main: click.Group) -> None:
    main.add_command(calib)
