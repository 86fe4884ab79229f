"""Scoring by a judge: does what the target wrote under a cache say what its own answer says?

ROUGE-L (:func:`kvhub.eval.generation.rouge_l`) counts the reference's tokens written in order, so an answer in
other words scores low and one that copies the reference's opening and then wanders scores high.  A judge reads
the meaning instead: a chat model (``kvhub eval`` uses the target itself, the one model every run has loaded) is
shown the reference (the target's own answer) and a candidate (what it wrote under another cache) and asked
whether the candidate says the same things; the score is its probability of answering "Yes" rather than "No"
at the first token of its reply, so it is graded, not thresholded.  A judge can be lenient or biased; the
conditions it scores are what calibrate it: the target's own answer judged against itself is the ceiling, the
no-context floor's answer and the wrong document's are what "says something else" scores, and a result counts
only where it is above them (:func:`kvhub.eval.gist.summarize_gist` reports it as gap closed, like the others).
"""

from __future__ import annotations

import functools
import hashlib

import torch

from kvhub.errors import ConfigError

PROMPT = (  # of the wordings tried on the real target, the one that ordered known pairs best (docs/benchmarks.md)
    "You are a strict grader. Answer A is correct. Answer B is a student's answer to the same request. Both may "
    "stop mid-sentence.\n\nAnswer A:\n{reference}\n\nAnswer B:\n{candidate}\n\nIs answer B correct, that is, "
    "does it state the same subjects, names and facts as answer A and nothing that contradicts it? Reply with one "
    "word, Yes or No."
)
YES = ("Yes", "yes", "YES")  # the reply's first token: no space before it
NO = ("No", "no", "NO")


def judge_key() -> str:
    """What a cached judged score is keyed on: the sha256 of the wording and the Yes / No spellings, so a
    changed judge never lets an old score pass for its own (:func:`kvhub.eval.gist.read_gist_score`)."""
    return hashlib.sha256(repr((PROMPT, YES, NO)).encode()).hexdigest()[:12]


def _choices(tokenizer) -> tuple[list[int], list[int]]:
    """The first-token ids a reply of Yes / of No starts with (every spelling in :data:`YES` / :data:`NO`);
    ConfigError where the tokenizer cannot tell the two apart."""
    yes = sorted({tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in YES})
    no = sorted({tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in NO})
    if set(yes) & set(no):
        raise ConfigError("this tokenizer starts 'Yes' and 'No' with the same token: it cannot be a judge")
    return yes, no


def judge_prompt(tokenizer, reference: str, candidate: str) -> list[int]:
    """The judge's prompt as token ids: :data:`PROMPT` as one user turn in the tokenizer's chat template, the
    assistant's turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the judge needs a chat model: its tokenizer has no chat template")
    messages = [{"role": "user", "content": PROMPT.format(reference=reference.strip(), candidate=candidate.strip())}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def judge(model, tokenizer, reference: list[int], candidates: list[list[int]]) -> list[float]:
    """P(Yes) / (P(Yes) + P(No)) at the first token of ``model``'s reply, for each candidate (token ids, decoded
    with ``tokenizer``) against ``reference``, all candidates in one left-padded batch (each row scores as it
    would alone)."""
    if not candidates:
        return []
    yes, no = _choices(tokenizer)
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    prompts = [judge_prompt(tokenizer, decode(reference), decode(c)) for c in candidates]
    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    held = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt, device=device)
        held[row, longest - len(prompt) :] = 1
    positions = (held.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=held, position_ids=positions).logits[:, -1].float()
    probs = logits.softmax(-1)
    p_yes, p_no = probs[:, yes].sum(-1), probs[:, no].sum(-1)
    return (p_yes / (p_yes + p_no).clamp(min=torch.finfo(torch.float32).tiny)).tolist()
