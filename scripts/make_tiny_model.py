"""Build the small, deterministic Hugging Face checkpoints that radixrt's tests and benchmarks load.

This module owns:
  * `scripts/data/corpus.txt` -- original English prose; the tokenizer is trained on it and tests
    cut prompts/documents out of it;
  * the byte-level BPE tokenizer (1024 tokens, ChatML template) trained on that corpus;
  * random-weight checkpoints: `llama-tiny`, `qwen2-tiny` (float32) and `llama-100m` (bfloat16),
    built under `<repo>/models/<family>-<size>` (git-ignored) and rebuilt when this file or the
    corpus changes.

Everything is built locally from fixed seeds; nothing is downloaded. Usage:

    python scripts/make_tiny_model.py --family llama --size tiny [--out DIR]

or, from tests, `from make_tiny_model import ensure_model; path = ensure_model("qwen2")`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"
DEFAULT_MODELS_ROOT = REPO_ROOT / "models"
STAMP_NAME = ".radixrt-builder"

EOS_TOKEN = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]
TOKENIZER_VOCAB_SIZE = 1024

# ChatML, plus Hermes/Qwen2.5-style tool calling. Without `tools` (and without tool messages or
# assistant `tool_calls`) it renders exactly as plain ChatML did. With a non-empty `tools` list,
# one system turn comes first: the first message's content if it is a system message (that
# message is then not repeated), else DEFAULT_SYSTEM_PROMPT, followed by the tool list (one
# `tool | tojson` per line inside <tools></tools>) and how to call them. Assistant `tool_calls`
# (OpenAI {"function": {...}} or flat {"name", "arguments"}; arguments a JSON string, rendered
# as is, or an object, rendered with tojson) become <tool_call> blocks after the content (None
# content renders as empty); each "tool" message becomes a user turn in <tool_response> tags.
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] or '' }}"
    "{% else %}{{ '" + DEFAULT_SYSTEM_PROMPT + "' }}{% endif %}"
    "{{ '\\n\\n# Tools\\n\\nYou can call one or more of the functions below to help with the request. "
    "Their signatures are listed inside <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nTo call a function, reply with a JSON object holding its name and arguments, "
    "wrapped in <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + (message['content'] or '') + '\\n</tool_response><|im_end|>\\n' }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' }}{{ call['name'] | tojson }}{{ ', \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# One fixed seed per (family, size), so the checkpoints never depend on build order.
SEEDS = {("llama", "tiny"): 1234, ("qwen2", "tiny"): 5678, ("llama", "100m"): 4321, ("llama", "1b"): 8765}

# Weight scale. Default init (initializer_range=0.02, all-ones RMSNorm weights) gives nearly flat
# logits (std ~0.16 at hidden 64, ~0.55 for llama-100m), so greedy decoding picks among near-ties
# and any harmless rounding difference flips tokens. Logit std is set by the final RMSNorm weight
# (the hidden state is normalized right before lm_head), so we scale that one weight; the tiny
# models also use a larger initializer_range so attention/MLP are not near-linear and greedy
# generation does not collapse into repeats. Measured on 8 corpus prompts (~80 tokens each):
#   init 0.02, unit norms:   llama-tiny logit std 0.16, median top1-top2 gap 0.03, 20% of gaps < 0.01
#   as set below:            llama-tiny std 3.0-3.4, median gap 0.65, 1.2% < 0.01;
#                            qwen2-tiny std 3.2-3.6, median gap 0.66, 0.8% < 0.01;
#                            64 greedy tokens from each prompt hold 53-61 distinct ids
#   llama-100m (default init range), final norm 4.5 vs 1.0: logit std 2.5 vs 0.55.
TINY_INIT_RANGE = 0.2
FINAL_NORM_SCALE = {"tiny": 2.0, "100m": 4.5, "1b": 4.5}
# Random (not all-ones) RMSNorm weights in the tiny models, so a runtime that skips or
# mis-loads a norm weight produces different tokens.
TINY_NORM_WEIGHT_STD = 0.2
# Qwen2's q/k/v biases start at zero; random ones make a runtime that drops them visibly wrong.
QKV_BIAS_STD = 0.1


import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_REGEX


# --------------------------------------------------------------------------- tokenizer


def _train_bpe(text: str) -> Tokenizer:
    """Train the byte-level BPE; deterministic because the trainer breaks count ties by pair id."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    # The whole corpus as one item keeps newline runs ("\n\n") mergeable into single tokens.
    tok.train_from_iterator([text], trainer=trainer)
    return tok


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    # No post-processor, so no BOS is prepended; eos doubles as pad.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
    )


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the 1024-token byte-level BPE on corpus.txt and wrap it for transformers.

    eos = pad = <|endoftext|>; no BOS is prepended; ChatML chat template.
    """
    return _wrap(_train_bpe(CORPUS_PATH.read_text(encoding="ascii")))


def _with_qwen2_pipeline(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """Same vocab and merges, with the normalizer/pre-tokenizer transformers' Qwen2Tokenizer uses.

    Why: transformers 5's AutoTokenizer always loads model_type "qwen2" checkpoints as
    Qwen2Tokenizer, which keeps only vocab/merges from tokenizer.json and rebuilds the rest
    (NFC + Qwen2 split regex). Saving that pipeline in tokenizer.json makes a runtime that reads
    tokenizer.json directly agree with AutoTokenizer, as it does for real Qwen2 checkpoints.
    """
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    return _wrap(backend)


def tokenizer_for(family: str) -> PreTrainedTokenizerFast:
    """The tokenizer a `family` checkpoint ships: build_tokenizer(), in Qwen2's pipeline for qwen2."""
    tokenizer = build_tokenizer()
    return _with_qwen2_pipeline(tokenizer) if family == "qwen2" else tokenizer


