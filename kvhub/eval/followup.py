"""The follow-up turn: after an escalation, the user asks about a fact the first question did not point at.

Each item is a two-turn conversation over one context.  The context states two facts of different kinds
(a vault's access code, a meeting's room number) at different depths, in filler prose.  Turn 1 asks for the
code; the escalation happens there (the handoff's context is turn 1's prompt minus its last token, so its
recompute set R1 is chosen from that question).  The target answers it (the answer is in the prompt, as a
transcript holds it), and turn 2 asks for the room number: the item's answer.

Conditions (per recompute variant; own, source and floor shared):

- ``own``:           the target's own prefill of the whole conversation;
- ``mapped``:        the turn-1 handoff cache (map + R1 exact), the turns read by the target on top;
- ``reselect``:      the same, and at turn 2 the spans the new question points at recomputed as well
                     (:mod:`kvhub.serving.turns`): what keeping every token (mapped) allows;
- ``drop``:          the target prefilled R1 only (:mod:`kvhub.serving.drop`), the turns on top;
- ``drop_reselect``: the same, and at turn 2 the target prefills the newly chosen spans too, at their
                     positions (a SpecPrefill that re-reads the context per turn);
- ``control``:       ``reselect`` over the no-information control map;
- ``source``, ``floor``: the source alone; the target given the last ``FLOOR_TOKENS`` tokens.

Item meta ``room_in_r1``: the share of the room number's tokens that R1 already held (a follow-up is only
a follow-up where that share is below 1).
"""

from __future__ import annotations

import copy

import random

import torch

from kvhub.core.capture import cache_kwargs, run_model
from kvhub.eval.longctx import (
    _COLOURS,
    _THINGS,
    DEPTHS,
    FLOOR_TOKENS,
    RecallItem,
    RecallScore,
    _answer_ids,
    _count,
    _haystack,
    answer_score,
)

FOLLOWUP_CONDITIONS = ("own", "mapped", "reselect", "drop", "drop_reselect", "control", "source", "floor")
FOLLOWUP_PAIRS = (("reselect", "drop"), ("reselect", "drop_reselect"), ("reselect", "control"), ("mapped", "drop"))
_PEOPLE = (
    "Dr. Okafor",
    "Ms. Lindqvist",
    "Mr. Haddad",
    "Dr. Petrenko",
    "Ms. Castellano",
    "Mr. Nakamura",
    "Dr. Oyelaran",
    "Ms. Brandt",
    "Mr. Quispe",
    "Dr. Varga",
)


# ---- items ------------------------------------------------------------------------------------------
def followup_items(tokenizer, filler: list[str], *, context_tokens: int, n: int, seed: int = 0) -> list[RecallItem]:
    """``n`` two-turn items of about ``context_tokens`` tokens (module docstring); meta ``escalation_tokens``:
    the handoff's context length (turn 1's prompt minus its last token)."""
    rng = random.Random(f"followup-{seed}-{context_tokens}")
    items = []
    for i in range(n):
        colour, thing = rng.choice(_COLOURS), rng.choice(_THINGS)
        person, code, room = rng.choice(_PEOPLE), str(rng.randrange(10_000, 100_000)), str(rng.randrange(100, 1000))
        code_sentence = f"The access code for the {colour} {thing} vault is {code}."
        room_sentence = f"The meeting with {person} is in room {room}."
        depth = DEPTHS[i % len(DEPTHS)]
        inserts = [(depth, code_sentence), (DEPTHS[(i + 2) % len(DEPTHS)], room_sentence)]
        turn1 = (
            f"\n\nQuestion: What is the access code for the {colour} {thing} vault?\n"
            f"Answer: The access code for the {colour} {thing} vault is"
        )
        turn2 = (
            f" {code}.\n\nQuestion: In which room is the meeting with {person}?\n"
            f"Answer: The meeting with {person} is in room"
        )
        stated = sum(_count(tokenizer, text) for text in (code_sentence, room_sentence, turn1, turn2))
        body = _haystack(tokenizer, filler, rng, context_tokens - stated, inserts)
        escalation = tokenizer(body + turn1, add_special_tokens=False)["input_ids"]
        prompt = tokenizer(body + turn1 + turn2, add_special_tokens=False)["input_ids"]
        answer = _answer_ids(tokenizer, body + turn1 + turn2, " " + room)
        meta = {
            "context_tokens": len(prompt),
            "escalation_tokens": len(escalation) - 1,
            "depth": depth,
            "room_at": _find(prompt[: len(escalation) - 1], answer),
        }
        items.append(RecallItem(f"followup-{context_tokens}-{i}", prompt, answer, room, meta))
    return items


