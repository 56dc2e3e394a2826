"""Prefill-only requests without processes: the scheduler over a FakeWorker runs embeddings and
scores in the same steps as decodes, adds "mean" up over prefill chunks, serves "last" from a
cached prefix and runs "mean" / "cls" whole; and the pure pieces: the checkpoint's pooling
(radixrt/settings/pooling.py), the inputs' shapes and the answers' decoding (frontend/readout_calls.py),
and the rerank helpers (frontend/rerank.py)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from support.embedding_models import RERANKER_TEMPLATE
from support.scheduling import assert_idle_pool, make, req

from radixrt.errors import RequestError
from radixrt.frontend.readout_calls import (
    embedding,
    embedding_prompts,
    encode_vector,
    label_scores,
    score_prompts,
    shared_prefix_len,
)
from radixrt.frontend.req_state import ReqState
from radixrt.frontend.rerank import is_reranker_template, ranked, relevance
from radixrt.messages import Readout, TokenizedRequest
from radixrt.settings.pooling import Pooler, load_pooler
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.step import step

PAGE = 4


def readout_req(rid: str, prompt: list[int], kind: str, labels: list[int] | None = None) -> TokenizedRequest:
    return TokenizedRequest(rid, prompt, SamplingParams(max_new_tokens=0), readout=Readout(kind, labels or []))


def drive(s, w, requests: list[TokenizedRequest]) -> tuple[dict[str, np.ndarray], dict[str, int], list[set[str]]]:
    """Run to completion: each readout, each request's cached tokens, and which kinds of entry each step held."""
    for r in requests:
        s.add_request(r)
    values, cached, steps = {}, {}, []
    forward = w.forward

    def recording(batch):
        steps.append({"decode" if not e.readout and len(e.input_ids) == 1 else "readout" if e.readout else "prefill"
                      for e in batch.entries})
        return forward(batch)

    w.forward = recording
    while not s.idle:
        for out in step(s, w):
            if out.finish is not None:
                cached[out.rid] = out.cached_tokens
                if out.readout is not None:
                    values[out.rid] = np.frombuffer(out.readout, np.float32)
    return values, cached, steps


def test_readouts_join_the_decodes_batches_and_add_up_over_chunks():
    s, w = make(64, PAGE, chunked_prefill_size=8)
    prompt = list(range(3, 33))  # 30 tokens: four chunks of 8
    values, _, steps = drive(s, w, [req("gen", [1, 2, 3], 12), readout_req("mean", prompt, "mean"),
                                    readout_req("cls", prompt[::-1], "cls"), readout_req("last", prompt[:9], "last"),
                                    readout_req("labels", prompt[:5], "labels", [4, 9])])
    assert values["mean"] == pytest.approx([np.mean(prompt)])
    assert values["cls"] == pytest.approx([prompt[-1]]) and values["last"] == pytest.approx([prompt[8]])
    assert values["labels"] == pytest.approx([4 + prompt[4], 9 + prompt[4]])
    assert any({"decode", "readout"} <= kinds for kinds in steps), steps  # prefill-only work beside decodes
    assert_idle_pool(s)


def test_last_token_readouts_reuse_the_cache_and_mean_runs_whole():
    s, w = make(64, PAGE)
    prompt = list(range(5, 25))
    drive(s, w, [req("first", prompt, 2)])
    values, cached, _ = drive(s, w, [readout_req("last", prompt, "last"), readout_req("labels", prompt, "labels", [1])])
    assert cached["last"] == len(prompt) - 1 and values["last"] == pytest.approx([prompt[-1]])
    assert cached["labels"] == len(prompt) - 1
    values, cached, _ = drive(s, w, [readout_req("mean", prompt, "mean"), readout_req("cls", prompt, "cls")])
    assert cached == {"mean": 0, "cls": 0} and values["mean"] == pytest.approx([np.mean(prompt)])
    assert_idle_pool(s)


# -- the checkpoint's pooling ----------------------------------------------------------------------


def _checkpoint(tmp_path: Path, modules: list[str] | None, pooling: dict | None = None, **config) -> Path:
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, **config}))
    if modules is not None:
        mods = [{"path": "1_Pooling" if m == "Pooling" else "", "type": f"sentence_transformers.models.{m}"} for m in modules]
        (tmp_path / "modules.json").write_text(json.dumps(mods))
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling or {}))
    return tmp_path


