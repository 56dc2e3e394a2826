"""Batch retrieval-augmented QA over examples/data/docs: one document per town of the Vell Valley.

The documents (written by scripts/world.py) are about the world the demo model
was trained on, so its greedy answers can be checked against them.

Retrieval is plain word overlap. The chosen documents go into the prompt in
sorted (file name) order, so questions that retrieve the same documents send the
same prefix and the server computes it once; all questions run with run_batch.

    python examples/rag_pipeline.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import radixrt as rt

# The demo model speaks ChatML; SGLang's frontend would pick "default" for its path, so name it.
CHAT_TEMPLATE = "chatml"

DOCS_DIR = Path(__file__).resolve().parent / "data" / "docs"
STOPWORDS = set("a an and are as at be by do does for from how i in is it its of on or should the to what when "
                "where which who why with you your".split())
QUESTIONS = [
    "What is Tobin Reed's job?",
    "When was Rosa Ingram born?",
    "What pet does Gustav Wick have?",
    "Where does Sten Jessup live?",
    "What does Vesna Moss do for a living?",
    "In which town does Thea Kettle live?",
    "What animal does Hesper Orme keep?",
    "In what year was Mara Quill born?",
]


def words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if w not in STOPWORDS}


def load_docs(folder: Path = DOCS_DIR) -> dict[str, str]:
    return {p.stem: p.read_text().strip() for p in sorted(folder.glob("*.txt"))}


def retrieve(question: str, docs: dict[str, str], k: int = 2) -> list[str]:
    """The k documents sharing the most words with the question, returned in sorted name order."""
    q = words(question)
    ranked = sorted(docs, key=lambda name: (-len(q & words(docs[name])), name))
    return sorted(ranked[:k])


@rt.function
def answer(s, question: str, documents: list[str]) -> None:
    s += rt.system("Answer the question using only the documents. Be brief.")
    with s.user():
        for doc in documents:
            s += f"Document:\n{doc}\n\n"
        s += f"Question: {question}"
    s += rt.assistant(rt.gen("answer", max_tokens=12, temperature=0))


def main(url: str) -> dict:
    docs = load_docs()
    chosen = [retrieve(q, docs) for q in QUESTIONS]
    batch = [{"question": q, "documents": [docs[name] for name in names]} for q, names in zip(QUESTIONS, chosen)]
    states = answer.run_batch(batch, backend=rt.RuntimeEndpoint(url, chat_template_name=CHAT_TEMPLATE))
    metas = [s.get_meta_info("answer") for s in states]
    return {
        "documents": len(docs),
        "questions": len(QUESTIONS),
        "question_texts": QUESTIONS,
        "retrieved": chosen,
        "answers": [s["answer"] for s in states],
        "prompt_tokens": sum(m["prompt_tokens"] for m in metas),
        "cached_tokens": sum(m["cached_tokens"] for m in metas),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    print(json.dumps(main(parser.parse_args().url), indent=2))