def _find(ids: list[int], needle: list[int]) -> list[int]:
    """Positions of the last occurrence of ``needle`` in ``ids`` ([] when absent)."""
    for start in range(len(ids) - len(needle), -1, -1):
        if ids[start : start + len(needle)] == needle:
            return list(range(start, start + len(needle)))
    return []


# ---- scoring -----------------------------------------------------------------------------------------
@torch.no_grad()
def _read(model, cache, ids: torch.Tensor, start: int) -> None:
    """The model reads ``ids`` (1, R) at positions start.. over ``cache`` (the turns after the escalation)."""
    device = next(model.parameters()).device
    positions = torch.arange(start, start + ids.shape[1], device=device)[None]
    model.base_model(
        input_ids=ids.to(device), position_ids=positions, use_cache=True, **cache_kwargs(model.base_model, cache)
    )


@torch.no_grad()
def score_followup_item(item: RecallItem, *, mapper, control, source, target, tokenizer, variants) -> list[RecallScore]:
    """One RecallScore per recompute variant over :data:`FOLLOWUP_CONDITIONS` (module docstring)."""
    from kvhub.serving import drop
    from kvhub.serving.handoff import prepare_cache_counted
    from kvhub.serving.recompute import cropped
    from kvhub.serving.turns import reselect_turn

    prompt, answer, escalated = item.prompt_ids, item.answer_ids, item.meta["escalation_tokens"]
    device = next(target.parameters()).device
    conversation = torch.tensor([prompt[:-1]], device=device)
    context, last = conversation[:, :escalated], conversation.shape[1]
    turns_tail, final_tail = prompt[escalated:] + answer, [prompt[-1]] + answer
    shared = {"own": answer_score(target, run_model(target, conversation), final_tail, len(answer))}
    floor = torch.tensor([prompt[-FLOOR_TOKENS:-1]], device=device)
    shared["floor"] = answer_score(target, run_model(target, floor), final_tail, len(answer))
    source_cache = run_model(source, conversation)
    escalation = torch.tensor([prompt[: escalated + 1]], device=device)
    out = []
    for spec in variants:
        spec, result = spec.capped(escalated), dict(shared)
        for name, which in (("mapped", mapper), ("control", control)):
            cache, r1 = prepare_cache_counted(
                which,
                source,
                target,
                escalation,
                recompute=spec,
                tokenizer=tokenizer,
                source_cache=cropped(source_cache, escalated),
            )
            if name == "mapped":
                result["mapped"] = answer_score(target, cropped(cache, escalated), turns_tail, len(answer))
                held = r1
            _read(target, cache, conversation[:, escalated:], escalated)
            r2 = (
                reselect_turn(
                    target,
                    cache,
                    conversation,
                    spec,
                    context_tokens=escalated,
                    held=r1,
                    source_model=source,
                    source_cache=source_cache,
                    tokenizer=tokenizer,
                )
                if spec.selective
                else r1[:0]
            )
            result["reselect" if name == "mapped" else "control"] = answer_score(target, cache, final_tail, len(answer))
            if name == "mapped":
                added = r2
        kept = drop.drop_cache(target, context, held)
        # answer_score grows the cache it reads: the plain drop reads a copy, drop_reselect extends the original
        result["drop"] = answer_score(target, copy.deepcopy(kept), turns_tail, len(answer), start=escalated)
        drop.extend(target, kept, conversation[:, escalated:], torch.arange(escalated, last))
        drop.add_context_tokens(target, kept, context, added)
        result["drop_reselect"] = answer_score(target, kept, final_tail, len(answer), start=last)
        out.append((result, held, added))
    source_result = answer_score(source, source_cache, final_tail, len(answer))  # last: it grows source_cache
    scores = []
    for result, held, added in out:
        result["source"] = source_result
        room = item.meta["room_at"]
        meta = {
            **item.meta,
            "reselected": int(added.numel()),
            "room_in_r1": sum(p in set(held.tolist()) for p in room) / len(room) if room else None,
        }
        ordered = {c: result[c] for c in FOLLOWUP_CONDITIONS}
        scores.append(
            RecallScore(
                id=item.id,
                exact={c: r[0] for c, r in ordered.items()},
                token_acc={c: r[1] for c, r in ordered.items()},
                logp={c: r[2] for c, r in ordered.items()},
                recomputed=int(held.numel()),
                meta=meta,
                predicted={c: tokenizer.decode(r[3]) for c, r in ordered.items()},
                gold=item.answer,
            )
        )
    return scores
