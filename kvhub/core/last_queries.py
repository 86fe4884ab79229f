"""The attention of a prompt's last Q queries, collected during the prefill that builds its cache.

The ``source`` selector (kvhub.serving.recompute) ranks context tokens by how much the last Q context tokens
attend to them: P[i, t], query i's attention on key t, averaged over layers and heads.  Computing it after the
prefill costs a second pass of the model (the last Q tokens again, under eager attention, with hooks).  Here
the same numbers come out of the prefill itself: while :class:`LastQueryAttention` is entered, the model keeps
its attention implementation and its mask (the output is bit for bit the plain prefill's), and each attention
layer also computes, for its last Q query rows only,

    P_lh[i, t] = softmax_t( softcap(q_i . k_t * scaling) )   over the keys t that query may see
                 (t <= p_i, and t > p_i - window for a sliding-window layer; p_i its position)

in fp32 and :attr:`LastQueryAttention.attention` sums sum_h P_lh[i, t] over the layers, divided by the (layer, head)
pairs.  A layer keeps only its (Q x T) logits during the prefill; the masks and softmaxes of all layers run in one
batch afterwards, so the scoring adds a few operators per layer.  That is
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
# Logits held before a group is reduced (elements): the batched softmax of all layers at once, while a 14B
# source at 16k tokens (48 layers x 40 heads x 16 queries x 16k keys, 0.5G elements) is reduced in parts.
_HELD_ELEMENTS = 1 << 26


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
        self._logits: dict[tuple, list[torch.Tensor]] = {}  # (scaling, softcap, window, Q) -> per layer logits
        self._total: torch.Tensor | None = None  # (B, Q, T): the groups already reduced
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
        """Keep one layer's logits of the last Q rows: query (B, Hq, Tq, D), key (B, Hkv, T, D) as the attention
        function receives them (RoPE applied, the whole prefix).  The grouped-query heads of one KV head
        share a GEMM; the masks and softmaxes of all layers run together in :attr:`attention`."""
        count = min(self.queries, query.shape[2])
        batch, heads, _, dim = query.shape
        q = query[:, :, -count:].reshape(batch, key.shape[1], -1, dim)  # (B, Hkv, G*Q, D): G query heads per KV head
        logits = torch.matmul(q, key.transpose(-1, -2))  # (B, Hkv, G*Q, T)
        scaling = kwargs.get("scaling") or dim**-0.5
        group = (scaling, kwargs.get("softcap") or None, window or None, count)
        self._logits.setdefault(group, []).append(logits)
        self.terms += heads
        if sum(t.numel() for t in self._logits[group]) > _HELD_ELEMENTS:  # long contexts: reduce what is held
            self._total = self._reduced({group: self._logits.pop(group)}, self._total)

    @staticmethod
    def _reduced(groups: dict, total: torch.Tensor | None) -> torch.Tensor | None:
        """``total`` (B, Q, T) plus the sum over the layers and heads of ``groups`` of their probabilities, each
        group of alike layers in one batch."""
        for (scaling, softcap, window, count), layers in groups.items():
            logits = torch.stack(layers).float() * scaling  # (L, B, Hkv, G*Q, T)
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            tokens = logits.shape[-1]
            logits = logits.unflatten(3, (-1, count))  # (L, B, Hkv, G, Q, T)
            position = torch.arange(tokens - count, tokens, device=logits.device)[:, None]  # (Q, 1): p_i
            keys = torch.arange(tokens, device=logits.device)[None, :]
            hidden = keys > position
            if window:
                hidden |= keys <= position - window
            summed = logits.masked_fill_(hidden, -torch.inf).softmax(-1).sum((0, 2, 3))  # (B, Q, T)
            total = summed if total is None else total + summed
        return total

    @property
    def attention(self) -> torch.Tensor:
        """(B, Q, T) fp32 on the host: P[i, t] averaged over layers and heads (what query_attention returns)."""
        total = self._reduced(self._logits, self._total)
        if total is None:
            from kvhub.errors import UnsupportedModelError

            raise UnsupportedModelError(f"no attention module of {type(self.model).__name__} ran in the prefill")
        return (total / self.terms).float().cpu()
