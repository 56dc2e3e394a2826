"""Write examples/data/sample_trace.jsonl: a deterministic request trace shaped like a radix
cache's real traffic, for `radixrt tune --trace`.

60 requests over about 4 seconds, in four kinds:
  * 14 help-desk questions after one long system prompt (instructions + reference passages),
    8 of them in a burst (a team opening the app at once) early on;
  * 14 few-shot questions after the same three worked examples, 5 of them in a later burst;
  * 4 multi-turn conversations of 4 turns, each turn resending the whole history so far;
  * 16 unique prompts (a passage and a question) that share nothing but their last line.
The bursts are what a memory cap retracts requests in. The text is cut from
scripts/data/corpus.txt (the tiny models' tokenizer was trained on it).

    python scripts/make_sample_trace.py [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "scripts" / "data" / "corpus.txt"
OUT = ROOT / "examples" / "data" / "sample_trace.jsonl"
SEED = 7
SPAN_S = 4.0  # arrivals fall in [0, SPAN_S)
TURN_GAP_S = 0.9  # a conversation's next turn comes this long after the previous one
BURST_S = 0.05  # a burst's requests arrive within this
HELP_BURST, SHOTS_BURST = (0.3, 8), (2.0, 5)  # (when, how many) of each group's burst
QUESTIONS = ("What should I do first?", "How long does it take?", "Is there a simpler way?",
             "What goes wrong most often?", "Can you give me one example?", "Why does that work?",
             "What would you change?", "How do I know when it is ready?")


def paragraphs() -> list[str]:
    return [p.strip() for p in CORPUS.read_text().split("\n\n") if len(p.strip()) > 120]


def make_trace(seed: int = SEED) -> list[dict]:
    """The trace's requests, ordered by arrival (arrival in seconds, 3 decimals)."""
    rng = random.Random(seed)
    paras = paragraphs()
    rng.shuffle(paras)
    system = ("You are the help desk of a small cooking school. Answer briefly, kindly and from the notes.\n\n"
              "Notes:\n" + "\n\n".join(paras[0:3]) + "\n\n")
    shots = "".join(f"Passage: {p}\nQuestion: {rng.choice(QUESTIONS)}\nAnswer: {p.split('. ')[-1]}\n\n"
                    for p in paras[3:6])
    reqs = [_req(rng, system + f"User: {rng.choice(QUESTIONS)} (ticket {i})\nAssistant:", 16, 64,
                 _burst(rng, i, HELP_BURST)) for i in range(14)]
    reqs += [_req(rng, shots + f"Passage: {paras[7 + i]}\nQuestion: {rng.choice(QUESTIONS)}\nAnswer:", 8, 32,
                  _burst(rng, i, SHOTS_BURST)) for i in range(14)]
    reqs += [r for c in range(4) for r in _conversation(rng, paras[21 + 4 * c: 25 + 4 * c])]
    reqs += [_req(rng, f"{paras[37 + i]}\n\nIn one sentence, what is this passage about?", 16, 48) for i in range(16)]
    return sorted(reqs, key=lambda r: r["arrival"])


def _req(rng: random.Random, prompt: str, lo: int, hi: int, arrival: float | None = None) -> dict:
    at = rng.uniform(0, SPAN_S) if arrival is None else arrival
    return {"arrival": round(at, 3), "prompt": prompt, "output_len": rng.randint(lo, hi)}


def _burst(rng: random.Random, i: int, burst: tuple[float, int]) -> float | None:
    """The arrival of a group's i-th request: in the group's burst for the first ones, else None (any time)."""
    at, size = burst
    return at + rng.uniform(0, BURST_S) if i < size else None


def _conversation(rng: random.Random, replies: list[str]) -> list[dict]:
    """4 turns; turn k's prompt is the system line, the k earlier exchanges and a new question."""
    start = rng.uniform(0, SPAN_S - 3 * TURN_GAP_S)
    history = "System: You are a friendly companion for people learning to cook.\n"
    turns = []
    for k, reply in enumerate(replies):
        history += f"User: {rng.choice(QUESTIONS)}\nAssistant:"
        turns.append(_req(rng, history, 24, 48, arrival=start + k * TURN_GAP_S))
        history += f" {reply}\n"
    return turns


def to_jsonl(reqs: list[dict]) -> str:
    """The trace file's text: one JSON object a line."""
    return "".join(json.dumps(r) + "\n" for r in reqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    out = ap.parse_args().out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_jsonl(make_trace()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
