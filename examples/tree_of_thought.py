"""Tree of thought with fork: one branch per candidate, each checked, then a conclusion.

The question ("Which of these people lives in Pellmarsh?") is about the Vell
Valley, the world the demo model was trained on. `s.fork(n)` first sends the
shared conversation once as a prefill-only request, so the n branches find it
cached and only compute their own turns: each branch asks what its candidate
does (a free answer) and where they live (a select over the valley's towns);
the conclusion names the candidates whose town is the one asked about. (The
town is a select, not a yes/no question: the demo model answers yes/no
questions poorly, leaning to "no", and picks among named towns well.)

    python examples/tree_of_thought.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json

import radixrt as rt

# The demo model speaks ChatML; SGLang's frontend would pick "default" for its path, so name it.
CHAT_TEMPLATE = "chatml"

SYSTEM = "You answer questions about the Vell Valley."
TOWN = "Pellmarsh"
CANDIDATES = ["Mara Quill", "Tobin Reed", "Cleo Thorne"]
TOWNS = ["Corvane", "Dunhallow", "Estmoor", "Fenwick Cross", "Garrow", "Halden Bay", "Ostrel", "Pellmarsh"]


def conclusion(town: str, candidates: list[str], towns: list[str]) -> str:
    """The sentence naming the candidates whose branch selected `town`."""
    found = [c for c, lives_in in zip(candidates, towns) if lives_in == town]
    return f"{' and '.join(found) or 'None of them'} {'lives' if len(found) < 2 else 'live'} in {town}."


@rt.function
def tree_of_thought(s, town: str, candidates: list[str]) -> None:
    s += rt.system(SYSTEM)
    forks = s.fork(len(candidates))
    forks += lambda i: rt.user(f"What does {candidates[i]} do for a living?")
    forks += rt.assistant(rt.gen("thought", max_tokens=8, temperature=0))
    forks += lambda i: rt.user(f"Where does {candidates[i]} live?")
    forks += rt.assistant(rt.select("town", TOWNS))
    forks.join()  # s["thought"], s["town"]: one entry per branch
    s["prefix_tokens"] = forks.prefix_meta["prompt_tokens"] if forks.prefix_meta else 0
    s["conclusion"] = conclusion(town, candidates, s["town"])


def main(url: str) -> dict:
    backend = rt.RuntimeEndpoint(url, chat_template_name=CHAT_TEMPLATE)
    state = tree_of_thought.run(town=TOWN, candidates=CANDIDATES, backend=backend)
    return {
        "question": f"Which of {', '.join(CANDIDATES)} lives in {TOWN}?",
        "branches": len(state["thought"]),
        "candidates": CANDIDATES,
        "thoughts": [t.strip() for t in state["thought"]],
        "towns": state["town"],
        "branch_cached_tokens": [m["cached_tokens"] for m in state.get_meta_info("thought")],
        "prefix_tokens": state["prefix_tokens"],
        "conclusion": state["conclusion"],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    print(json.dumps(main(parser.parse_args().url), indent=2))
