"""A multi-turn chat: each turn sends the whole conversation, and the server reuses the earlier turns' KV.

    python examples/multi_turn_chat.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json

import radixrt as rt

# The demo model speaks ChatML; SGLang's frontend would pick "default" for its path, so name it.
CHAT_TEMPLATE = "chatml"

TURNS = [  # about the Vell Valley, the world the demo model was trained on
    "Where does Gustav Wick live?",
    "How many people live in Halden Bay?",
    "What pet does Gustav Wick have?",
]


@rt.function
def chat(s, turns: list[str]) -> None:
    s += rt.system("You answer questions about the Vell Valley.")
    for i, question in enumerate(turns):
        s += rt.user(question)
        s += rt.assistant(rt.gen(f"answer_{i}", max_tokens=12, temperature=0))


def main(url: str) -> dict:
    state = chat.run(turns=TURNS, backend=rt.RuntimeEndpoint(url, chat_template_name=CHAT_TEMPLATE))
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
