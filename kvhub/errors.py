"""One exception tree for kvhub.

Every error derives from :class:`KVHubError`; leaves also subclass the builtin they resemble, so
``except LookupError`` keeps working for callers who do not know kvhub.  Messages say what went wrong
and what to do next.  ``exit_code`` is what the CLI exits with.
"""

from __future__ import annotations


class KVHubError(Exception):
    """Base of every kvhub error."""

    exit_code = 1


class ConfigError(KVHubError, ValueError):
    """Bad user input: an option, a recipe, a reference."""

    exit_code = 2


class UnsupportedModelError(KVHubError, ValueError):
    """The model architecture or rope type is not one kvhub can map."""

    exit_code = 2


class IncompatibleError(KVHubError, ValueError):
    """Two things that must match do not: tokenizers, cache geometry, fingerprints."""

    exit_code = 3


class NonFiniteError(KVHubError, ValueError):
    """NaN or Inf where finite numbers are required."""

    exit_code = 3


class FitError(KVHubError, ValueError):
    """The fit cannot be solved as asked: fewer observations than features, more memory than there is."""

    exit_code = 4


class ArtifactError(KVHubError, OSError):
    """A mapper artifact is missing, corrupt or of an unknown format."""

    exit_code = 5


class IntegrityError(ArtifactError):
    """Bytes on disk do not match their recorded sha256."""


class FormatVersionError(ArtifactError):
    """The artifact was written by a newer kvhub."""


class InvalidArtifactError(IntegrityError):
    """An artifact breaks a rule of the format (docs/artifact-format.md); ``field`` names what is wrong."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class NotFoundError(KVHubError, LookupError):
    """A model, calibration set, mapper version or alias does not exist."""

    exit_code = 6


class AmbiguousError(KVHubError, LookupError):
    """A short name or query matches more than one thing."""

    exit_code = 7


class CorpusUnavailableError(KVHubError, OSError):
    """The text behind a calibration set is not on this machine and cannot be fetched."""

    exit_code = 8


class StoreError(KVHubError, RuntimeError):
    """The store (SQL database) refuses an operation."""

    exit_code = 9


class SchemaOutdatedError(StoreError):
    """The database schema is behind this kvhub; run `kvhub db upgrade`."""


class ServeError(KVHubError, RuntimeError):
    """A serving engine that kvhub started (``kvhub serve``) died or did not become ready."""

    exit_code = 16


class KVStoreError(KVHubError, OSError):
    """The serving KV store (``kvhub serve --kvstore-dir``) cannot write: free space, or make it writable.

    Disk full, a read-only mount, no write permission, a namespace directory that is a symbolic link:
    nothing is stored, and the message names the directory and the fix for that errno.  A stored entry
    that cannot be read is an IncompatibleError (a miss), not this.  The SQL registry's refusals are
    StoreError."""

    exit_code = 17


class HubError(KVHubError, OSError):
    """Talking to the Hugging Face Hub failed."""

    exit_code = 10


class UnknownCalibrationError(NotFoundError):
    """A calibration spec that is neither a built-in set, a path, nor ``hf:...``."""

    def __init__(self, message: str, *, name: str, known: list[str]):
        super().__init__(message)
        self.name = name
        self.known = known


class RecipeError(ConfigError):
    """A calibration recipe (TOML) has a missing or wrong-typed field."""

    def __init__(self, message: str, *, path: str, field: str, expected: str):
        super().__init__(message)
        self.path = path
        self.field = field
        self.expected = expected


class CorpusFetchError(CorpusUnavailableError):
    """A corpus is not on this machine and fetching it failed; ``command`` fetches it by hand."""

    def __init__(self, message: str, *, command: str):
        super().__init__(message)
        self.command = command


class CorpusTooSmallError(ConfigError):
    """A corpus yields fewer token sequences than asked for."""

    def __init__(self, message: str, *, requested: int, available: int):
        super().__init__(message)
        self.requested = requested
        self.available = available


# ---- Hugging Face Hub (kvhub.hub) -------------------------------------------------------------------
class _HubFailure(HubError):
    """A Hub error about one repository (and revision); carries them as fields."""

    def __init__(self, message: str, *, repo_id: str | None = None, revision: str | None = None):
        super().__init__(message)
        self.repo_id = repo_id
        self.revision = revision


class HubAuthError(_HubFailure, PermissionError):
    """The Hub wants a (valid) token, or the token may not write there; set HF_TOKEN or `hf auth login`."""

    exit_code = 11


class HubRepoNotFoundError(_HubFailure, NotFoundError):
    """The Hub has no such repository (or hides a private one from this token)."""

    exit_code = 12


class HubRevisionNotFoundError(_HubFailure, NotFoundError):
    """The repository exists but the branch, tag or commit does not."""

    exit_code = 13


class HubOfflineError(_HubFailure):
    """HF_HUB_OFFLINE=1 and what was asked for is not in the local cache."""

    exit_code = 14


class HubConflictError(_HubFailure):
    """The repository already holds something else under that name (a tag, another model pair)."""

    exit_code = 15


class ModelUnavailableError(NotFoundError):
    """A model is not on this machine and cannot be loaded or fetched; ``command`` is the fix."""

    def __init__(self, message: str, *, model_id: str, command: str | None = None):
        super().__init__(message)
        self.model_id = model_id
        self.command = command


# ---- interrupts and the exit-code table -------------------------------------------------------------
class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped the command; rerunning it resumes where a checkpoint allows.

    A KeyboardInterrupt, not a KVHubError: ``except Exception`` must never swallow an interrupt."""

    exit_code = 130


class FitInterrupted(Interrupted):
    """A fit stopped during batch ``batch`` of ``batches`` of pass ``pass_index``; a rerun of the same fit
    resumes after batch ``resume_from`` of that pass (None: there is no checkpoint, it starts over)."""

    def __init__(
        self,
        message: str,
        *,
        batch: int,
        batches: int,
        pass_index: int = 1,
        resume_from: int | None,
        phase: int | None = None,
    ):
        super().__init__(message)
        self.batch = batch
        self.batches = batches
        self.pass_index = pass_index
        self.resume_from = resume_from
        self.phase = phase  # 1: a two-phase fit's source capture (resume_from: the batches its spool keeps)


def exit_codes() -> list[tuple[int, str, str]]:
    """(exit status, what raises it, meaning) of every status the CLI exits with, by status: the one
    table users read (``kvhub --help``, docs/cli.md), built from the ``exit_code`` of the classes above."""
    rows = [
        (0, "-", "Success"),
        (1, "-", "An unexpected error (a bug: please report it)"),
        (2, "click", "A usage error: unknown option, missing argument"),
    ]
    classes, seen = [KVHubError, Interrupted], set()
    while classes:
        cls = classes.pop(0)
        if cls in seen:  # reached twice through multiple inheritance
            continue
        seen.add(cls)
        classes.extend(cls.__subclasses__())
        if "exit_code" in vars(cls) and cls is not KVHubError:
            rows.append((vars(cls)["exit_code"], cls.__name__, (cls.__doc__ or "").strip().splitlines()[0].rstrip(".")))
    return sorted(rows, key=lambda row: row[0])
