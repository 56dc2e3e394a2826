"""Train the demo model: a small Llama that knows the Vell Valley (scripts/world.py).

Writes a Hugging Face checkpoint to assets/world-llama/ (committed to the repo;
tests and CI never retrain, they load it and check its checksums):

  * a byte-level BPE tokenizer with single-digit tokens, trained on the corpus,
    with the ChatML chat template;
  * the model (Llama, GQA 4:1, tied embeddings, float32 weights);
  * training.json: the corpus hash, the hyperparameters, the loss curve, the
    time it took, torch's version; loss.png; SHA256SUMS of the checkpoint files.

Deterministic for a given seed, torch version and thread count (--threads, 2 by
default, is recorded). On 2 CPU cores it takes about 25 minutes:

    .venv/bin/python scripts/train_demo_model.py [--out assets/world-llama] [--steps N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import world  # noqa: E402
from make_tiny_model import EOS_TOKEN as EOS  # noqa: E402
from make_tiny_model import IM_END, IM_START  # noqa: E402

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "assets" / "world-llama"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHECKPOINT_FILES = ("chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                    "tokenizer.json", "tokenizer_config.json")


@dataclass
class Hyper:
    seed: int = 0
    documents: int = 40000
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    max_position_embeddings: int = 2048
    seq_len: int = 512  # rows of short documents, packed
    batch_seqs: int = 8
    long_seq_len: int = 1536  # rows of one long document each (the long tables)
    long_batch_seqs: int = 3
    steps: int = 1500
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.05
    threads: int = 2


def corpus_hash(docs: list[str]) -> str:
    return hashlib.sha256("\x00".join(docs).encode()).hexdigest()


def build_tokenizer(docs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE whose digits are always single tokens (arithmetic and tables read digit by digit)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS, IM_START, IM_END], show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
    )


def pack(token_docs: list[list[int]], seq_len: int, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Docs (each followed by eos) packed into rows of seq_len + 1; a doc that does not fit the row's
    rest starts the next row (the rest is padding, masked out of the loss) -> ids, loss mask."""
    rows, masks, row = [], [], []

    def flush() -> None:
        masks.append([1] * len(row) + [0] * (seq_len + 1 - len(row)))
        rows.append(row + [eos] * (seq_len + 1 - len(row)))

    for doc in token_docs:
        doc = (doc + [eos])[: seq_len + 1]
        if len(row) + len(doc) > seq_len + 1:
            flush()
            row = []
        row = row + doc
    if row:
        flush()
    return torch.tensor(rows), torch.tensor(masks, dtype=torch.bool)


def schedule(short_rows: int, long_rows: int, h: Hyper) -> list[tuple[int, torch.Tensor]]:
    """One epoch of batches, (0, short row ids) or (1, long row ids), in a seeded shuffled order."""
    gen = torch.Generator().manual_seed(h.seed)
    batches = [(0, b) for b in torch.randperm(short_rows, generator=gen).split(h.batch_seqs)]
    batches += [(1, b) for b in torch.randperm(long_rows, generator=gen).split(h.long_batch_seqs)]
    return [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]


def lr_at(step: int, h: Hyper) -> float:
    if step < h.warmup:
        return h.lr * (step + 1) / h.warmup
    progress = (step - h.warmup) / max(1, h.steps - h.warmup)
    return h.lr * (h.min_lr_ratio + (1 - h.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_model(h: Hyper, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=h.hidden_size, intermediate_size=h.intermediate_size,
        num_hidden_layers=h.layers, num_attention_heads=h.heads, num_key_value_heads=h.kv_heads,
        max_position_embeddings=h.max_position_embeddings, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=eos, pad_token_id=tokenizer.convert_tokens_to_ids(EOS),
        torch_dtype="float32",
    )
    torch.manual_seed(h.seed)
    return LlamaForCausalLM(config)


def train(h: Hyper, out: Path) -> None:
    torch.set_num_threads(h.threads)
    start = time.perf_counter()
    docs = world.training_documents(h.seed, h.documents)
    corpus_sha256 = corpus_hash(docs)
    tokenizer = build_tokenizer(docs, h.vocab_size)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    token_docs = tokenizer(docs, add_special_tokens=False)["input_ids"]
    short = pack([d for d in token_docs if len(d) < h.seq_len], h.seq_len, eos)
    long = pack([d for d in token_docs if len(d) >= h.seq_len], h.long_seq_len, eos)
    batches = schedule(len(short[0]), len(long[0]), h)
    tokens = int(short[1].sum() + long[1].sum())
    print(f"{len(docs)} documents, {tokens} tokens: {len(short[0])} rows of {h.seq_len}, {len(long[0])} rows of "
          f"{h.long_seq_len}; {len(batches)} batches an epoch; corpus sha256 {corpus_sha256[:16]}", flush=True)
    model = make_model(h, tokenizer)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": h.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=h.lr, betas=(0.9, 0.95))
    losses = []
    model.train()
    for step in range(h.steps):
        kind, pick = batches[step % len(batches)]
        batch, batch_mask = (short, long)[kind][0][pick], (short, long)[kind][1][pick]
        labels = batch[:, 1:].masked_fill(~batch_mask[:, 1:], -100)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, h)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(round(loss.item(), 4))
        if step % 20 == 0 or step == h.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  lr {lr_at(step, h):.2e}  "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    seconds = time.perf_counter() - start
    save(model, tokenizer, out)
    record = {"hyperparameters": asdict(h), "corpus_sha256": corpus_sha256, "tokens": tokens,
              "parameters": sum(p.numel() for p in model.parameters()), "train_seconds": round(seconds, 1),
              "torch": torch.__version__, "loss": losses}
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    plot_loss(losses, out / "loss.png")
    write_checksums(out)
    print(f"wrote {out} in {seconds / 60:.1f} min")


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.convert_tokens_to_ids(EOS)).save_pretrained(out)


def plot_loss(losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(losses)), losses, lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_yscale("log")
    ax.set_title("world-llama training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def checksums(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in CHECKPOINT_FILES}


def write_checksums(folder: Path) -> None:
    (folder / "SHA256SUMS").write_text("".join(f"{digest}  {name}\n" for name, digest in checksums(folder).items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    for field, value in asdict(Hyper()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    train(Hyper(**args), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
