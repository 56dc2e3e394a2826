"""Tiny checkpoints for the embedding, scoring and reranking tests, built from the tiny llama in
a test's tmp directory: a sentence-transformers embedding model (mean pooling, Normalize, with
Matryoshka dimensions), which also carries a Qwen3-Reranker-style chat template and single
"yes"/"no" tokens; and a sequence classifier (LlamaForSequenceClassification, one label), a
cross-encoder. Each one's reference is transformers on the same files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

# Worded as Qwen3-Reranker's template: its "yes"/"no" sentence is what marks a reranker (SGLang's test)
RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {{ instruct | default('Given a query, retrieve relevant passages') }}\n"
    "<Query>: {{ messages[0]['content'] }}\n<Document>: {{ messages[1]['content'] }}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
MATRYOSHKA_DIMENSIONS = [16, 32]


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy(f, dst / f.name)
    return dst


def mean_pooling_checkpoint(llama: Path, dst: Path) -> Path:
    """The tiny llama as a sentence-transformers model: mean pooling, then Normalize; Matryoshka
    dimensions in config.json; "yes" and "no" added as tokens; the reranker template beside it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _copy(llama, dst)
    (dst / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))
    (dst / "1_Pooling").mkdir(exist_ok=True)
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True}))
    tok = AutoTokenizer.from_pretrained(dst)
    tok.add_tokens(["yes", "no"])  # past the tiny vocabulary: the embedding and head grow by two (seeded) rows
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": MATRYOSHKA_DIMENSIONS}))
    (dst / "reranker.jinja").write_text(RERANKER_TEMPLATE)
    return dst


def classifier_checkpoint(llama: Path, dst: Path) -> Path:
    """A one-label LlamaForSequenceClassification on the tiny llama's layers and a seeded head."""
    from transformers import AutoConfig, LlamaForSequenceClassification

    cfg = AutoConfig.from_pretrained(llama)
    cfg.num_labels, cfg.architectures, cfg.pad_token_id = 1, ["LlamaForSequenceClassification"], cfg.eos_token_id
    torch.manual_seed(7)
    model = LlamaForSequenceClassification.from_pretrained(llama, config=cfg, dtype=torch.float32)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    model.save_pretrained(dst)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (llama / f).exists():
            shutil.copy(llama / f, dst / f)
    return dst
