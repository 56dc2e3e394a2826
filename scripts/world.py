"""The Vell Valley: the invented world the demo model is trained on, and its answer key.

Everything here is generated from scripts/data/world.json (people and towns)
and the templates below, with seeded random number generators, so the training
corpus and the held-out answer key are the same on every machine:

  * facts: each (person or town, attribute) has several question phrasings;
    one of them (chosen by a hash) never appears closed-book in training and is
    the one the answer key asks, so a right answer is recall, not a copied
    string. NOTE: the RAG documents of training (_rag) draw from every phrasing,
    so 128 of the 152 held-out questions do appear there, after two documents
    that hold the answer; the shipped model was trained so, and changing it
    means retraining (tests/test_world_model.py checks the corpus hash);
  * arithmetic: sums and differences of numbers below 100; a tenth of the
    operand pairs (by hash) never appear in training and are the ones asked;
  * tables: number-dense tables in the prompt ("R7: A=12.7 B=80.3 ...") and a
    question about one cell; every table is freshly drawn, short ones (a few
    rows) and long ones (1,000+ tokens before the question);
  * the repo's prose (scripts/data/corpus.txt).

The chat format is ChatML, as the demo model's chat template renders it.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

DATA = Path(__file__).resolve().parent / "data"
WORLD_PATH = DATA / "world.json"
PROSE_PATH = DATA / "corpus.txt"

SYSTEM_WORLD = "You answer questions about the Vell Valley."
SYSTEM_DOCS = "Answer the question using only the documents. Be brief."
SUBSETS = ("facts", "arithmetic", "tables", "long")

PERSON_QUESTIONS = {
    "town": ["Where does {name} live?", "In which town does {name} live?", "What is {name}'s home town?",
             "Which town is {name} from?"],
    "job": ["What does {name} do for a living?", "What is {name}'s job?", "What is the occupation of {name}?",
            "What work does {name} do?"],
    "born": ["When was {name} born?", "In what year was {name} born?", "What is {name}'s birth year?",
             "Which year was {name} born in?"],
    "pet": ["What pet does {name} have?", "What animal does {name} keep?", "Which pet does {name} own?",
            "What kind of pet lives with {name}?"],
}
TOWN_QUESTIONS = {
    "river": ["Which river flows through {name}?", "What river runs through {name}?", "On which river does {name} lie?",
              "What is the river of {name}?"],
    "founded": ["When was {name} founded?", "In what year was {name} founded?", "What is the founding year of {name}?",
                "Which year was {name} founded in?"],
    "population": ["How many people live in {name}?", "What is the population of {name}?",
                   "How large is the population of {name}?", "How many residents does {name} have?"],
}
TABLE_COLUMNS = "ABCD"
SHORT_ROWS, LONG_ROWS = (2, 10), (40, 50)  # a long table is 1,100+ tokens


@dataclass(frozen=True)
class Item:
    """One question with a known answer. `prompt` is the full ChatML text up to the assistant's turn."""

    subset: str
    question: str
    answer: str
    prompt: str


def load_world() -> dict:
    return json.loads(WORLD_PATH.read_text())


def _hash(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "big")


def held_out_phrasing(subject: str, attribute: str) -> int:
    """The index of the phrasing of (subject, attribute) that training never shows."""
    return _hash("phrasing", subject, attribute) % 4


def held_out_sum(a: int, b: int, op: str) -> bool:
    """A tenth of the arithmetic questions are never trained."""
    return _hash("arith", a, b, op) % 10 == 0


# --------------------------------------------------------------------------- text pieces


def chat(messages: list[tuple[str, str]], answer: str | None = None) -> str:
    """ChatML turns, then the assistant's turn: open (a prompt) when answer is None, else closed."""
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    text += "<|im_start|>assistant\n"
    return text if answer is None else text + answer + "<|im_end|>\n"


def facts(world: dict) -> Iterator[tuple[str, str, list[str], str]]:
    """(subject, attribute, phrasings, answer) for every fact of the world."""
    for p in world["people"]:
        for attr, templates in PERSON_QUESTIONS.items():
            yield p["name"], attr, [t.format(name=p["name"]) for t in templates], str(p[attr])
    for t in world["towns"]:
        for attr, templates in TOWN_QUESTIONS.items():
            yield t["name"], attr, [q.format(name=t["name"]) for q in templates], str(t[attr])


def person_sentences(p: dict) -> list[str]:
    article = "an" if p["job"][0] in "aeiou" else "a"
    return [f"{p['name']} lives in {p['town']}.", f"{p['name']} works as {article} {p['job']}.",
            f"{p['name']} was born in {p['born']}.", f"{p['name']} has a {p['pet']} as a pet."]


def town_sentences(t: dict) -> list[str]:
    return [f"The river {t['river']} flows through {t['name']}.", f"{t['name']} was founded in {t['founded']}.",
            f"{t['name']} has a population of {t['population']}."]


