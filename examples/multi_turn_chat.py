"""A multi-turn chat: each turn sends the whole conversation, and the server reuses the earlier turns' KV.

    python examples/multi_turn_chat.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json

import radixrt as rt

TURNS = [
    "I want to start baking bread at home. Where do I begin?",
    "How do I get a crisp crust?",
    "And how should I look after a sourdough starter?",
]


@rt.function
def chat(s, turns: list[str]) -> None:
    s += rt.system("You are a friendly baking teacher. Keep answers short.")
    for i, question in enumerate(turns):
        s += rt.user(question)
        s += rt.assistant(rt.gen(f"answer_{i}", max_tokens=32, temperature=0))


def main(url: str) -> dict:
    state = chat.run(turns=TURNS, backend=rt.RuntimeEndpoint(url))
    metas = [state.get_meta_info(f"answer_{i}") for i in range(len(TURNS))]
    return {
        "turns": len(TURNS),
        "messages": state.messages(),
        "answers": [state[f"answer_{i}"] for i in range(len(TURNS))],
        "prompt_tokens": [m["prompt_tokens"] for m in metas],
        "cached_tokens": [m["cached_tokens"] for m in metas],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    print(json.dumps(main(parser.parse_args().url), indent=2))
