"""Talking to the Hub: settings read at call time, the HfApi client, and error translation.

huggingface_hub reads HF_ENDPOINT, HF_HUB_OFFLINE and the cache path when it is imported; kvhub reads
them each time it runs and passes ``endpoint=`` / ``cache_dir=`` explicitly, so a process that changes
its environment (a notebook, a test) is honoured.  Every huggingface_hub or transport failure leaves
this package as a kvhub error with a next step, with any token masked.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from kvhub import __version__
from kvhub.artifact.files import is_no_space, no_space_error
from kvhub.env import hf_hub_cache, hub_offline
from kvhub.errors import (
    ConfigError,
    KVHubError,
    HubAuthError,
    HubError,
    HubOfflineError,
    HubRepoNotFoundError,
    HubRevisionNotFoundError,
)

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


@dataclass(frozen=True)
class HubSettings:
    """Where and how kvhub talks to the Hub, resolved from the environment at call time."""

    endpoint: str
    offline: bool
    cache_dir: str


def hub_settings(*, cache_dir: str | os.PathLike | None = None, local_files_only: bool = False) -> HubSettings:
    """Endpoint, offline flag and download cache, read now (huggingface_hub reads them at import);
    ``cache_dir`` and ``local_files_only`` override the cache and go offline for one call."""
    from huggingface_hub import constants

    one_line_per_record(load=True)
    endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    cache = os.path.expanduser(os.fspath(cache_dir)) if cache_dir else hf_hub_cache()
    return HubSettings(endpoint=endpoint, offline=local_files_only or hub_offline(), cache_dir=cache)


def _api(settings: HubSettings, token: str | None):
    from huggingface_hub import HfApi

    return HfApi(endpoint=settings.endpoint, token=token, library_name="kvhub", library_version=__version__)


def _current_token(token: str | None) -> str | None:
    """The token huggingface_hub will send (explicit, HF_TOKEN, or the login); never printed."""
    from huggingface_hub import get_token

    try:
        return token or get_token()
    except Exception:  # noqa: BLE001 - e.g. a failing OIDC exchange: the request itself will report it
        return token


def _redact(text: str, token: str | None) -> str:
    """``text`` with the token in use (and anything shaped like an HF token) masked."""
    for secret in {token, _current_token(None)} - {None, ""}:
        text = text.replace(secret, "***")
    return re.sub(r"hf_[A-Za-z0-9]{20,}", "hf_***", text)


class SecretFilter:
    """A logging filter that masks Hub tokens (``token``, the one in use when it was made, and anything
    shaped like one) in every record it sees, whoever logged it (a server echoing a token back reaches
    huggingface_hub's own warnings).  The token is looked up once, not per record."""

    def __init__(self, token: str | None = None):
        self.token = token

    def filter(self, record) -> bool:
        message = record.getMessage()
        if "hf_" in message or (self.token and self.token in message):
            record.msg, record.args = _redact(message, self.token), None
        return True


def install_secret_filter() -> None:
    """Mask tokens on every handler of the root logger and of huggingface_hub's logger, and route Python
    warnings through logging so that they are masked too."""
    import logging

    logging.captureWarnings(True)
    one_line_per_record()
    token = os.environ.get("HF_TOKEN") or None  # the login file is read only if a record needs it: _redact
    for name in ("", "huggingface_hub", "py.warnings"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, SecretFilter) for f in handler.filters):
                handler.addFilter(SecretFilter(token))


def one_line_per_record(*, load: bool = False) -> None:
    """huggingface_hub adds its own stderr handler when its logging module loads (with its utilities, not with
    the bare package), and its records also reach the root logger; when the root has a handler (the CLI's),
    that one alone prints them (masked, formatted like kvhub's), so a retry warning is not printed twice.
    ``load``: load that module first, so the handler is there to remove (:func:`hub_settings`, and whatever
    reaches the Hub through transformers, call it so just before their requests)."""
    import logging

    if load:
        import huggingface_hub.utils.logging  # noqa: F401 - adds the handler removed below

    hub_logger = logging.getLogger("huggingface_hub")
    if logging.getLogger().handlers and hub_logger.propagate:
        for handler in [h for h in hub_logger.handlers if type(h) is logging.StreamHandler]:
            hub_logger.removeHandler(handler)


def is_repo_id(text: str) -> bool:
    """``owner/name`` as the Hub spells repository ids: each part a letter or digit, then at most 95
    letters, digits, '_', '.' or '-', and no '..' (so a local path such as ``./x`` or ``../x`` never is one)."""
    return bool(_REPO_ID.fullmatch(text)) and ".." not in text


def parse_repo_ref(text: str) -> tuple[str, str | None]:
    """'owner/name[@revision]' -> (repo_id, revision or None); ConfigError, with the syntax, otherwise."""
    repo_id, at, revision = text.strip().partition("@")
    if not is_repo_id(repo_id):
        shown = repr(text) if len(text) <= 120 else repr(text[:117]) + "..."
        raise ConfigError(f"{shown} is not a Hub repository; write it as OWNER/NAME or OWNER/NAME@REVISION")
    if at and not revision.strip():  # "owner/name@" would otherwise pull main
        raise ConfigError(
            f"{text!r} ends with '@' but names no revision; write OWNER/NAME (the head of main) or "
            "OWNER/NAME@REVISION (a tag such as v3, a branch or a commit)"
        )
    return repo_id, revision or None