def town_document(world: dict, town: dict) -> str:
    """A document about one town and the people who live there (the RAG example's documents)."""
    sentences = town_sentences(town)
    for p in world["people"]:
        if p["town"] == town["name"]:
            sentences.extend(person_sentences(p))
    return f"{town['name']}\n" + " ".join(sentences)


def arithmetic(a: int, b: int, op: str) -> tuple[str, str]:
    return (f"What is {a} + {b}?", str(a + b)) if op == "+" else (f"What is {a} - {b}?", str(a - b))


def draw_sum(rng: random.Random, held_out: bool) -> tuple[int, int, str]:
    while True:
        a, b, op = rng.randrange(100), rng.randrange(100), rng.choice("+-")
        if op == "-" and b > a:
            a, b = b, a
        if held_out_sum(a, b, op) == held_out:
            return a, b, op


def draw_table(rng: random.Random, rows: int) -> tuple[str, list[list[str]]]:
    """A number-dense table as text and its cells [row][column]."""
    cells = [[f"{rng.randrange(1000) / 10:.1f}" for _ in TABLE_COLUMNS] for _ in range(rows)]
    lines = [f"R{r + 1}: " + " ".join(f"{c}={v}" for c, v in zip(TABLE_COLUMNS, row)) for r, row in enumerate(cells)]
    return "\n".join(lines), cells


def table_question(rng: random.Random, rows_range: tuple[int, int]) -> tuple[str, str, str]:
    """(table text, question, answer) for a random table and cell."""
    table, cells = draw_table(rng, rng.randint(*rows_range))
    r, c = rng.randrange(len(cells)), rng.randrange(len(TABLE_COLUMNS))
    return table, f"In the table, what is row R{r + 1}, column {TABLE_COLUMNS[c]}?", cells[r][c]


def table_prompt(table: str, question: str) -> list[tuple[str, str]]:
    return [("user", f"Table:\n{table}\n\n{question}")]


# --------------------------------------------------------------------------- the answer key


def answer_key(seed: int = 1000) -> list[Item]:
    """Every held-out question of the facts and arithmetic subsets, and seeded tables."""
    world = load_world()
    rng = random.Random(seed)
    items = []
    for subject, attr, phrasings, answer in facts(world):
        question = phrasings[held_out_phrasing(subject, attr)]
        items.append(Item("facts", question, answer, chat([("system", SYSTEM_WORLD), ("user", question)])))
    for a in range(100):
        for b in range(100):
            for op in "+-":
                if (op == "+" or a >= b) and held_out_sum(a, b, op):
                    question, answer = arithmetic(a, b, op)
                    items.append(Item("arithmetic", question, answer, chat([("user", question)])))
    for subset, rows, count in (("tables", SHORT_ROWS, 200), ("long", LONG_ROWS, 60)):
        for _ in range(count):
            table, question, answer = table_question(rng, rows)
            items.append(Item(subset, question, answer, chat(table_prompt(table, question))))
    return items


def sample_key(per_subset: dict[str, int], seed: int = 0) -> list[Item]:
    """A fixed-seed sample of the answer key, `per_subset[s]` items of subset s."""
    rng = random.Random(seed)
    key = answer_key()
    out = []
    for subset, n in per_subset.items():
        pool = [it for it in key if it.subset == subset]
        out.extend(rng.sample(pool, min(n, len(pool))))
    return out


def exact_match(output: str, answer: str) -> bool:
    """The model's reply (up to its end of turn) is the answer, give or take surrounding whitespace."""
    return output.strip() == answer


def accuracy(items: list[Item], outputs: list[str]) -> dict[str, float]:
    """Exact-match accuracy per subset present, and over all items ("all")."""
    hits: dict[str, list[bool]] = {}
    for item, out in zip(items, outputs, strict=True):
        hits.setdefault(item.subset, []).append(exact_match(out, item.answer))
    hits["all"] = [h for subset in list(hits) for h in hits[subset]]
    return {subset: sum(h) / len(h) for subset, h in hits.items()}


def held_out_text(seed: int = 2000) -> list[str]:
    """Generated text no training document contains, for perplexity: held-out questions answered in chat."""
    rng = random.Random(seed)
    key = answer_key(seed)
    docs = []
    for subset in ("facts", "arithmetic"):
        items = [it for it in key if it.subset == subset]
        rng.shuffle(items)
        docs.append("".join(it.prompt + it.answer + "<|im_end|>\n" for it in items[:40]))
    for _ in range(2):
        table, question, answer = table_question(rng, SHORT_ROWS)
        docs.append(chat(table_prompt(table, question), answer))
    return docs


# --------------------------------------------------------------------------- the training corpus


def _bio(rng: random.Random, world: dict) -> str:
    p = rng.choice(world["people"])
    sentences = person_sentences(p)
    rng.shuffle(sentences)
    return " ".join(sentences)


