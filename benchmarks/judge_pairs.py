"""How the gist's judge (kvhub.eval.judge) orders answers whose relation to a reference is known, for each wording
tried: the reference itself, a paraphrase, a vague answer, a wrong-fact answer and answers about other texts.

A judge is of use only where it scores the same answer above a paraphrase above answers that say something else;
this measures that on hand-written pairs (not on the suite's items, which the wording must not be tuned to), with
the target as judge, and prints P(yes) / (P(yes) + P(no)) per pair and wording.  `kvhub.eval.judge.PROMPT` is the
wording kept.

    OMP_NUM_THREADS=1 python benchmarks/judge_pairs.py --model Qwen/Qwen2.5-Coder-1.5B-Instruct \
        --out docs/results/judge_pairs.json
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

REFERENCE = (
    "The conversation discusses the history of the Roman aqueducts, how they carried water over long distances "
    "using gravity, and why some of them are still standing today. The user asked"
)
PAIRS = {  # kind -> a candidate, from most to least like the reference
    "same": REFERENCE,
    "paraphrase": "We talked about Roman aqueducts: they used gravity to move water across great distances, and "
    "several survive to this day. You also asked about",
    "vague": "The conversation discusses several topics, including history and engineering, and the user asked "
    "questions about them. The assistant answered each question in turn and",
    "wrong facts": "The conversation discusses the history of the Roman aqueducts, how they were built by slaves "
    "from marble, and why none of them survive today.",
    "other chat": "The conversation is about how to bake sourdough bread at home, including feeding the starter "
    "and choosing the right flour. The user also wanted to know",
    "other text": "The text above is a licence that grants permission to use, copy and modify the software, "
    "provided that the copyright notice is kept in all copies.",
}
WORDINGS = {  # the wordings tried; "kept" is kvhub.eval.judge.PROMPT
    "same text": "Two answers were written about a long text that you cannot see.\n\nAnswer A:\n{reference}\n\n"
    "Answer B:\n{candidate}\n\nAre A and B about the same text, with the same subjects, names and facts? Reply "
    "with one word, Yes or No.",
    "same things": "Two answers were written to the same request about a long text. Both may stop "
    "mid-sentence.\n\nAnswer A:\n{reference}\n\nAnswer B:\n{candidate}\n\nDoes answer B say the same things as "
    "answer A: the same subjects, names and facts (the wording may differ)? Reply with one word, Yes or No.",
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-Coder-1.5B-Instruct", help="a model kvhub fetch models has")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    from kvhub.eval import judge as judging
    from kvhub.models.loading import load_model

    model, tokenizer, _ = load_model(args.model, device="cpu", dtype=getattr(torch, args.dtype))

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    kept, scores = judging.PROMPT, {}
    try:
        for name, wording in {**WORDINGS, "kept": kept}.items():
            judging.PROMPT = wording
            judged = judging.judge(model, tokenizer, encode(REFERENCE), [encode(c) for c in PAIRS.values()])
            scores[name] = dict(zip(PAIRS, judged))
    finally:
        judging.PROMPT = kept
    for name, by_kind in scores.items():
        print(f"{name:12s} " + "  ".join(f"{kind} {p:.3f}" for kind, p in by_kind.items()))
    report = {
        "scores": scores,
        "wordings": {**WORDINGS, "kept": kept},
        "pairs": {"reference": REFERENCE, **PAIRS},
        "config": {"model": args.model, "dtype": args.dtype, "machine": platform.machine()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
