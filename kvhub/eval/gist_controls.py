"""The gist's controls that carry no information about the item's context, beside the no-information map.

Teacher-forced NLL can be fooled: a cache that tells the target nothing about the context can still lower the
NLL of the target's own answer (the right shapes, norms and positions, the request recomputed exactly).  So
every gist condition is scored beside controls that go through the same path (the same mapper, the same
:class:`~kvhub.serving.spec.Recompute` spec) with the information taken out:

- ``wrong`` (**wrong document**): the item's request asked over *another* item's context of the same
  generator and seed (the next item built), cropped (or repeated) to this item's context length, mapped and
  recomputed like the handoff: what the mapped cache gives when it holds the wrong text;
- ``zero``: the mapped cache's K and V all zero before any recompute (:func:`zero_mapper`); the recomputed
  positions are then the target's own over zeros: a mapped cache with no information;
- ``raw``: the source's own K and V handed to the target unmapped (:class:`RawSourceMap`), where the two caches
  have the same shapes (layers, KV heads, head size): what the map adds over no map at all.

Each chooses its recomputed positions as the spec does for its own cache and text (``select=source`` over the
source's attention: the handoff's positions for ``zero``, the wrong text's for ``wrong``; ``select=target`` over
the mapped cache it holds).

A result counts only where it beats every control (``control``, ``wrong``, ``zero`` and ``raw`` where scored):
:func:`kvhub.eval.gist.summarize_gist` reports ``gap_closed_map_minus_controls``, mapped minus the best of them.
"""

from __future__ import annotations

from dataclasses import replace

from kvhub.errors import ConfigError

GIST_CONTROLS = ("wrong", "zero", "raw")


def zero_mapper(control):
    """A copy of the no-information control map (:func:`kvhub.core.control.control_mapper`, zero weights) whose
    biases are zero too: its cache is all zeros (RoPE of zero is zero), so what a handoff scores from it is the
    recompute's and the target's priors alone."""
    from kvhub.core.mapper import Mapper

    tensors = {name: t.clone().zero_() if name.endswith("bias") else t for name, t in control.tensors.items()}
    metadata = {**control.metadata, "notes": ["zero control: zero weights, zero bias"]}
    return Mapper(tensors, metadata, dtype=control.dtype, compute_dtype=control.compute_dtype, deshrink="off")


class RawSourceMap:
    """A mapper stand-in whose transfer hands the source's cache to the target as it is (cast to the target's
    dtype, copied): the ``raw`` control.  Everything else (the checks the handoff makes, the selection's
    metadata) is the wrapped mapper's.  Build it with :func:`raw_source_map`."""

    def __init__(self, mapper):
        self._mapper = mapper

    def __getattr__(self, name):
        return getattr(self._mapper, name)

    def transfer(self, cache, *, dtype=None, **_):
        from transformers import DynamicCache

        out = DynamicCache(config=self._mapper._config("target"))
        for index, layer in enumerate(cache.layers):  # (B, H, T, D) each: the shapes raw_source_map checked
            keys, values = (t.to(dtype or t.dtype).clone() for t in (layer.keys, layer.values))
            out.update(keys, values, index)
        return out


def raw_source_map(mapper, source_config, target_config) -> RawSourceMap | None:
    """The ``raw`` control for ``mapper`` when the source's cache fits the target's as it is (the same number of
    layers, KV heads and head size, no sliding-window target); None where the shapes do not allow it."""

    def shape(config) -> tuple:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim

    if mapper.windowed_target() or shape(source_config) != shape(target_config):
        return None
    return RawSourceMap(mapper)


def shared_ends(a: list[int], b: list[int]) -> tuple[int, int]:
    """(common prefix length, common suffix length) of two prompts, never overlapping in the shorter one: the
    template's head and the request both ask (e.g. "Summarize the text above"), around the contexts."""
    shortest = min(len(a), len(b))
    head = 0
    while head < shortest and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < shortest - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    return head, tail


def wrong_document_ids(prompt: list[int], donor: list[int]) -> list[int]:
    """``prompt`` with its context replaced by ``donor``'s, at the same length: the shared head and request
    (:func:`shared_ends`; at least the last token, which the target consumes) kept, the middle taken from the
    donor's middle, cropped, or repeated from its start when shorter.  ConfigError when the donor has no context
    of its own (the same prompt)."""
    head, tail = shared_ends(prompt, donor)
    tail = max(tail, 1)
    head = min(head, len(prompt) - tail)
    middle = donor[head : len(donor) - tail] if len(donor) > head + tail else []
    if not middle:
        raise ConfigError("the wrong-document control needs another item whose context differs from this one's")
    width = len(prompt) - head - tail
    filled = (middle * (width // len(middle) + 1))[:width]
    return prompt[:head] + filled + prompt[len(prompt) - tail :]


def with_wrong_documents(items: list, donors: list) -> list:
    """``items`` (GistItems) each with ``wrong_ids``: its prompt over the context of ``donors[i]`` (another item of
    the same generator and seed), and ``meta["wrong_document"]``, the donor's id."""
    return [
        replace(
            item,
            wrong_ids=wrong_document_ids(item.prompt_ids, donor.prompt_ids),
            meta={**item.meta, "wrong_document": donor.id},
        )
        for item, donor in zip(items, donors)
    ]
