"""Publish mapper versions to the Hugging Face Hub and fetch them back (see docs/hub.md).

    push(store, "qwen-0.5b:qwen-1.5b:legal@3", "acme/kvmap")  -> one commit on a branch + tag "v3"
    pull(store, "acme/kvmap@v3")                                -> verified, registered MapperVersion
    search(source=SRC, target=DST)                              -> mappers published for a pair
    load_from_hub(store, SRC, DST, calibration=...)             -> the fallback of kvhub.load()

Modules: ``client`` (settings, HfApi, error translation), ``identity`` (the models' Hub ids, mapper.json
as published), ``verify`` (what an artifact must satisfy), ``push``, ``pull`` (and the load fallback),
``search``.  The model card is kvhub.hub.card, with the store's measurements on it in kvhub.hub.evaluations.

Settings are read when a function runs, not when a module is imported: ``HF_ENDPOINT``,
``HF_HUB_OFFLINE`` (either the variable or huggingface_hub's own flag switches kvhub to the local
cache), ``HF_HUB_CACHE``/``HF_HOME`` and ``KVHUB_HUB_NAMESPACES``.  Tokens come from huggingface_hub
(``HF_TOKEN`` or ``hf auth login``) unless passed explicitly; kvhub never prints, logs or stores them,
and masks them in any message it raises.
"""

from kvhub.hub.client import HubSettings, hub_settings, parse_repo_ref
from kvhub.hub.pull import NAMESPACES_ENV, PullResult, configured_namespaces, load_from_hub, pull
from kvhub.hub.push import CARD_MODES, PushResult, push, version_tag
from kvhub.hub.search import HubMapper, search
from kvhub.hub.verify import same_model, verify_artifact

__all__ = [
    "CARD_MODES",
    "NAMESPACES_ENV",
    "HubMapper",
    "HubSettings",
    "PullResult",
    "PushResult",
    "configured_namespaces",
    "hub_settings",
    "load_from_hub",
    "parse_repo_ref",
    "pull",
    "push",
    "same_model",
    "search",
    "verify_artifact",
    "version_tag",
]
