"""The demo: start a radixrt server on the demo model (assets/world-llama unless
--model-path is given), run DSL programs against it (few-shot QA, a tree of
thought with fork, a batch RAG pipeline, a multi-turn chat), show what they
answered and how much the radix cache reused, and stop every process.

The demo model is a 3.5M-parameter Llama trained on CPU (scripts/train_demo_model.py)
on an invented world, the Vell Valley (scripts/world.py): its people, towns,
sums and number tables. Ask it about that world and it answers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
DEMO_MODEL = ROOT / "assets" / "world-llama"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=str(DEMO_MODEL), help="a Hugging Face checkpoint directory")
    args = parser.parse_args()

    import few_shot_qa
    import multi_turn_chat
    import rag_pipeline
    import tree_of_thought

    import radixrt as rt

    print(f"starting a radixrt server on {args.model_path} ...", flush=True)
    with rt.Runtime(model_path=args.model_path, page_size=16, max_total_tokens=32768) as runtime:
        print(f"server ready at {runtime.url}\n")
        print("== few-shot QA (one shared few-shot prefix)")
        qa = few_shot_qa.main(runtime.url)
        for q, a, cached, prompt in zip(qa["questions"], qa["answers"], qa["cached_tokens"], qa["prompt_tokens"]):
            print(f"Q: {q}\nA: {a}   [{cached}/{prompt} prompt tokens from the cache]")
        print("\n== tree of thought (fork: one branch per candidate)")
        tot = tree_of_thought.main(runtime.url)
        print(tot["question"])
        for name, thought, town, cached in zip(tot["candidates"], tot["thoughts"], tot["towns"],
                                               tot["branch_cached_tokens"]):
            print(f"  branch {name}: works as {thought}, lives in {town}   "
                  f"[{cached} of the {tot['prefix_tokens']}-token shared prefix from the cache]")
        print(f"conclusion: {tot['conclusion']}")
        print("\n== batch RAG (two retrieved documents per question, run_batch)")
        rag = rag_pipeline.main(runtime.url)
        for q, docs, a in zip(rag["question_texts"], rag["retrieved"], rag["answers"]):
            print(f"Q: {q}  [documents: {', '.join(docs)}]\nA: {a.strip()}")
        print(f"{rag['cached_tokens']} of {rag['prompt_tokens']} prompt tokens came from the cache")
        print("\n== multi-turn chat (each turn resends the conversation)")
        chat = multi_turn_chat.main(runtime.url)
        for i, (q, a) in enumerate(zip(multi_turn_chat.TURNS, chat["answers"])):
            print(f"user: {q}\nassistant: {a.strip()}   [{chat['cached_tokens'][i]}/{chat['prompt_tokens'][i]} "
                  "prompt tokens from the cache]")
        info = runtime.endpoint.get_server_info()
        print(f"\nradix cache: hit rate {info['cache_hit_rate']:.0%} of prompt tokens, "
              f"{info['cached_pages']} pages cached, {info['free_pages']} of {info['num_pages']} free")
    print("server stopped")


if __name__ == "__main__":
    main()
