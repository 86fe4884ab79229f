"""A mapper's identity on the Hub: the Hub ids of its two models, and mapper.json as published.

A mapper fitted from local model folders names them by path in the store.  What leaves the machine
names them by Hub id instead (``base_model=`` / ``--base-model``, or the id of a known model a path
names), in mapper.json, the card and the commit title alike, so that whoever pulls it, searches for it
or calls ``kvhub.load`` finds it by those ids, and no local path (user name, directory layout) is
published.  Only names change: tensors, fingerprints' hashes and configs are the same bytes.
"""

from __future__ import annotations

import copy
import re

from kvhub.errors import ConfigError
from kvhub.hub.client import is_repo_id

# a directory prefix inside one whitespace-free word: "/home/ann/corpus", "C:\\data\\", "./notes/"
_DIRECTORY_PREFIX = re.compile(r"(?:[A-Za-z]:)?[^\s:()]*[/\\]")


class BaseModelError(ConfigError):
    """A model is a local path kvhub cannot map to a Hub id; ``role`` is "source" or "target".  The
    message names the Python keyword; the CLI names its option instead (``option_text``)."""

    def __init__(self, message: str, *, option_text: str):
        super().__init__(message)
        self.option_text = option_text


def is_hub_id(name: str) -> bool:
    """``owner/name`` as the Hub spells repository ids (a local path, or a local ``x/model.gguf``, never is one)."""
    return is_repo_id(name) and not name.endswith(".gguf")


def _known_hub_id(model_id: str) -> str | None:
    """The Hub id of a known model (registry/models.toml) a local path names by its directory or GGUF file."""
    from kvhub.models.loading import known_models
    from kvhub.store.refs import short_name

    last = short_name(model_id)
    for model in known_models().values():
        if last.lower() in (model.name.lower(), model.gguf_file.lower(), short_name(model.hf_id).lower()):
            return model.hf_id
    return None


def base_models(metadata: dict, override: tuple[str, str] | None = None) -> tuple[str, str]:
    """Hub ids of (source, target): ``override`` (``base_model=``), else each fingerprint's model id when
    it is a Hub id, else the id of the known model a local path names.  BaseModelError when a model is a
    local path kvhub cannot map: a path must never be published."""
    if override is not None:
        bad = [name for name in override if not is_hub_id(name)]
        if bad:
            raise ConfigError(
                f"base model {bad[0]!r} is not a Hub model id; write OWNER/NAME, e.g. Qwen/Qwen2.5-Coder-0.5B-Instruct"
            )
        return override[0], override[1]
    ids = []
    for role in ("source", "target"):
        model_id = metadata[role]["model_id"]
        hub_id = model_id if is_hub_id(model_id) else _known_hub_id(model_id)
        if hub_id is None:
            what = (
                f"the {role} model is the local path {model_id}, which is no known model and must not be "
                "published; name the Hub ids it was downloaded from"
            )
            raise BaseModelError(
                f"{what}: base_model=(SRC_ID, DST_ID)", option_text=f"{what}: --base-model SRC_ID,DST_ID"
            )
        ids.append(hub_id)
    return ids[0], ids[1]


def check_base_models(metadata: dict, bases: tuple[str, str]) -> list[str]:
    """Refuse Hub ids ``bases`` that are clearly not the models the mapper was fitted on: the config kvhub can
    read for an id offline (:func:`kvhub.models.configs.load_config`: a fetched known model, a shipped config,
    the Hugging Face cache) gives another layer count, KV head count, head dim or model type than the
    fingerprint of that role (BaseModelError naming both).  Returns a one-line note naming the ids no config
    was found for (unchecked); ids the fingerprints record themselves are not checked."""
    from kvhub.models.configs import geometry_differs, geometry_text, kv_geometry, load_config

    unchecked = []
    for role, hub_id in zip(("source", "target"), bases):
        fingerprint = metadata[role]
        if hub_id == fingerprint.get("model_id"):
            continue
        try:
            config, _ = load_config(hub_id)
        except ConfigError:
            unchecked.append(hub_id)
            continue
        theirs = kv_geometry(config)
        if geometry_differs(theirs, fingerprint):
            what = (
                f"the {role} base model {hub_id} is not the model this mapper was fitted on: its config has "
                f"{geometry_text(theirs)}, the mapper's {role} {fingerprint.get('model_id')} has "
                f"{geometry_text(fingerprint)}; name the Hub ids of the models it was fitted on"
            )
            raise BaseModelError(
                f"{what}: base_model=(SRC_ID, DST_ID)", option_text=f"{what}: --base-model SRC_ID,DST_ID"
            )
    if not unchecked:
        return []
    return [
        f"could not check the base model{'s' if len(unchecked) > 1 else ''} {', '.join(unchecked)} against the "
        "mapper's fingerprints: no config of them offline (fetched, shipped or in the Hugging Face cache); "
        "make sure they are the models it was fitted on"
    ]


def published_metadata(metadata: dict, bases: tuple[str, str]) -> dict:
    """mapper.json as it is published: source and target named by their Hub ids ``bases``, every other
    mention of their local paths replaced by those ids, the calibration tokenizer named by a Hub id, and
    local calibration sources by their last path component only."""
    published = copy.deepcopy(metadata)
    renamed = {}
    for role, hub_id in zip(("source", "target"), bases):
        local = published[role]["model_id"]
        if local != hub_id and re.search(r"[/\\]", local):  # a bare name may occur in unrelated text
            renamed[local] = hub_id
        published[role]["model_id"] = hub_id
    calibration = published.get("calibration")
    if isinstance(calibration, dict):
        tokenizer = calibration.get("tokenizer_id")
        if isinstance(tokenizer, str) and not is_hub_id(tokenizer):  # one tokenizer: fitting checked they agree
            calibration["tokenizer_id"] = renamed.get(tokenizer, bases[0])
        if isinstance(calibration.get("sources"), list):
            calibration["sources"] = [_public_source(s) for s in calibration["sources"]]
    return _replace_strings(published, renamed)


def _public_source(source):
    """'path:/home/ann/corpus (40 documents)' -> 'path:corpus (40 documents)'; other kinds unchanged."""
    if not (isinstance(source, str) and source.startswith("path:")):
        return source
    return "path:" + _DIRECTORY_PREFIX.sub("", source[len("path:") :])


def _replace_strings(obj, renamed: dict[str, str]):
    """``obj`` with every occurrence of a key of ``renamed`` in its strings replaced by the value."""
    if not renamed:
        return obj
    if isinstance(obj, str):
        for local in sorted(renamed, key=len, reverse=True):  # /a/src-large before /a/src
            obj = obj.replace(local, renamed[local])
        return obj
    if isinstance(obj, dict):
        return {key: _replace_strings(value, renamed) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_replace_strings(value, renamed) for value in obj]
    return obj
