"""The kvhub connector's configuration, read at engine start: every value of ``kv_connector_extra_config``
checked (a ConfigError names the key), the mapper resolved and matched to the served model.  No vLLM
import: the checks are tested without an engine.

:data:`EXTRA_CONFIG` declares each key once: the roles that read it, how it is read, its default, its
meaning and the name it had before.  The accepted keys (:data:`EXTRA_KEYS`), the defaults
(:data:`EXTRA_DEFAULTS`), the renamed keys (:data:`RENAMED_KEYS`), the typed, frozen :class:`ConnectorConfig`
that :func:`read_config` builds (the one validator: the connector's at engine start, ``kvhub serve``'s before
anything starts) and the table in docs/serving.md (:func:`config_table`; tests/serving/test_connector_config.py
checks the doc) all derive from it.
The rest of the contract with vLLM (class, module, roles) is :mod:`kvhub.serving.launch`'s.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvhub.errors import ConfigError, IncompatibleError
from kvhub.serving.spec import FIELDS as RECOMPUTE_FIELDS
from kvhub.serving.spec import SERVING as SERVING_RECOMPUTE
from kvhub.serving.spec import SERVING_SELECTORS
from kvhub.serving.spec import Recompute

log = logging.getLogger("kvhub.serving")

ISOLATION_SOURCES = ("cache_salt", "kvhub_tenant")
# Prompts shorter than this are prefilled, not escalated.  Measured: the library handoff pays at 256 tokens
# (TTFT 5.6x map only, 2.4x with 4 + 16 exact; docs/benchmarks.md 1b), vLLM on CPU from 512 tokens (4.0x
# with the default recompute, the shortest length measured); on an H200 the library path pays only from ~4k:
# docs/serving.md, Short prompts.
MIN_ESCALATION_TOKENS = 256
BOTH = ("producer", "consumer")
PRODUCER = ("producer",)
CONSUMER = ("consumer",)
SOURCE_ATTENTION_QUERIES = 16  # the library's Recompute.queries: the rows select=source scores by


@dataclass(frozen=True)
class ConfigKey:
    """One ``kv_connector_extra_config`` key.  ``kind``: how it is read ("text", "count", "tokens", "flag",
    "isolation", "deshrink", "recompute": :meth:`ConnectorConfig.from_extra`); ``default``: the value the connector uses
    when the key is absent (None: none); ``shown``: the default as the docs say it, where the value alone
    does not; ``renamed_from``: (old key, why), an old key refused with this one's name."""

    name: str
    roles: tuple[str, ...]
    kind: str
    help: str
    default: Any = None
    shown: str = ""
    renamed_from: tuple[str, str] | None = None

    def shown_default(self) -> str:
        if self.shown:
            return self.shown
        if self.default is None:
            return "-"
        if isinstance(self.default, bool):
            return str(self.default).lower()
        return f"`{self.default}`" if isinstance(self.default, str) else str(self.default)


