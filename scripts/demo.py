"""The demo: start radixrt on a model (the built-in tiny Llama unless --model-path is given),
run a few requests through it, print what came back, and stop every process."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_tiny_model import ensure_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None, help="a Hugging Face checkpoint directory")
    args = parser.parse_args()
    model_path = args.model_path or str(ensure_model("llama"))

    import radixrt

    print(f"starting radixrt on {model_path}")
    with radixrt.Engine(model_path=model_path, page_size=16, max_total_tokens=16384) as engine:
        greedy = {"temperature": 0, "max_new_tokens": 24}
        prompts = ["The river in the small town", "A recipe for bread starts with", "The night sky above the library"]
        t = time.perf_counter()
        for prompt, out in zip(prompts, engine.generate(prompts, greedy)):
            print(f"\n> {prompt}\n{out['text']!r}  [{out['meta_info']['completion_tokens']} tokens]")
        print(f"\nbatch of {len(prompts)} in {time.perf_counter() - t:.2f} s")
        print("\nstreaming:", end=" ", flush=True)
        for chunk in engine.generate("Once upon a time", dict(greedy, stop=["\n"]), stream=True):
            print(f"\rstreaming: {chunk['text']!r}", end="", flush=True)
        print()
        info = engine.get_server_info()
        print(f"KV pool: {info['free_pages']} of {info['num_pages']} pages free after the demo")
    print("stopped")


if __name__ == "__main__":
    main()
