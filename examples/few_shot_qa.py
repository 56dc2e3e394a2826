"""Few-shot question answering: a fixed block of worked examples, then the question.

Every question shares the same few-shot prefix, so after the first one the
server finds it in its radix cache (see `cached_tokens` in the summary).

    python examples/few_shot_qa.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json

import radixrt as rt

EXAMPLES = [
    ("What do bees use to tell each other where flowers are?", "A waggle dance."),
    ("What keeps a cable ferry from drifting downstream?", "A cable across the river."),
    ("What makes bread crust crisp?", "Steam early in baking."),
]
QUESTIONS = [
    "What should you oil on a bicycle chain?",
    "How long does compost take?",
    "Why do stargazers use red lights?",
]


@rt.function
def few_shot_qa(s, question: str) -> None:
    s += "Answer each question in a few words.\n\n"
    for q, a in EXAMPLES:
        s += f"Q: {q}\nA: {a}\n\n"
    s += f"Q: {question}\nA:" + rt.gen("answer", max_tokens=24, stop="\n", temperature=0)


def main(url: str) -> dict:
    backend = rt.RuntimeEndpoint(url)
    states = few_shot_qa.run_batch([{"question": q} for q in QUESTIONS], backend=backend)
    metas = [s.get_meta_info("answer") for s in states]
    return {
        "questions": QUESTIONS,
        "answers": [s["answer"].strip() for s in states],
        "prompt_tokens": [m["prompt_tokens"] for m in metas],
        "cached_tokens": [m["cached_tokens"] for m in metas],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    print(json.dumps(main(parser.parse_args().url), indent=2))
