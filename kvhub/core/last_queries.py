"""The attention of a prompt's last Q queries, collected during the prefill that builds its cache.

The ``source`` selector (kvhub.serving.recompute) ranks context tokens by how much the last Q context tokens
attend to them: P[i, t], query i's attention on key t, averaged over layers and heads.  Computing it after the
prefill costs a second pass of the model (the last Q tokens again, under eager attention, with hooks).  Here
the same numbers come out of the prefill itself: while :class:`LastQueryAttention` is entered, the model keeps
its attention implementation and its mask (the output is bit for bit the plain prefill's), and each attention
layer also computes, for its last Q query rows only,

    P_lh[i, t] = softmax_t( softcap(q_i . k_t * scaling) )   over the keys t that query may see
                 (t <= p_i, and t > p_i - window for a sliding-window layer; p_i its position)

in fp32 and adds sum_h P_lh[i, t] to ``by_query`` (B, Q, T); ``terms`` counts the (layer, head) pairs.  That is
the math of :class:`kvhub.core.capture.AttentionMass` with ``per_query=True`` over the same queries, at a cost
of one (Q x T) product per layer instead of a model forward.  Queries are the pass's last Q rows, so the pass
must cover the whole prompt from position 0 (a prefill into an empty cache) for p_i = T - Q + i to hold.

The layer sees what transformers' attention interface passes (module, query, key, value, mask, scaling,
sliding_window, softcap), so every model family kvhub supports takes this path with no per-family code.
"""

from __future__ import annotations

import sys

import torch

_PREFIX = "kvhub_last_queries_"


def _inner(previous: str, module) -> object:
    """The attention function ``previous`` names, as the module would have called it (eager: its own family's)."""
    if previous == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers import AttentionInterface

    return AttentionInterface()[previous]


def _registered(previous: str) -> str:
    """The name of the scoring implementation that wraps ``previous`` (registered once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = _PREFIX + previous
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _scoring_attention)
        if previous in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # the same mask the model builds today
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[previous])
    return name


def _scoring_attention(module, query, key, value, attention_mask, **kwargs):
    collector: LastQueryAttention = module._kvhub_last_queries
    output = _inner(collector.previous, module)(module, query, key, value, attention_mask, **kwargs)
    collector.add(query, key, kwargs, window=kwargs.get("sliding_window") or getattr(module, "sliding_window", None))
    return output


class LastQueryAttention:
    """While entered, ``model``'s forward passes also collect the attention of their last ``queries`` rows
    (module docstring); :attr:`attention` is then the (B, Q, T) mean over layers and heads."""

    def __init__(self, model, *, queries: int):
        self.model = model
        self.queries = queries
        self.by_query: torch.Tensor | None = None
        self.terms = 0
        self.previous: str = ""
        self._modules: list = []

    def __enter__(self) -> "LastQueryAttention":
        from kvhub.core.capture import _attention_output

        attention_class, _ = _attention_output(self.model)
        self.previous = self.model.config._attn_implementation or "eager"
        self._modules = [m for m in self.model.modules() if isinstance(m, attention_class)]
        for module in self._modules:
            module._kvhub_last_queries = self
        self.model.set_attn_implementation(_registered(self.previous))
        return self

    def __exit__(self, *exc) -> None:
        for module in self._modules:
            del module._kvhub_last_queries
        self._modules = []
        self.model.set_attn_implementation(self.previous)

    def add(self, query: torch.Tensor, key: torch.Tensor, kwargs: dict, *, window: int | None) -> None:
        """Add one layer's sum over heads of the last Q rows' probabilities.  query (B, Hq, Tq, D), key
        (B, Hkv, T, D) as the attention function receives them (RoPE applied, the whole prefix)."""
        count = min(self.queries, query.shape[2])
        tokens = key.shape[2]
        q = query[:, :, -count:].float()  # (B, Hq, Q, D)
        k = key.float().repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # (B, Hq, T, D)
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        logits = torch.matmul(q, k.transpose(-1, -2)) * scaling  # (B, Hq, Q, T)
        softcap = kwargs.get("softcap")
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        position = torch.arange(tokens - count, tokens, device=key.device)[:, None]  # (Q, 1): p_i
        keys = torch.arange(tokens, device=key.device)[None, :]
        hidden = keys > position
        if window:
            hidden |= keys <= position - window
        summed = logits.masked_fill_(hidden, -torch.inf).softmax(-1).sum(1)  # (B, Q, T)
        self.by_query = summed if self.by_query is None else self.by_query + summed
        self.terms += query.shape[1]

    @property
    def attention(self) -> torch.Tensor:
        """(B, Q, T) fp32 on the host: P[i, t] averaged over layers and heads (what query_attention returns)."""
        if self.by_query is None:
            from kvhub.errors import UnsupportedModelError

            raise UnsupportedModelError(f"no attention module of {type(self.model).__name__} ran in the prefill")
        return (self.by_query / self.terms).float().cpu()
