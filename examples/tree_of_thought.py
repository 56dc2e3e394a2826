"""Tree of thought with fork: several approaches explored in parallel branches, each judged, then a conclusion.

`s.fork(n)` first sends the shared conversation once as a prefill-only request,
so the n branches find it cached and only compute their own continuations.

    python examples/tree_of_thought.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json

import radixrt as rt


@rt.function
def tree_of_thought(s, question: str, branches: int = 3) -> None:
    s += rt.system("You reason carefully and try more than one approach.")
    s += rt.user(question)
    with s.assistant():
        s += "Let me try several approaches.\n"
        forks = s.fork(branches)
        forks += lambda i: f"Approach {i + 1}: "
        forks += rt.gen("thought", max_tokens=32, stop="\n", temperature=0.8)
        forks += "\nIs this approach sound? " + rt.select("verdict", ["yes", "no"])
        forks.join()  # s["thought"], s["verdict"]: one entry per branch
        s["prefix_tokens"] = forks.prefix_meta["prompt_tokens"] if forks.prefix_meta else 0
        for i, (thought, verdict) in enumerate(zip(s["thought"], s["verdict"])):
            s += f"Approach {i + 1} ({verdict}): {thought.strip()}\n"
        s += "Conclusion:" + rt.gen("conclusion", max_tokens=32, stop="\n", temperature=0)


def main(url: str) -> dict:
    state = tree_of_thought.run(question="How can a small town reduce food waste?", backend=rt.RuntimeEndpoint(url))
    return {
        "branches": len(state["thought"]),
        "thoughts": state["thought"],
        "verdicts": state["verdict"],
        "branch_cached_tokens": [m["cached_tokens"] for m in state.get_meta_info("thought")],
        "prefix_tokens": state["prefix_tokens"],
        "conclusion": state["conclusion"],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    print(json.dumps(main(parser.parse_args().url), indent=2))