def test_pooling_follows_the_sentence_transformers_modules(tmp_path):
    assert load_pooler(str(_checkpoint(tmp_path / "a", None)), None) == Pooler("last", True, None, False,
                                                                              "default (last token, normalized)", 64)
    p = load_pooler(str(_checkpoint(tmp_path / "b", ["Transformer", "Pooling", "Normalize"],
                                    {"pooling_mode_mean_tokens": True}, matryoshka_dimensions=[8, 16])), None)
    assert (p.kind, p.normalize, p.matryoshka_dimensions, p.is_matryoshka) == ("mean", True, (8, 16), True)
    p.check_dimensions(8)
    with pytest.raises(ValueError, match="supports only"):
        p.check_dimensions(12)
    cls = load_pooler(str(_checkpoint(tmp_path / "c", ["Transformer", "Pooling"], {"pooling_mode_cls_token": True})), None)
    assert (cls.kind, cls.normalize) == ("cls", False)
    with pytest.raises(ValueError, match="Matryoshka"):
        cls.check_dimensions(8)
    over = load_pooler(str(tmp_path / "c"), '{"pooling_type": "last", "normalize": true}')
    assert (over.kind, over.normalize, over.source) == ("last", True, "--pooler-config")
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        load_pooler(str(_checkpoint(tmp_path / "d", ["Pooling"], {"pooling_mode_max_tokens": True})), None)
    with pytest.raises(ValueError, match="Dense"):
        load_pooler(str(_checkpoint(tmp_path / "e", ["Transformer", "Pooling", "Dense"], {"pooling_mode_lasttoken": True})), None)
    with pytest.raises(ValueError, match="pooling_type"):
        load_pooler(str(tmp_path / "a"), '{"pooling_type": "MAX"}')
    head = load_pooler(str(_checkpoint(tmp_path / "f", None, architectures=["Qwen2ForSequenceClassification"],
                                       id2label={"0": "LABEL_0"})), None)
    assert head.head_labels == 1


# -- the inputs' shapes and the answers ------------------------------------------------------------


def _state(values: list[float]) -> ReqState:
    s = ReqState("r", [1, 2], SamplingParams(max_new_tokens=0), None, lambda: None)  # type: ignore[arg-type]
    s.readout = np.array(values, np.float32).tobytes()
    return s


def test_inputs_and_answers():
    assert embedding_prompts("a") == ([("a", None)], False)
    assert embedding_prompts([1, 2]) == ([(None, [1, 2])], False)
    assert embedding_prompts([[1], [2, 3]]) == ([(None, [1]), (None, [2, 3])], True)
    with pytest.raises(RequestError, match="not a mix"):
        embedding_prompts(["a", 1])
    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3]], 2) == 3
    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 5]], 4) == 0 and shared_prefix_len([[1, 2, 3]], 1) == 0
    assert score_prompts("q", ["a", "b"], False) == [("qa", None), ("qb", None)]
    assert score_prompts([1], [[2], [3]], True) == [(None, [2, 1]), (None, [3, 1])]
    with pytest.raises(RequestError):
        score_prompts("q", [[1]], False)
    vec = embedding(_state([3.0, 4.0, 12.0]), Pooler("last", True), 2)  # cut, then normalized
    assert vec == pytest.approx([0.6, 0.8])
    assert embedding(_state([3.0, 4.0]), Pooler("last", False), None) == pytest.approx([3.0, 4.0])
    assert np.frombuffer(base64.b64decode(encode_vector(vec, "base64")), "<f4") == pytest.approx(vec)
    logp = np.log([0.2, 0.05])
    assert label_scores(_state(list(logp)), False) == pytest.approx([0.2, 0.05], rel=1e-6)
    assert label_scores(_state(list(logp)), True) == pytest.approx([0.8, 0.2], rel=1e-6)


def test_rerank_helpers():
    assert is_reranker_template(RERANKER_TEMPLATE) and not is_reranker_template("{{ messages }}")
    assert relevance(0.3, 0.1) == pytest.approx(0.75) and relevance(0.0, 0.0) == 0.0
    out = ranked([0.1, 0.9, 0.5], ["a", "b", "c"], 2, True)
    assert [(o["index"], o["document"]) for o in out] == [(1, "b"), (2, "c")]
    assert "document" not in ranked([0.1], ["a"], None, False)[0]