_RECOMPUTE_HELP = {  # kvhub.serving.spec.Recompute's fields as the consumer reads them
    "exact_prefix": "first prompt tokens the large model recomputes over the mapped blocks",
    "exact_suffix": "prompt tokens the large model always computes itself (at least 1)",
    "exact_budget": "fraction of the prompt (n - 1 tokens) recomputed in whole spans; 0 maps only",
    "select": "what chooses those spans: `target` (the large model's attention over the mapped blocks), `source` "
    "(the small model's, stored by the producer; `target` where an entry has none) or `random` (the control)",
    "spans": "`sentence` (whole sentences / lines) or `token`",
    "queries": "how many last prompt tokens score the prompt",
    "max_span": "the longest span recomputed whole, in tokens",
    "score": "how the queries' attention becomes one score per token: `max` or `sum`",
}
EXTRA_CONFIG: tuple[ConfigKey, ...] = (
    ConfigKey(
        "kvstore_dir",
        BOTH,
        "text",
        "the shared KV store directory; use the same path on both engines",
        shown="required",
        renamed_from=("store_dir", "the serving KV store's, not the SQL registry's"),
    ),
    ConfigKey(
        "kvstore_max_bytes",
        BOTH,
        "count",
        "size cap of the stored entries; LRU eviction keeps the KV store under it",
        default=1 << 30,
        shown="1 GiB",
        renamed_from=("store_max_bytes", "the serving KV store's, not the SQL registry's"),
    ),
    ConfigKey(
        "chunk_tokens",
        BOTH,
        "count",
        "index granularity; must be the same for every engine on a KV store, and at most the engine's "
        "`max_model_len` (both checked)",
        default=16,
    ),
    ConfigKey(
        "source_model",
        BOTH,
        "text",
        "part of the namespace; set it to the same string on both engines when the producer serves a local path",
        shown="producer: its served model; consumer: the mapper's source `model_id`",
    ),
    ConfigKey(
        "mapper",
        CONSUMER,
        "text",
        "mapper reference `SRC:DST[:CALIB][@SELECTOR]` resolved with `kvhub.load` (store, then Hub)",
    ),
    ConfigKey("mapper_path", CONSUMER, "text", "or an artifact directory"),
    ConfigKey("db", CONSUMER, "text", "the store `kvhub.load` reads", shown="kvhub's default"),
    ConfigKey("hub_repo", CONSUMER, "text", "the Hub repository `kvhub.load` falls back to", shown="kvhub's default"),
    ConfigKey(
        "deshrink",
        CONSUMER,
        "deshrink",
        "how the maps are read: de-shrunk keys and values (`kv`), values only (`v`), or as fitted (`off`); "
        "`kvhub.core.deshrink`, `kvhub serve --deshrink`",
        shown="`kv` (where the mapper stores its calibration means, else `off`)",
    ),
    *(
        ConfigKey(
            name,
            CONSUMER,
            "recompute",
            _RECOMPUTE_HELP[name],
            default=SERVING_RECOMPUTE.options()[name],
            renamed_from=("exact_tail", "the same word as kvhub.handoff's") if name == "exact_suffix" else None,
        )
        for name in RECOMPUTE_FIELDS
    ),
    ConfigKey(
        "min_escalation_tokens",
        CONSUMER,
        "tokens",
        "a prompt of fewer tokens is not escalated: nothing is loaded, the large model prefills it and the "
        'response\'s report says `fallback: "prefill"`; 0 escalates every prompt; see '
        "[Short prompts](#short-prompts-are-prefilled)",
        default=MIN_ESCALATION_TOKENS,
    ),
    ConfigKey(
        "source_attention_queries",
        PRODUCER,
        "tokens",
        "the producer stores, with each prompt's KV, the small model's attention of the prompt's last N tokens "
        "on it (what the consumer's `select=source` reads; one pass of N tokens, needs `--worker-cls` on the "
        "producer too); 0 stores none",
        default=SOURCE_ATTENTION_QUERIES,
    ),
    ConfigKey(
        "require_isolation_key",
        BOTH,
        "flag",
        "when true, requests with no isolation key are neither stored nor loaded",
        default=False,
    ),
    ConfigKey(
        "isolation_key_source",
        BOTH,
        "isolation",
        "which request field is the tenant: `cache_salt` (vLLM's, set per tenant by your gateway) or "
        '`kvhub_tenant` (`kv_transfer_params["kvhub_tenant"]`, only for a gateway that authenticates '
        "clients and sets it); see [Isolation](#isolation)",
        default="cache_salt",
    ),
    ConfigKey(
        "events_path",
        BOTH,
        "text",
        "append one JSON line per decision (`saved`, `hit`, `mapped`, `written`, `recomputed`, "
        "`recompute_skipped`, `select_fallback`, `attention_skipped`, `fallback`, `save_failed`)",
        shown="none",
    ),
)
EXTRA_KEYS = {key.name: key.roles for key in EXTRA_CONFIG}  # key -> the roles that read it
EXTRA_DEFAULTS = {key.name: key.default for key in EXTRA_CONFIG if key.default is not None}
RENAMED_KEYS = {key.renamed_from[0]: (key.name, key.renamed_from[1]) for key in EXTRA_CONFIG if key.renamed_from}


