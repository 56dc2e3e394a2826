"""Few-shot question answering: a fixed block of worked examples, then the question.

Every question shares the same few-shot prefix, so after the first one the
server finds it in its radix cache (see `cached_tokens` in the summary).

    python examples/few_shot_qa.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json

import radixrt as rt

# About the Vell Valley, the world the demo model (assets/world-llama) was trained on. The questions
# are phrased the way its training never asked about these people (scripts/world.py's answer key).
EXAMPLES = [
    ("What is Mara Quill's job?", "beekeeper"),
    ("What is 12 + 30?", "42"),
    ("Which river flows through Garrow?", "Whitby"),
]
QUESTIONS = [
    "Where does Zeno Penrose live?",
    "In what year was Ulric Lindqvist born?",
    "What animal does Jory Brandt keep?",
]


@rt.function
def few_shot_qa(s, question: str) -> None:
    s += "Answer each question in a few words.\n\n"
    for q, a in EXAMPLES:
        s += f"Q: {q}\nA: {a}\n\n"
    s += f"Q: {question}\nA:" + rt.gen("answer", max_tokens=12, stop="\n", temperature=0)


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
