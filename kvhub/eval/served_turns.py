"""Turns after an escalation, through a running ``kvhub serve`` pair: facts and time to first token per turn.

Each item is a conversation of :data:`TURNS` turns over one context that states one fact per turn at its own
depth (a vault's access code, a meeting's room, a flight's gate) in filler prose.  Turn t asks for fact t; the
prompt of turn t + 1 holds turn t's answer, as a chat history holds it.  The escalation happens at turn 1, and
the conversation continues on the large server.  Each arm has its own ``cache_salt``; requests go one at a time:

=======  ==================================================================================================
arm      what each turn sends
=======  ==================================================================================================
own      the large server alone: turn 1 is its own prefill, later turns reuse its own prefix cache (what a
         large model that read the conversation from its start pays; no kvhub)
mapped   turn 1 to the small server (its KV is stored), then each turn to the large one: turn 1 maps the
         stored KV and recomputes the default selection; a later turn finds turn 1's stored prompt as its
         prefix, maps it again, and the selection comes from the large model's attention from the new
         question (the stored source rows are an earlier turn's: ``select_fallback``), the rest prefilled
relay    each turn to the small server first (1 token: it stores the turn's KV and attention, its own prefix
         cache reads only the new tokens), then to the large one: each turn maps the whole conversation
         and selects by the small model's attention from the new question
settled  as mapped at turn 1; then, while the answer is read, the same prompt again with ``kvhub_prefill``
         (1 token: the large model's own exact prefill, nothing loaded; its time is ``settle_s``), so later
         turns find it in the large server's prefix cache and compute only their new tokens, as own does
         (their loads are ``unmapped``: nothing is mapped after turn 1)
control  as mapped, with the no-information control map (``kvhub_control``): the map's own contribution
=======  ==================================================================================================

Per turn and arm, a 1-token request is timed first (its wall time is the turn's time to first token: the
escalation's load, recompute and prefill all happen before the first token), then the answer request is
scored: exact when its first len(answer) greedy tokens are the answer's.  A mapped or relay turn that the
large server did not load from the KV store (no ``kvhub`` report with ``mapped_tokens``) is counted in
``unmapped_*``; the summary says so rather than scoring a prefill as an escalation.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

from kvhub.errors import ConfigError
from kvhub.eval.longctx import _COLOURS, _THINGS, DEPTHS, _answer_ids, _count, _haystack, filler_paragraphs
from kvhub.eval.served import CONTROL_PARAMS, Endpoint, new_tenant

TURNS = 3
TURN_ARMS = ("own", "mapped", "relay", "settled", "control")
SETTLE_PARAMS = {"kvhub_prefill": True}  # kv_transfer_params: the large model's own prefill, nothing loaded
_CITIES = ("Lisbon", "Nairobi", "Osaka", "Quito", "Tromso", "Valparaiso", "Windhoek", "Yerevan", "Zagreb", "Hobart")
_PEOPLE = ("Dr. Okafor", "Ms. Lindqvist", "Mr. Haddad", "Dr. Petrenko", "Ms. Castellano", "Mr. Nakamura")


@dataclass(frozen=True)
class TurnItem:
    """prompts[t]: token ids of turn t + 1's prompt (each a prefix of the next); answers[t]: its answer's ids."""

    id: str
    prompts: list[list[int]]
    answers: list[list[int]]
    golds: list[str]
    meta: dict = field(default_factory=dict)


def turn_items(tokenizer, *, context_tokens: int, n: int, seed: int = 0, filler: list[str] | None = None):
    """``n`` seeded conversations (module docstring) over contexts of about ``context_tokens`` tokens."""
    filler = filler if filler is not None else filler_paragraphs(seed=seed)
    rng = random.Random(f"turns-{seed}-{context_tokens}")
    items = []
    for i in range(n):
        colour, thing = rng.choice(_COLOURS), rng.choice(_THINGS)
        person, city = rng.choice(_PEOPLE), rng.choice(_CITIES)
        facts = [str(rng.randrange(10_000, 100_000)), str(rng.randrange(100, 1000)), str(rng.randrange(10, 100))]
        sentences = [
            f"The access code for the {colour} {thing} vault is {facts[0]}.",
            f"The meeting with {person} is in room {facts[1]}.",
            f"The flight to {city} boards at gate {facts[2]}.",
        ]
        asks = [
            (
                f"What is the access code for the {colour} {thing} vault?",
                f"The access code for the {colour} {thing} vault is",
            ),
            (f"In which room is the meeting with {person}?", f"The meeting with {person} is in room"),
            (f"At which gate does the flight to {city} board?", f"The flight to {city} boards at gate"),
        ]
        questions = [f"\n\nQuestion: {q}\nAnswer: {a}" for q, a in asks]
        stated = sum(_count(tokenizer, text) for text in sentences + questions) + 8 * TURNS
        inserts = [(DEPTHS[(i + 2 * k) % len(DEPTHS)], sentence) for k, sentence in enumerate(sentences)]
        text = _haystack(tokenizer, filler, rng, context_tokens - stated, inserts)
        prompts, answers = [], []
        for turn in range(TURNS):
            if turn:
                text += f" {facts[turn - 1]}."
            text += questions[turn]
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            answers.append(_answer_ids(tokenizer, text, " " + facts[turn]))
        for earlier, later in zip(prompts, prompts[1:]):
            if later[: len(earlier)] != earlier:
                raise ConfigError(
                    "a turn's prompt does not extend the previous one token for token; the item cannot be served"
                )
        items.append(
            TurnItem(f"turns-{context_tokens}-{i}", prompts, answers, facts, {"context_tokens": len(prompts[0])})
        )
    return items


@dataclass
class TurnResult:
    """One arm's turn: exact answer, time to first token, the small server's time (relay) and the load report."""

    exact: int
    ttft_s: float
    small_s: float | None
    load: dict
    settle_s: float | None = None  # settled, turn 1: the large model's own prefill sent after the answer


def _timed(endpoint: Endpoint, prompt: list[int], **kwargs) -> tuple[float, dict]:
    started = time.perf_counter()
    completion = endpoint.complete(prompt, max_tokens=1, **kwargs)
    return time.perf_counter() - started, completion.kv_transfer_params.get("kvhub") or {}


def _turn(large: Endpoint, prompt, answer, *, tenant: str, control: bool, small_s=None) -> TurnResult:
    params = {"kv_transfer_params": dict(CONTROL_PARAMS)} if control else {}
    ttft, load = _timed(large, prompt, cache_salt=tenant, **params)
    generated = large.complete(prompt, max_tokens=len(answer), cache_salt=tenant, **params).token_ids or []
    return TurnResult(int(generated[: len(answer)] == answer), ttft, small_s, load if isinstance(load, dict) else {})


def score_turn_item(item: TurnItem, *, small: Endpoint, large: Endpoint) -> dict[str, list[TurnResult]]:
    """Every arm of ``item``, turn by turn (module docstring)."""
    results: dict[str, list[TurnResult]] = {arm: [] for arm in TURN_ARMS}
    own, escalated, relayed, settled = new_tenant(), new_tenant(), new_tenant(), new_tenant()
    for tenant in (escalated, settled):  # turn 1's KV stored for mapped / control, and for settled
        small.complete(item.prompts[0], max_tokens=1, cache_salt=tenant)
    for turn, (prompt, answer) in enumerate(zip(item.prompts, item.answers)):
        results["own"].append(_turn(large, prompt, answer, tenant=own, control=False))
        results["mapped"].append(_turn(large, prompt, answer, tenant=escalated, control=False))
        results["control"].append(_turn(large, prompt, answer, tenant=escalated, control=True))
        small_s, _ = _timed(small, prompt, cache_salt=relayed)
        results["relay"].append(_turn(large, prompt, answer, tenant=relayed, control=False, small_s=small_s))
        results["settled"].append(_turn(large, prompt, answer, tenant=settled, control=False))
        if turn == 0:
            results["settled"][0].settle_s, _ = _timed(
                large, prompt, cache_salt=settled, kv_transfer_params=dict(SETTLE_PARAMS)
            )
    return results


def _median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def summarize_turns(scored: list[dict[str, list[TurnResult]]]) -> dict:
    """Per arm and turn t (1-based): ``acc_<arm>_t<t>``, ``ttft_<arm>_t<t>`` (median seconds); for the
    escalating arms ``unmapped_<arm>_t<t>`` (turns the large server did not load), ``select_fallback_<arm>_t<t>``
    (turns whose selection fell back from the source's attention) and ``recomputed_<arm>_t<t>`` (mean
    ``exact_tokens``); ``small_s_relay_t<t>``; ``settle_s`` (the settled arm's own prefill of turn 1, sent
    after turn 1's answer, off the turns' path); ``speedup_<arm>_t<t>`` = own's turn-1 time to first token
    over the arm's, and ``vs_turn1_<arm>_t<t>`` = the arm's turn-t time over its own turn 1 (<= 1: as fast);
    ``conversation_s_<arm>``: the median over items of the sum of the turns' times to first token."""
    out: dict = {"n": len(scored), "turns": TURNS}
    if not scored:
        return out
    own_first = _median(item["own"][0].ttft_s for item in scored)
    for arm in TURN_ARMS:
        first = _median(item[arm][0].ttft_s for item in scored)
        for turn in range(TURNS):
            rows = [item[arm][turn] for item in scored]
            key = f"{arm}_t{turn + 1}"
            out[f"acc_{key}"] = sum(r.exact for r in rows) / len(rows)
            out[f"ttft_{key}"] = _median(r.ttft_s for r in rows)
            out[f"speedup_{key}"] = own_first / out[f"ttft_{key}"]
            out[f"vs_turn1_{key}"] = out[f"ttft_{key}"] / first
            if arm != "own":
                out[f"unmapped_{key}"] = sum(not r.load.get("mapped_tokens") for r in rows)
                out[f"select_fallback_{key}"] = sum(bool(r.load.get("select_fallback")) for r in rows)
                out[f"recomputed_{key}"] = sum(int(r.load.get("exact_tokens") or 0) for r in rows) / len(rows)
            if arm == "relay":
                out[f"small_s_{key}"] = _median(r.small_s for r in rows)
        if arm == "settled":
            out["settle_s"] = _median(item[arm][0].settle_s for item in scored)
        out[f"conversation_s_{arm}"] = _median(sum(r.ttft_s for r in item[arm]) for item in scored)
    return out


