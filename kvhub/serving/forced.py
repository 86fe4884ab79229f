"""Teacher forcing inside vLLM: a logits processor that makes a request generate the token ids it names.

vLLM scores a fixed continuation only through ``prompt_logprobs``, and a request asking for those skips
every cached prefix, the KV connector's loads included (vLLM sets ``skip_reading_prefix_cache``): scored that
way, a "mapped" condition would be the large model's own prefill.  So the gist over HTTP
(:mod:`kvhub.eval.served_gist`) generates instead, with the answer forced: a request whose
``vllm_xargs`` holds ``{"kvhub_force": [id, id, ...]}`` gets, at its i-th generated token, every logit but
that of the i-th id set to -inf.  vLLM computes the logprobs it returns before any logits processor
(``logprobs_mode`` ``raw_logprobs``, its default), so ``logprobs`` of that request are the model's own
log-probabilities of the forced ids: a teacher-forced score over the KV the connector loaded.

``kvhub serve`` starts the large server with ``--logits-processors`` naming this class
(:data:`kvhub.serving.launch.FORCED_PROCESSOR`); requests without ``kvhub_force`` are untouched.  This module imports vLLM: only a server loads it.
"""

from __future__ import annotations

import logging

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from kvhub.serving.launch import FORCE_KEY

log = logging.getLogger("kvhub.serving")

MAX_TOKEN_ID = 2**31 - 1  # tokenizers hold ids in 32 bits; 2**70 used to pass and then force nothing


def forced_ids(params: SamplingParams) -> list[int] | None:
    """The ids a request forces, None when it forces none; ValueError (vLLM answers HTTP 400) for a value
    that is not a non-empty list of token ids."""
    extra = params.extra_args
    if extra is None:
        return None
    if not isinstance(extra, dict):
        raise ValueError(
            f'vllm_xargs must be a JSON object (like {{"{FORCE_KEY}": [id, ...]}}), got {type(extra).__name__}'
        )
    ids = extra.get(FORCE_KEY)
    if ids is None:
        return None
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_TOKEN_ID for i in ids)
    ):
        raise ValueError(
            f"vllm_xargs.{FORCE_KEY} must be a non-empty list of token ids (integers from 0 to {MAX_TOKEN_ID})"
        )
    return ids


class ForcedTokens(AdapterLogitsProcessor):
    """Per request: at generated position i, only ``kvhub_force[i]`` may be sampled (after the list: as is)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        forced_ids(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token greedy decoding picks

    def __init__(self, vllm_config, device, is_pin_memory):
        super().__init__(vllm_config, device, is_pin_memory)
        model = getattr(vllm_config, "model_config", None)
        self.vocab_size = model.get_vocab_size() if model is not None else None

    def new_req_logits_processor(self, params: SamplingParams):
        ids = forced_ids(params)
        if ids is None:
            return None
        if self.vocab_size is not None and max(ids) >= self.vocab_size:
            # validate_params runs in the API server, which does not know the vocabulary; raising here, inside
            # the engine's step, would fail every request of the batch: this one is not forced, and says so
            log.error(
                "kvhub forced tokens: vllm_xargs.%s names id %d, beyond this model's vocabulary of %d; the "
                "request is generated without forcing",
                FORCE_KEY,
                max(ids),
                self.vocab_size,
            )
            return None

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            step = len(output_ids)
            if step >= len(ids) or not 0 <= ids[step] < logits.shape[-1]:
                return logits
            forced = torch.full_like(logits, float("-inf"))
            forced[ids[step]] = 0.0
            return forced

        return force
