"""References to mapper versions: ``SRC:DST[:CALIB][@SELECTOR]``.

* SRC, DST: a model id as given to ``kvhub fit`` (``Qwen/Qwen2.5-Coder-0.5B-Instruct``, or a local
  path) or its short name, the last path component (``qwen2.5-coder-0.5b-instruct``).  Matching is
  case-insensitive; an exact (case-sensitive) full id wins over other matches.
* CALIB: a calibration-set name (case-insensitive); may be left out when the pair has one.
* SELECTOR: ``v3`` or ``3`` (a version number), or an alias (``latest``, ``production``, any name).
  Without one, a reference means ``production`` if that alias is set, else ``latest``.

``:`` separates the parts and ``@`` starts the selector, so a model id containing ``:`` (a Windows
drive letter, an odd local path) cannot be written in full in a reference: use its short name, or the
Python API (``kvhub.load(src, dst, calib=...)``) which takes each name as its own argument.  Hub ids
never contain ``:`` or ``@``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvhub.errors import ConfigError

LATEST = "latest"
PRODUCTION = "production"
ALIAS_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9._-]{0,63}")
_VERSION_PATTERN = re.compile(r"[vV]?(\d+)")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")

SYNTAX_HELP = (
    "write SRC:DST:CALIB@SELECTOR, e.g. qwen2.5-coder-0.5b-instruct:qwen2.5-coder-1.5b-instruct:legal-docs@v3 "
    "(SELECTOR: v3, latest, production or another alias; CALIB optional when the pair has one)"
)


@dataclass(frozen=True)
class Ref:
    """A parsed reference; ``version`` and ``alias`` are never both set."""

    source: str
    target: str
    calibration: str | None = None
    version: int | None = None
    alias: str | None = None

    @classmethod
    def parse(cls, text: str) -> "Ref":
        """Parse ``SRC:DST[:CALIB][@SELECTOR]``; ConfigError with the syntax on anything else."""
        check_not_url(text)
        base, selector = _split_selector(text.strip())
        parts = base.split(":")
        if len(parts) not in (2, 3) or not all(p.strip() for p in parts):
            raise ConfigError(f"{text!r} is not a mapper reference; {SYNTAX_HELP}")
        version, alias = parse_selector(selector) if selector is not None else (None, None)
        calibration = parts[2].strip() if len(parts) == 3 else None
        return cls(parts[0].strip(), parts[1].strip(), calibration, version, alias)

    @classmethod
    def of(
        cls,
        source: str,
        target: str,
        *,
        calibration: str | None = None,
        version: int | str | None = None,
        alias: str | None = None,
    ) -> "Ref":
        """The reference to the parts given one by one (model ids may then contain ':', unlike in text).

        ``version`` is a selector (``3``, ``"v3"``, or an alias name such as ``"production"``); ``alias``
        names an alias only.  ConfigError for both at once or for a selector that is neither.
        """
        if version is not None and alias is not None:
            raise ConfigError(f"pass either a version or an alias, not both (got {version!r} and {alias!r})")
        number, named = parse_selector(version) if version is not None else (None, None)
        if alias is not None:
            named = check_alias_name(alias)
        return cls(source, target, calibration, number, named)

    def with_selector(self, *, version: int | None = None, alias: str | None = None) -> "Ref":
        return Ref(self.source, self.target, self.calibration, version, alias)

    def __str__(self) -> str:
        text = f"{self.source}:{self.target}"
        if self.calibration is not None:
            text += f":{self.calibration}"
        if self.version is not None:
            text += f"@v{self.version}"
        elif self.alias is not None:
            text += f"@{self.alias}"
        return text


def check_not_url(text: str) -> None:
    """ConfigError for a URL (``https://...``, ``hf://owner/name``): its ``:`` would otherwise read as a
    reference to a model named ``https``."""
    match = _URL.match(text.strip())
    if match:
        rest = text.strip()[match.end() :]
        example = repr(rest[:80]) if match.group().lower() == "hf://" else "OWNER/NAME@v3"
        raise ConfigError(
            f"{text[:120]!r} is a URL, not a mapper reference; a Hub repository is written without a "
            f"scheme ({example}), and for a reference, {SYNTAX_HELP}"
        )


def _split_selector(text: str) -> tuple[str, str | None]:
    if "@" not in text:
        return text, None
    base, selector = text.rsplit("@", 1)
    if ":" in selector or "/" in selector or "\\" in selector:  # an '@' inside a path, not a selector
        return text, None
    if not selector:
        raise ConfigError(f"{text!r} ends with '@' but names no version or alias; {SYNTAX_HELP}")
    return base, selector


def parse_selector(selector: str | int) -> tuple[int | None, str | None]:
    """``3``/``"v3"`` -> (3, None); ``"production"`` -> (None, "production")."""
    if isinstance(selector, int):
        return _version_number(selector), None
    if not isinstance(selector, str):
        raise ConfigError(
            f"a version is a number (3), 'v3' or an alias name, not {selector!r} "
            f"({type(selector).__name__}); see `kvhub list` for the versions that exist"
        )
    match = _VERSION_PATTERN.fullmatch(selector.strip())
    if match:
        return _version_number(int(match.group(1))), None
    return None, check_alias_name(selector.strip())


MAX_VERSION = 2**31 - 1  # the store's version column is a 32-bit integer


def _version_number(number: int) -> int:
    if isinstance(number, bool) or not 1 <= number <= MAX_VERSION:
        shown = str(number) if len(str(number)) <= 24 else str(number)[:21] + "..."
        raise ConfigError(
            f"version numbers run from 1 to {MAX_VERSION}, got {shown}; see `kvhub list` for the versions that exist"
        )
    return number


def check_alias_name(name: str) -> str:
    """Return ``name`` if it can be an alias: a letter, then letters, digits, '.', '_', '-'; not v<N>."""
    if not ALIAS_PATTERN.fullmatch(name) or _VERSION_PATTERN.fullmatch(name):
        raise ConfigError(
            f"{name!r} cannot be an alias: use a letter followed by letters, digits, '.', '_' or '-' "
            "(at most 64 characters), and not v<N>, which means a version number"
        )
    return name


CALIBRATION_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_calibration_name(name: str) -> str:
    """Return ``name`` if it can name a series' calibration set (``kvhub fit --name``): a letter or digit,
    then letters, digits, '.', '_', '-' (a reference's ':' and '@' would split it)."""
    if not isinstance(name, str) or not CALIBRATION_NAME_PATTERN.fullmatch(name):
        raise ConfigError(
            f"{str(name)[:80]!r} cannot name a calibration set: use a letter or digit followed by "
            "letters, digits, '.', '_' or '-' (at most 128 characters), e.g. --name legal-2025"
        )
    return name


def short_name(model_name: str) -> str:
    """The last path component of a model id or path: 'Qwen/Qwen2.5-0.5B' -> 'Qwen2.5-0.5B'."""
    return re.split(r"[\\/]", model_name.rstrip("/\\"))[-1]


def match_model_names(query: str, names) -> list[str]:
    """Names that ``query`` designates: an exact full id alone, else the id ``kvhub fit`` registers for a
    local path (``./models/small`` -> its absolute path), else case-insensitive full or short."""
    names = sorted(set(names))
    if query in names:
        return [query]
    registered = _registered_id(query)
    if registered is not None and registered in names:
        return [registered]
    folded = query.lower()
    return [n for n in names if n.lower() == folded or short_name(n).lower() == folded]


def match_calibration_names(query: str, names) -> list[str]:
    """Calibration-set names equal to ``query``: exact first, else case-insensitive."""
    names = sorted(set(names))
    if query in names:
        return [query]
    return [n for n in names if n.lower() == query.lower()]


def _registered_id(query: str) -> str | None:
    """The model id a fit from the local path ``query`` registered, or None when ``query`` is no existing
    path.  The rule of kvhub.models.loading.registered_model_id (which the store, below models, cannot
    import; tests/store/test_lookup_paths.py checks the two agree): a converted folder is known by the Hub id
    its manifest names, any other path by its absolute form."""
    import json
    from pathlib import Path

    try:
        path = Path(query).expanduser()
        if not path.exists():
            return None
        manifest = path / _MODEL_MANIFEST
        if manifest.is_file():
            hf_id = json.loads(manifest.read_text(encoding="utf-8")).get("hf_id")
            if isinstance(hf_id, str) and hf_id:
                return hf_id
        return str(path.resolve())
    except (OSError, ValueError, AttributeError):  # a name no file system takes, an unreadable manifest
        return None


_MODEL_MANIFEST = "kvhub-model.json"  # kvhub.models.loading.MANIFEST