@dataclass
class TurnScore:
    """One conversation's arms, turn by turn (:func:`score_turn_item`), with turn 1's prompt length."""

    id: str
    gold: list[str]
    context_tokens: int
    arms: dict[str, list[TurnResult]]


class TurnsTask:
    """The turns after an escalation at one length, as :func:`kvhub.eval.run.run_task` runs it over
    :class:`kvhub.eval.served_conditions.ServedConditions` (served only: each turn is timed on the servers).
    ``items``: these instead of ``limit`` built conversations."""

    read_score = None  # served scores are not cached

    def __init__(self, task: str, conditions, *, context_tokens: int, limit: int, seed: int = 0, items=None):
        if getattr(conditions, "kind", None) != "served":
            raise ConfigError("the turns task times requests to a kvhub serve pair: run it with kvhub eval-serve")
        self.task, self.conditions, self.context_tokens, self.limit, self.seed = (
            task,
            conditions,
            context_tokens,
            limit,
            seed,
        )
        self.name = f"{task}-{context_tokens}"
        self._items = items

    @classmethod
    def tasks(cls, name: str, conditions, options) -> list:
        return [
            cls(name, conditions, context_tokens=length, limit=options.limit, seed=options.seed)
            for length in options.context_tokens
        ]

    def items(self) -> list[TurnItem]:
        if self._items is not None:
            return list(self._items)
        return turn_items(self.conditions.tokenizer, context_tokens=self.context_tokens, n=self.limit, seed=self.seed)

    def score(self, item: TurnItem, variants) -> list[TurnScore]:
        arms = score_turn_item(item, small=self.conditions.small, large=self.conditions.large)
        return [TurnScore(item.id, item.golds, len(item.prompts[0]), arms) for _ in variants]

    def summarize(self, scores: list[TurnScore]) -> dict:
        """:func:`summarize_turns` with ``task``, ``requested_context_tokens`` and ``context_tokens`` (turn 1's
        mean prompt length)."""
        summary = summarize_turns([score.arms for score in scores])
        summary.update(
            task=self.task,
            requested_context_tokens=self.context_tokens,
            context_tokens=sum(score.context_tokens for score in scores) / max(1, len(scores)),
        )
        return summary

    def record(self, variant: str, item: TurnItem, score: TurnScore) -> dict:
        """Each arm's exact answers and times per turn."""
        return {
            "id": item.id,
            "gold": item.golds,
            **{
                arm: [
                    {
                        "exact": r.exact,
                        "ttft_s": round(r.ttft_s, 4),
                        "small_s": r.small_s,
                        "settle_s": r.settle_s,
                        "load": r.load,
                    }
                    for r in rows
                ]
                for arm, rows in score.arms.items()
            },
        }

    def dataset(self, items) -> dict:
        from kvhub.eval.results import items_sha256

        return {
            "name": self.name,
            "origin": f"built by kvhub.eval.served_turns (seed {self.seed})",
            "context_tokens": self.context_tokens,
            "n": len(items),
            "sha256": items_sha256(items),
        }