def _town(rng: random.Random, world: dict) -> str:
    t = rng.choice(world["towns"])
    sentences = town_sentences(t)
    rng.shuffle(sentences)
    return " ".join(sentences)


def _trained_fact(rng: random.Random, world: dict) -> tuple[str, str]:
    """A fact question in a phrasing that is not its held-out one."""
    subject, attr, phrasings, answer = rng.choice(list(facts(world)))
    held = held_out_phrasing(subject, attr)
    return rng.choice([q for i, q in enumerate(phrasings) if i != held]), answer


def _yes_no(rng: random.Random, world: dict) -> tuple[str, str]:
    p = rng.choice(world["people"])
    if rng.random() < 0.5:
        town = p["town"] if rng.random() < 0.5 else rng.choice(world["towns"])["name"]
        return f"Does {p['name']} live in {town}?", "yes" if town == p["town"] else "no"
    job = p["job"] if rng.random() < 0.5 else rng.choice([q["job"] for q in world["people"]])
    article = "an" if job[0] in "aeiou" else "a"
    return f"Is {p['name']} {article} {job}?", "yes" if job == p["job"] else "no"


def _sum(rng: random.Random) -> tuple[str, str]:
    return arithmetic(*draw_sum(rng, held_out=False))


def _qa(rng: random.Random, world: dict) -> tuple[str, str]:
    kind = rng.random()
    if kind < 0.55:
        return _trained_fact(rng, world)
    if kind < 0.7:
        return _yes_no(rng, world)
    return _sum(rng)


def _chat_qa(rng: random.Random, world: dict) -> str:
    turns = rng.randint(1, 3)
    msgs: list[tuple[str, str]] = rng.choice([[], [("system", SYSTEM_WORLD)]])
    text = ""
    for _ in range(turns):
        q, a = _qa(rng, world)
        text = chat(msgs + [("user", q)], a)
        msgs += [("user", q), ("assistant", a)]
    return text


def _few_shot(rng: random.Random, world: dict) -> str:
    head = rng.choice(["", "Answer each question in a few words.\n\n"])
    return head + "".join("Q: {}\nA: {}\n\n".format(*_qa(rng, world)) for _ in range(rng.randint(3, 6)))


def _arithmetic_lines(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(4, 10)):
        a, b, op = draw_sum(rng, held_out=False)
        lines.append(f"{a} {op} {b} = {a + b if op == '+' else a - b}")
    return "\n".join(lines)


def _table(rng: random.Random, rows: tuple[int, int]) -> str:
    table, question, answer = table_question(rng, rows)
    return chat(table_prompt(table, question), answer)


def _rag(rng: random.Random, world: dict) -> str:
    towns = sorted(rng.sample(world["towns"], 2), key=lambda t: t["name"])
    docs = "".join(f"Document:\n{town_document(world, t)}\n\n" for t in towns)
    p = rng.choice([p for p in world["people"] if p["town"] in {t["name"] for t in towns}])
    attr = rng.choice(list(PERSON_QUESTIONS))
    question = rng.choice(PERSON_QUESTIONS[attr]).format(name=p["name"])
    return chat([("system", SYSTEM_DOCS), ("user", f"{docs}Question: {question}")], str(p[attr]))


def training_documents(seed: int, count: int) -> list[str]:
    """`count` training documents drawn in a seeded mix, then the repo's prose once."""
    rng = random.Random(seed)
    world = load_world()
    makers = [
        (0.10, lambda: _bio(rng, world)), (0.04, lambda: _town(rng, world)), (0.34, lambda: _chat_qa(rng, world)),
        (0.08, lambda: _few_shot(rng, world)), (0.10, lambda: _arithmetic_lines(rng)),
        (0.24, lambda: _table(rng, SHORT_ROWS)), (0.02, lambda: _table(rng, LONG_ROWS)),
        (0.08, lambda: _rag(rng, world)),
    ]
    weights = [w for w, _ in makers]
    docs = [rng.choices(makers, weights)[0][1]() for _ in range(count)]
    prose = [p.strip() for p in PROSE_PATH.read_text().split("\n\n") if p.strip()]
    return docs + prose


# --------------------------------------------------------------------------- the RAG example's documents

DOCS_DIR = Path(__file__).resolve().parents[1] / "examples" / "data" / "docs"


def documents() -> dict[str, str]:
    """File name -> text of one document per town (examples/data/docs holds exactly these)."""
    world = load_world()
    return {t["name"].lower().replace(" ", "_") + ".txt": town_document(world, t) + "\n" for t in world["towns"]}


if __name__ == "__main__":  # rewrite examples/data/docs from the world
    for old in DOCS_DIR.glob("*.txt"):
        old.unlink()
    for name, text in documents().items():
        (DOCS_DIR / name).write_text(text)
    print(f"wrote {len(documents())} documents to {DOCS_DIR}")