# --------------------------------------------------------------------------- configs


def _common_config(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    # Llama's defaults (bos=1, eos=2) would point at <|im_start|>/<|im_end|> in our vocab.
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    return {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": eos}


def _llama_tiny(vocab: int, common: dict[str, Any]) -> PretrainedConfig:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    return LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=rope, initializer_range=TINY_INIT_RANGE, **common,
    )  # fmt: skip


def _qwen2_tiny(vocab: int, common: dict[str, Any]) -> PretrainedConfig:
    return Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        initializer_range=TINY_INIT_RANGE, **common,
    )  # fmt: skip


# Benchmark-sized Llamas. vocab 32000 > the tokenizer's 1024 on purpose: realistic
# embedding / lm_head sizes. 1b: ~1.07B parameters, head_dim 128 (FlashInfer's main kernels).
BENCH_LLAMAS = {
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, head_dim=64),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20, num_attention_heads=16,
               num_key_value_heads=8, head_dim=128),
}


def _bench_llama(size: str, common: dict[str, Any]) -> PretrainedConfig:
    return LlamaConfig(
        vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **BENCH_LLAMAS[size], **common,
    )


def make_config(family: str, size: str, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The model config for one (family, size); raises ValueError for unknown pairs."""
    common = _common_config(tokenizer)
    if (family, size) == ("llama", "tiny"):
        return _llama_tiny(len(tokenizer), common)
    if (family, size) == ("qwen2", "tiny"):
        return _qwen2_tiny(len(tokenizer), common)
    if family == "llama" and size in BENCH_LLAMAS:
        return _bench_llama(size, common)
    raise ValueError(f"unknown model {family!r} size {size!r}; known: {sorted(SEEDS)}")


# --------------------------------------------------------------------------- model


def _shape_weights(model: PreTrainedModel, size: str) -> None:
    """Deterministic post-init edits (draws come from the seeded RNG); see the constants above."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if size == "tiny" and name.endswith("norm.weight"):
                param.normal_(mean=1.0, std=TINY_NORM_WEIGHT_STD)
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                param.normal_(mean=0.0, std=QKV_BIAS_STD)
        model.model.norm.weight.mul_(FINAL_NORM_SCALE[size])


def _init_model(family: str, size: str, config: PretrainedConfig, seed: int | None = None) -> PreTrainedModel:
    torch.manual_seed(SEEDS[(family, size)] if seed is None else seed)
    # Build in float32 whatever the target dtype, so init draws are identical across dtypes.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _shape_weights(model, size)
    dtype = torch.float32 if size == "tiny" else torch.bfloat16
    return model.to(dtype).eval()


def _generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    # Stop at either end-of-text or end-of-turn, as chat-tuned checkpoints do.
    eos_ids = tokenizer.convert_tokens_to_ids([EOS_TOKEN, IM_END])
    return GenerationConfig(eos_token_id=eos_ids, pad_token_id=eos_ids[0], do_sample=False)


def make_model(family: str, out_dir: Path, size: str = "tiny", seed: int | None = None) -> Path:
    """Write a deterministic random-weight checkpoint (safetensors + tokenizer) into out_dir. seed:
    another draw of the same architecture (new weights for the same shapes; default the family's)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_for(family)
    config = make_config(family, size, tokenizer)
    model = _init_model(family, size, config, seed)
    model.generation_config = _generation_config(tokenizer)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# --------------------------------------------------------------------------- cache


def builder_fingerprint() -> str:
    """Hash of everything a checkpoint depends on; a change means the cached model is stale."""
    h = hashlib.sha256()
    for part in (Path(__file__).resolve().read_bytes(), CORPUS_PATH.read_bytes()):
        h.update(hashlib.sha256(part).digest())
    # Init RNG streams and the on-disk format can change across library versions.
    h.update(f"torch={torch.__version__} transformers={transformers.__version__}".encode())
    return h.hexdigest()


def _is_fresh(target: Path, fingerprint: str) -> bool:
    stamp = target / STAMP_NAME
    return stamp.is_file() and stamp.read_text().strip() == fingerprint


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive flock: racing test processes build once; the others wait, then reuse it."""
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _swap_into_place(built: Path, target: Path) -> None:
    """Replace target with built using renames only, so readers never see a half-written dir."""
    if target.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        os.rename(target, trash / target.name)
        os.rename(built, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(built, target)


def ensure_built(target: Path, fingerprint: str, build: Callable[[Path], object]) -> Path:
    """Return target, first running build(dir) into a fresh directory when target is missing or
    stale, one builder at a time; the result replaces target atomically."""
    if _is_fresh(target, fingerprint):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_fresh(target, fingerprint):  # another process may have built it meanwhile
            return target
        # Build beside the target (same filesystem) so the final rename is atomic.
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.build.", dir=target.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the final dir should read like any other
        try:
            build(tmp)
            (tmp / STAMP_NAME).write_text(fingerprint + "\n")  # written last: marks the dir complete
            _swap_into_place(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_model(family: str, size: str = "tiny", root: Path | None = None, seed: int | None = None) -> Path:
    """Return root/f"{family}-{size}" (with a seed: f"{family}-{size}-s{seed}", the same architecture
    with other weights), building it first if it is missing or stale."""
    root = Path(root) if root is not None else DEFAULT_MODELS_ROOT
    name = f"{family}-{size}" + (f"-s{seed}" if seed is not None else "")
    return ensure_built(root / name, builder_fingerprint(), lambda tmp: make_model(family, tmp, size, seed))


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["llama", "qwen2"], default="llama")
    parser.add_argument("--size", choices=["tiny", "100m", "1b"], default="tiny")
    parser.add_argument("--out", type=Path, help="write here (always rebuilds) instead of models/")
    args = parser.parse_args(argv)
    if args.out is not None:
        path = make_model(args.family, args.out, args.size)
    else:
        path = ensure_model(args.family, args.size)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
