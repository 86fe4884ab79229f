"""The kvhub connector's configuration, read at engine start: every value of ``kv_connector_extra_config``
checked (a ConfigError names the key), the mapper resolved and matched to the served model.  No vLLM
import: the checks are tested without an engine (the contract itself lives in kvhub.serving.launch)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvhub.errors import ConfigError, IncompatibleError
from kvhub.serving.spec import Recompute

log = logging.getLogger("kvhub.serving")


def config_count(extra: dict, key: str) -> int:
    """A positive integer option of kv_connector_extra_config (JSON number or digits), else ConfigError."""
    value = extra[key]
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.isdigit())) \
            or int(value) < 1:
        raise ConfigError(f"kv_connector_extra_config {key} must be a positive whole number, got {value!r}")
    return int(value)


def config_flag(extra: dict, key: str) -> bool:
    """A boolean option (JSON true/false, or the strings "true"/"false"), else ConfigError."""
    value = extra[key]
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config {key} must be true or false, got {value!r}")
    return value


ISOLATION_SOURCES = ("cache_salt", "kvhub_tenant")


def config_isolation_source(extra: dict) -> str:
    """``isolation_key_source``: which request field names the tenant.  "cache_salt" (the default: the salt
    vLLM hashes into its own prefix cache, set per tenant by the operator's gateway) or "kvhub_tenant"
    (``kv_transfer_params["kvhub_tenant"]``, for a gateway that authenticates and sets that field)."""
    value = extra["isolation_key_source"]
    if value not in ISOLATION_SOURCES:
        raise ConfigError(f"kv_connector_extra_config isolation_key_source must be one of {list(ISOLATION_SOURCES)}, "
                          f"got {value!r}")
    return value


def isolation_key(request, *, source: str, required: bool) -> str | None:
    """The request's isolation key, read from the one field the operator chose (``source``, see
    :func:`config_isolation_source`); the other field never decides the namespace.  "" (the shared
    namespace) when the field is absent, None when it is absent and ``required``.

    ConfigError (the request is then neither stored nor loaded) when the request names a tenant through a
    field this server does not take it from, or gives a key that is not a string: a client must not pick
    another tenant's namespace, nor fall silently into the shared one."""
    params = getattr(request, "kv_transfer_params", None) or {}
    if not isinstance(params, dict):
        raise ConfigError("kv_transfer_params must be a JSON object")
    if source == "cache_salt":
        if "kvhub_tenant" in params:
            raise ConfigError("kvhub_tenant is not taken from requests on this server (isolation_key_source is "
                              "cache_salt); send the tenant as cache_salt")
        key = getattr(request, "cache_salt", None)
    else:
        key = params.get("kvhub_tenant")
    if key is None:
        key = ""
    if not isinstance(key, str):
        raise ConfigError(f"the isolation key ({source}) must be a string, got {type(key).__name__}")
    return None if (required and not key) else key


def events_file(path, *, option: str = "kv_connector_extra_config events_path") -> str | None:
    """``path`` (an events file), checked writable now: a ConfigError naming ``option`` at start, not a
    failure at the first request."""
    if not path:
        return None
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ConfigError(f"{option} {str(path)!r} cannot be appended to ({exc.strerror}); point it at a file in an "
                          "existing, writable directory") from exc
    return str(path)


def check_serving_spec(spec: Recompute, *, origin: str) -> None:
    """Inside vLLM the consumer has only the mapped cache and its own model: select="target" or "random"."""
    if spec.selective and spec.select not in ("target", "random"):
        raise ConfigError(f"select={spec.select!r} in {origin}: inside vLLM the consumer selects by its own "
                          "attention over the mapped cache (select=target) or at random (select=random, the control)")


def worker_device(vllm_config) -> str:
    device = getattr(vllm_config.device_config, "device", None)
    return str(device) if device is not None else "cpu"


def config_deshrink(extra: dict) -> str | None:
    """``deshrink`` (how the maps are read, :mod:`kvhub.core.deshrink`), None when absent (the mapper's default),
    else ConfigError naming the choices."""
    from kvhub.core.deshrink import check_deshrink

    return check_deshrink(extra.get("deshrink"), what="kv_connector_extra_config deshrink")


def load_mapper(extra: dict, *, device):
    """The mapper named by ``mapper`` (a reference, resolved by kvhub.load) or ``mapper_path`` (a directory),
    transferring with ``deshrink`` (:func:`config_deshrink`)."""
    from kvhub.core.mapper import Mapper

    deshrink = config_deshrink(extra)
    if extra.get("mapper_path"):
        return Mapper.load(Path(extra["mapper_path"]), device=device, deshrink=deshrink)
    if not extra.get("mapper"):
        raise ConfigError("the consumer needs 'mapper' (SRC:DST:CALIB@production) or 'mapper_path' in "
                          "kv_connector_extra_config")
    from kvhub.api import load
    from kvhub.store.refs import Ref

    ref = Ref.parse(extra["mapper"])
    if extra.get("db"):
        os.environ.setdefault("KVHUB_DB_URL", str(extra["db"]))
    return load(ref.source, ref.target, calib=ref.calibration, version=ref.version, alias=ref.alias,
                hub_repo=extra.get("hub_repo"), db=extra.get("db"), device=device, deshrink=deshrink)


def check_target(mapper, vllm_config) -> None:
    """The engine's model must have the KV geometry the mapper writes (IncompatibleError otherwise)."""
    model = vllm_config.model_config
    engine = {"num_layers": model.hf_config.num_hidden_layers,
              "num_kv_heads": model.get_num_kv_heads(vllm_config.parallel_config),
              "head_dim": model.get_head_size()}
    wanted = {name: mapper.target[name] for name in engine}
    if engine != wanted:
        raise IncompatibleError(f"this engine's model has KV geometry {engine}, the mapper writes {wanted} "
                                f"({mapper.target['model_id']}); serve that model or pick its mapper")


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
