"""The demo: start a radixrt server on a model (the built-in tiny Llama unless
--model-path is given), run DSL programs against it (few-shot QA, a
tree-of-thought with fork, a batch RAG pipeline), show how much the radix
cache reused, and stop every process.

The tiny model has random weights, so its text is noise; the point is the
machinery: the programs' shared prefixes are computed once and then hit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "examples"))

from make_tiny_model import ensure_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="a Hugging Face checkpoint directory")
    args = parser.parse_args()
    model_path = args.model_path or str(ensure_model("llama"))

    import few_shot_qa
    import rag_pipeline
    import tree_of_thought

    import radixrt as rt

    print(f"starting a radixrt server on {model_path} ...", flush=True)
    with rt.Runtime(model_path=model_path, page_size=16, max_total_tokens=32768) as runtime:
        print(f"server ready at {runtime.url}\n")
        qa = few_shot_qa.main(runtime.url)
        for q, a, cached, prompt in zip(qa["questions"], qa["answers"], qa["cached_tokens"], qa["prompt_tokens"]):
            print(f"Q: {q}\nA: {a!r}   [{cached}/{prompt} prompt tokens from the cache]")
        tot = tree_of_thought.main(runtime.url)
        print(f"\ntree of thought: {tot['branches']} branches, verdicts {tot['verdicts']}, "
              f"each branch reused {tot['branch_cached_tokens']} of the {tot['prefix_tokens']}-token shared prefix")
        rag = rag_pipeline.main(runtime.url)
        print(f"\nbatch RAG: {rag['questions']} questions over {rag['documents']} documents; "
              f"{rag['cached_tokens']} of {rag['prompt_tokens']} prompt tokens came from the cache")
        info = runtime.endpoint.get_server_info()
        print(f"\nradix cache: hit rate {info['cache_hit_rate']:.0%} of prompt tokens, "
              f"{info['cached_pages']} pages cached, {info['free_pages']} of {info['num_pages']} free")
    print("server stopped")


if __name__ == "__main__":
    main()