def _server_status(exc: BaseException) -> int | None:
    """The HTTP status behind a failed download (huggingface_hub wraps it as "not cached"), if any."""
    from huggingface_hub import errors as hf

    seen = exc
    while seen is not None:
        if isinstance(seen, hf.HfHubHTTPError) and seen.response is not None:
            return seen.response.status_code
        seen = seen.__cause__ or seen.__context__
    return None


@contextlib.contextmanager
def hub_errors(
    action: str,
    *,
    repo_id: str | None,
    revision: str | None = None,
    token: str | None = None,
    settings: HubSettings | None = None,
    aftermath: str = "",
) -> Iterator[None]:
    """Translate huggingface_hub/httpx failures into kvhub errors with a next step (tokens redacted)."""
    import httpx2
    from huggingface_hub import errors as hf

    where = f"{repo_id}@{revision}" if revision else str(repo_id)
    endpoint = settings.endpoint if settings else "the Hub"
    tail = f"; {aftermath}" if aftermath else ""
    try:
        yield
    except KVHubError:
        raise
    except (hf.OfflineModeIsEnabled, hf.LocalEntryNotFoundError) as exc:
        offline = settings.offline if settings else True
        if offline or isinstance(exc, hf.OfflineModeIsEnabled):
            raise HubOfflineError(
                f"{action} {where}: HF_HUB_OFFLINE=1 (or local_files_only=True) and it is not in the local cache; "
                "unset HF_HUB_OFFLINE (or pull it once while online) and retry",
                repo_id=repo_id,
                revision=revision,
            ) from None
        if (status := _server_status(exc)) is not None and status >= 500:
            raise HubError(
                f"{action} {where}: the Hub failed on its side ({status}) and nothing is cached; retry "
                f"in a few minutes (https://status.huggingface.co){tail}"
            ) from None
        raise HubError(
            f"{action} {where}: cannot reach {endpoint} and nothing is cached "
            f"({_redact(str(exc).splitlines()[0], token)}); check the network and retry{tail}"
        ) from None
    except hf.RevisionNotFoundError:
        raise HubRevisionNotFoundError(
            f"{repo_id} has no revision {revision!r}; `kvhub search` or the repo's tags list what exists",
            repo_id=repo_id,
            revision=revision,
        ) from None
    except hf.RepositoryNotFoundError as exc:
        if exc.response is not None and exc.response.status_code == 401 and not _current_token(token):
            raise HubAuthError(
                f"{action} {repo_id}: the Hub does not show this repository without a token: it is private "
                "(or does not exist); set HF_TOKEN or run `hf auth login` and retry",
                repo_id=repo_id,
                revision=revision,
            ) from None
        raise HubRepoNotFoundError(
            f"{action} {repo_id}: repository not found on {endpoint} (or it is private and your token cannot "
            "see it); check the name",
            repo_id=repo_id,
            revision=revision,
        ) from None
    except hf.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        message = _redact(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc), token)
        if status == 401:
            fix = (
                "pass a valid one (--token, token=)" if token else "set a valid HF_TOKEN or run `hf auth login`"
            )  # the token given is the one to fix
            raise HubAuthError(
                f"{action} {where}: the Hub rejected the token{' given' if token else ''} ({message}); {fix}",
                repo_id=repo_id,
                revision=revision,
            ) from None
        if status == 403:
            raise HubAuthError(
                f"{action} {where}: your token may not do this ({message}); use a token with write "
                f"access to {str(repo_id).split('/')[0]}",
                repo_id=repo_id,
                revision=revision,
            ) from None
        if status is not None and status >= 500:
            raise HubError(
                f"{action} {where}: the Hub failed on its side ({status}: {message}); retry in a few "
                f"minutes (https://status.huggingface.co){tail}"
            ) from None
        raise HubError(
            f"{action} {where}: the Hub answered {status} ({message}); check the repository name and "
            f"revision, then retry{tail}"
        ) from None
    except ValueError as exc:  # huggingface_hub's own refusals, e.g. a file name that leaves the download folder
        raise HubError(
            f"{action} {where}: huggingface_hub refused it ({_redact(str(exc).strip()[:300], token)}); "
            "the repository holds something kvhub will not use (such as a file name with `..` or an "
            f"absolute path): pull another revision or repository{tail}"
        ) from None
    except httpx2.HTTPError as exc:
        offline = (
            "; working offline? HF_HUB_OFFLINE=1 uses only what is cached, without retrying"
            if isinstance(exc, httpx2.ConnectError)
            else ""
        )
        raise HubError(
            f"{action} {where}: the connection to {endpoint} failed ({type(exc).__name__}: "
            f"{_redact(str(exc), token)}){offline}{tail}"
        ) from None
    except OSError as exc:  # the download filled the Hugging Face cache's disk
        if not is_no_space(exc):
            raise
        folder = settings.cache_dir if settings else os.path.dirname(exc.filename or "") or "the Hugging Face cache"
        raise no_space_error(
            folder,
            then=f"{action} {where} stopped and nothing was registered; free some space there or point HF_HUB_CACHE "
            f"at another disk{tail}",
        ) from None
