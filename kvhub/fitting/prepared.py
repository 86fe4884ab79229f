"""What a fit needs, loaded: the one argument of :func:`kvhub.fitting.fit.fit` and
:func:`kvhub.fitting.distributed.fit_distributed`.

:func:`kvhub.fitting.job.prepare` builds it from a :class:`kvhub.fitting.job.FitRequest` (model names); a
caller holding models and token ids builds it directly, or calls ``fit`` in its older form
(``fit(source, target, train_ids, heldout_ids, source_id=..., target_id=..., ...)``), which :func:`as_prepared`
turns into one.  Its models' fingerprints, and the refusal of a pair whose tokenizers differ, live here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvhub.core.fingerprint import model_fingerprint
from kvhub.dtypes import dtype_name
from kvhub.errors import IncompatibleError
from kvhub.fitting.options import FitOptions


@dataclass
class PreparedFit:
    """Both models (and their tokenizers, for the fingerprints), their ids, the calibration token ids, the
    calibration metadata mapper.json keeps, and the fit's options."""

    source: object
    target: object
    source_id: str
    target_id: str
    train: torch.Tensor  # (N, T) long, no padding
    heldout: torch.Tensor | None  # (M, T) long; None: no held-out split
    source_tokenizer: object = None
    target_tokenizer: object = None
    calibration: dict = field(default_factory=dict)  # mapper.json's calibration block
    options: FitOptions = field(default_factory=FitOptions)

    def fingerprints(self) -> tuple[dict, dict]:
        """(source, target) fingerprints with dtypes (:func:`pair_fingerprints`); refused when the tokenizers differ."""
        return pair_fingerprints(
            self.source,
            self.target,
            source_id=self.source_id,
            target_id=self.target_id,
            source_tokenizer=self.source_tokenizer,
            target_tokenizer=self.target_tokenizer,
        )


def check_same_tokenizer(source_fp: dict, target_fp: dict) -> None:
    """Refuse a pair whose tokenizers differ (a mapper needs token-aligned caches)."""
    src, dst = source_fp.get("tokenizer_hash"), target_fp.get("tokenizer_hash")
    if src is not None and dst is not None and src != dst:
        raise IncompatibleError(
            f"{source_fp['model_id']} and {target_fp['model_id']} use different tokenizers "
            f"(sha256 {src[:12]} vs {dst[:12]}); a KV mapper needs both models to read the same tokens. "
            "Pick a source and a target of the same family and tokenizer."
        )


def pair_fingerprints(
    source_model, target_model, *, source_id: str, target_id: str, source_tokenizer=None, target_tokenizer=None
) -> tuple[dict, dict]:
    """The fingerprints (with dtypes) of a (source, target) pair; refused when their tokenizers differ."""
    fingerprints = []
    for model, model_id, tokenizer in (
        (source_model, source_id, source_tokenizer),
        (target_model, target_id, target_tokenizer),
    ):
        fingerprint = model_fingerprint(model.config, model_id=model_id, tokenizer=tokenizer)
        fingerprint["dtype"] = dtype_name(model.dtype)
        fingerprints.append(fingerprint)
    check_same_tokenizer(*fingerprints)
    return fingerprints[0], fingerprints[1]


def as_prepared(job, target_model=None, train_ids=None, heldout_ids=None, **fields) -> PreparedFit:
    """``job`` when it is a :class:`PreparedFit` (and nothing else is given); else the PreparedFit of fit's
    older arguments: ``(source_model, target_model, train_ids, heldout_ids, *, source_id, target_id,
    source_tokenizer=None, target_tokenizer=None, calibration=None, options=None)``."""
    if isinstance(job, PreparedFit):
        if target_model is not None or train_ids is not None or heldout_ids is not None or fields:
            raise TypeError("fit(job) takes a PreparedFit alone; its fields hold the models, ids and options")
        return job
    unknown = set(fields) - {"source_id", "target_id", "source_tokenizer", "target_tokenizer", "calibration", "options"}
    if unknown:
        raise TypeError(f"fit() got unexpected keyword arguments {sorted(unknown)}")
    if train_ids is None:
        raise TypeError("fit() needs a PreparedFit, or source_model, target_model, train_ids and heldout_ids")
    fields["calibration"] = fields.get("calibration") or {}
    fields["options"] = fields.get("options") or FitOptions()
    return PreparedFit(source=job, target=target_model, train=train_ids, heldout=heldout_ids, **fields)