def check_extra_keys(extra) -> None:
    """ConfigError for a renamed or unknown ``kv_connector_extra_config`` key, naming the right one."""
    for old, (new, why) in RENAMED_KEYS.items():
        if old in extra:
            raise ConfigError(f"kv_connector_extra_config key {old!r} is now {new!r} ({why}); rename it")
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(EXTRA_KEYS)}")


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` read whole, once: one field per key of :data:`EXTRA_CONFIG` (its name,
    the type its kind reads to; None where the key is absent and has no default), the recompute keys as one
    ``recompute`` (:class:`~kvhub.serving.spec.Recompute`, a selector the consumer can run).

    Build it with :meth:`from_extra` (:func:`read_config`): the one validator, run by the connector at engine
    start and by ``kvhub serve`` (:func:`kvhub.serving.launch.transfer_configs`) on each role's keys.  What
    only the engine knows is checked at start beside it (:func:`check_chunk_tokens`, :func:`events_file`)."""

    kvstore_dir: str
    kvstore_max_bytes: int
    chunk_tokens: int
    recompute: Recompute
    min_escalation_tokens: int
    source_attention_queries: int
    require_isolation_key: bool
    isolation_key_source: str
    source_model: str | None = None
    mapper: str | None = None
    mapper_path: str | None = None
    db: str | None = None
    hub_repo: str | None = None
    deshrink: str | None = None
    events_path: str | None = None

    def __post_init__(self):
        check_serving_spec(self.recompute, origin="kv_connector_extra_config")

    def __getitem__(self, key: str):
        """The dict :func:`read_config` returned before, with a warning naming the attribute that replaced it."""
        if key not in {f.name for f in fields(self)}:
            raise KeyError(key)
        warnings.warn(
            f"read_config(...)[{key!r}] is now read_config(...).{key} (a frozen ConnectorConfig)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(self, key)

    @classmethod
    def from_extra(cls, extra: dict | None) -> ConnectorConfig:
        """``extra`` over :data:`EXTRA_DEFAULTS`, every key read by its kind (a ConfigError names a bad key or
        value and the fix: a renamed key its new name, an unknown one the known ones)."""
        merged = {**EXTRA_DEFAULTS, **(extra or {})}
        check_extra_keys(merged)
        if "kvstore_dir" not in merged:
            raise ConfigError("kv_connector_extra_config needs 'kvstore_dir': a directory both engines can reach")
        values = {
            key.name: _READERS[key.kind](merged, key.name)
            for key in EXTRA_CONFIG
            if key.kind != "recompute" and key.name in merged
        }
        return cls(**values, recompute=Recompute.from_options(merged, origin="kv_connector_extra_config"))


def read_config(extra: dict | None) -> ConnectorConfig:
    """:meth:`ConnectorConfig.from_extra`: ``kv_connector_extra_config`` as one checked, frozen object."""
    return ConnectorConfig.from_extra(extra)


def config_table() -> str:
    """docs/serving.md's table of the keys (one row per key of :data:`EXTRA_CONFIG`)."""
    rows = ["| key | role | default | meaning |", "| --- | --- | --- | --- |"]
    for key in EXTRA_CONFIG:
        role = "both" if key.roles == BOTH else key.roles[0]
        renamed = f" (`{key.renamed_from[0]}` before, now refused with its new name)" if key.renamed_from else ""
        rows.append(f"| `{key.name}` | {role} | {key.shown_default()} | {key.help}{renamed} |")
    return "\n".join(rows) + "\n"


def config_text(extra: dict, key: str) -> str:
    """A text option (a reference, a path, a URL): a JSON string (a path object from Python too), else ConfigError
    naming the key."""
    value = extra[key]
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ConfigError(f"kv_connector_extra_config {key} must be a string, got {value!r}")
    return value


def check_chunk_tokens(chunk_tokens: int, *, max_model_len) -> None:
    """ConfigError for a ``chunk_tokens`` above the engine's ``max_model_len``: no prompt would fill one chunk, so
    the producer would store nothing and say nothing."""
    if isinstance(max_model_len, int) and not isinstance(max_model_len, bool) and chunk_tokens > max_model_len > 0:
        raise ConfigError(
            f"kv_connector_extra_config chunk_tokens {chunk_tokens} is more than the engine's max_model_len "
            f"{max_model_len}: no prompt fills one chunk, so nothing would be stored; use at most {max_model_len} "
            f"(default {EXTRA_DEFAULTS['chunk_tokens']})"
        )


def config_count(extra: dict, key: str, *, minimum: int = 1) -> int:
    """An integer option of kv_connector_extra_config, at least ``minimum`` (JSON number or ASCII digits, never
    a bool, a float or text like "1e3"), else ConfigError."""
    value = extra[key]
    digits = isinstance(value, str) and value.isascii() and value.isdigit()
    if isinstance(value, bool) or not (isinstance(value, int) or digits) or int(value) < minimum:
        what = "a positive whole number" if minimum == 1 else f"a whole number, {minimum} or more"
        raise ConfigError(f"kv_connector_extra_config {key} must be {what}, got {value!r}")
    return int(value)


def config_tokens(extra: dict, key: str) -> int:
    """A token count where 0 means "off" (``min_escalation_tokens``): a whole number, 0 or more."""
    return config_count(extra, key, minimum=0)


def config_flag(extra: dict, key: str) -> bool:
    """A boolean option (JSON true/false, or the strings "true"/"false"), else ConfigError."""
    value = extra[key]
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config {key} must be true or false, got {value!r}")
    return value


def config_isolation_source(extra: dict, key: str = "isolation_key_source") -> str:
    """``isolation_key_source``: which request field names the tenant.  "cache_salt" (the default: the salt
    vLLM hashes into its own prefix cache, set per tenant by the operator's gateway) or "kvhub_tenant"
    (``kv_transfer_params["kvhub_tenant"]``, for a gateway that authenticates and sets that field)."""
    value = extra[key]
    if value not in ISOLATION_SOURCES:
        raise ConfigError(
            f"kv_connector_extra_config isolation_key_source must be one of {list(ISOLATION_SOURCES)}, got {value!r}"
        )
    return value


def isolation_key(request, *, source: str, required: bool) -> str | None:
    """The request's isolation key, read from the one field the operator chose (``source``, see
    :func:`config_isolation_source`); the other field never decides the namespace.  "" (the shared
    namespace) when the request names no tenant at all, None then when ``required``.

    ConfigError (the request is then neither stored nor loaded) when the request names a tenant through a
    field this server does not take it from (``kvhub_tenant`` on a ``cache_salt`` server; on a
    ``kvhub_tenant`` server, a ``cache_salt`` without a non-empty ``kvhub_tenant``), or gives a key that is
    not a string: a client must not pick another tenant's namespace, nor fall silently into the shared one."""
    params = getattr(request, "kv_transfer_params", None) or {}
    if not isinstance(params, dict):
        raise ConfigError("kv_transfer_params must be a JSON object")
    if source == "cache_salt":
        if "kvhub_tenant" in params:
            raise ConfigError(
                "kvhub_tenant is not taken from requests on this server (isolation_key_source is "
                "cache_salt); send the tenant as cache_salt"
            )
        key = getattr(request, "cache_salt", None)
    else:
        key = params.get("kvhub_tenant")
        if not key and getattr(request, "cache_salt", None) is not None:
            raise ConfigError(
                "the request names its tenant only by cache_salt, and this server takes it from "
                "kv_transfer_params.kvhub_tenant (isolation_key_source is kvhub_tenant); have your gateway set "
                "kvhub_tenant on this route, or serve with isolation_key_source: cache_salt"
            )
    if key is None:
        key = ""
    if not isinstance(key, str):
        raise ConfigError(f"the isolation key ({source}) must be a string, got {type(key).__name__}")
    return None if (required and not key) else key


def events_file(path, *, option: str = "kv_connector_extra_config events_path") -> str | None:
    """``path`` (an events file), checked now to be a regular file this process can append to: a ConfigError
    naming ``option`` at start, not a failure at the first request.  Opened without blocking, so a FIFO there
    (which would block the engine's start until something reads it) is refused, not waited on."""
    if not path:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0), 0o644)
    except OSError as exc:
        what = "is not a regular file" if exc.errno == errno.ENXIO else f"cannot be appended to ({exc.strerror})"
        raise ConfigError(
            f"{option} {str(path)!r} {what}; point it at a file in an existing, writable directory"
        ) from exc
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    if not regular:
        raise ConfigError(f"{option} {str(path)!r} is not a regular file; point it at a file (one JSON line per event)")
    return str(path)


def check_serving_spec(spec: Recompute, *, origin: str) -> None:
    """Inside vLLM the consumer has the mapped cache, its own model and what the producer stored: select=
    "target", "source" (the small model's attention stored with the KV) or "random"."""
    if spec.selective and spec.select not in SERVING_SELECTORS:
        raise ConfigError(
            f"select={spec.select!r} in {origin}: inside vLLM the consumer selects by its own attention over "
            "the mapped cache (select=target), by the small model's attention the producer stored "
            "(select=source) or at random (select=random, the control)"
        )


def worker_device(vllm_config) -> str:
    device = getattr(vllm_config.device_config, "device", None)
    return str(device) if device is not None else "cpu"


def config_deshrink(extra: dict, key: str = "deshrink") -> str | None:
    """``deshrink`` (how the maps are read, :mod:`kvhub.core.deshrink`), None when absent (the mapper's default),
    else ConfigError naming the choices."""
    from kvhub.core.deshrink import check_deshrink

    return check_deshrink(extra.get(key), what="kv_connector_extra_config deshrink")


_READERS = {  # ConfigKey.kind -> how ConnectorConfig.from_extra reads a value of it
    "text": config_text,
    "count": config_count,
    "tokens": config_tokens,
    "flag": config_flag,
    "isolation": config_isolation_source,
    "deshrink": config_deshrink,
}


def load_mapper(config: ConnectorConfig, *, device):
    """The mapper named by ``mapper`` (a name :func:`kvhub.api.resolve` takes: a reference, resolved in ``db``,
    then on the Hub in ``hub_repo``) or ``mapper_path`` (a directory, read as it is), transferring with the
    configured ``deshrink``."""
    from kvhub.core.mapper import Mapper

    if config.mapper_path:
        return Mapper.load(Path(config.mapper_path), device=device, deshrink=config.deshrink)
    if not config.mapper:
        raise ConfigError(
            "the consumer needs 'mapper' (SRC:DST:CALIB@production) or 'mapper_path' in kv_connector_extra_config"
        )
    from kvhub.api import resolve

    found = resolve(config.mapper, db=config.db, hub_repo=config.hub_repo)
    return found.load(device=device, deshrink=config.deshrink)


def check_target(mapper, vllm_config) -> None:
    """The engine's model must have the KV geometry the mapper writes (IncompatibleError otherwise)."""
    model = vllm_config.model_config
    engine = {
        "num_layers": model.hf_config.num_hidden_layers,
        "num_kv_heads": model.get_num_kv_heads(vllm_config.parallel_config),
        "head_dim": model.get_head_size(),
    }
    wanted = {name: mapper.target[name] for name in engine}
    if engine != wanted:
        raise IncompatibleError(
            f"this engine's model has KV geometry {engine}, the mapper writes {wanted} "
            f"({mapper.target['model_id']}); serve that model or pick its mapper"
        )


def span_tokenizer(name: str | None):
    """The served model's tokenizer, for recomputing whole sentences / lines; None (16-token spans) when the
    engine has none or it does not load (said once)."""
    if not name:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # noqa: BLE001 - spans fall back to fixed windows
        log.warning("kvhub consumer: no tokenizer from %s (%s); recompute spans are 16-token windows", name, exc)
        return None


def request_control(params: dict) -> bool:
    """``kv_transfer_params["kvhub_control"]``: a JSON boolean (absent: false); ConfigError for anything else,
    so a client's "false" or 0-as-string never silently selects the control map."""
    value = params.get("kvhub_control", False)
    if not isinstance(value, bool):
        raise ConfigError(f"kv_transfer_params kvhub_control must be true or false (a JSON boolean), got {value!r}")
    return value


def request_prefill(params: dict) -> bool:
    """``kv_transfer_params["kvhub_prefill"]``: a JSON boolean (absent: false) asking the large server for its own
    exact prefill of the prompt, nothing loaded (to settle an escalated conversation into its prefix cache);
    ConfigError for anything else."""
    value = params.get("kvhub_prefill", False)
    if not isinstance(value, bool):
        raise ConfigError(f"kv_transfer_params kvhub_prefill must be true or false (a JSON boolean), got {value!r}")
    return value


def request_spec(params: dict, *, base: Recompute) -> Recompute:
    """The engine's spec ``base``, or a request's own: ``kv_transfer_params["kvhub_recompute"]`` in
    :meth:`Recompute.name`'s words, over ``base``; ConfigError for a bad one (the request is then prefilled)."""
    text = params.get("kvhub_recompute")
    if not text:
        return base
    if not isinstance(text, str):
        raise ConfigError("kv_transfer_params kvhub_recompute is a spec like 'exact_budget=0.2,select=random'")
    spec = Recompute.parse(text, base=base)
    check_serving_spec(spec, origin="kv_transfer_params kvhub_recompute")
    return spec
