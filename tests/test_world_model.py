"""The trained demo model in the box (assets/world-llama): its files are the committed ones, it
knows its world, quantized KV keeps its answers, the quantized-KV start-up check works on it, and
the demo's programs answer right.

Nothing here retrains: scripts/train_demo_model.py made the checkpoint once.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import train_demo_model
import world
from support.helpers import assert_pool_idle, hf_greedy, wait_idle
from support.server_proc import running_server, server_info

import radixrt
from radixrt.config import ServerArgs
from radixrt.settings.kv import KV_QUANT_MIN_AGREEMENT
from radixrt.worker.kv_calibration import KVCalibrationError, compare_logits

ROOT = Path(__file__).resolve().parents[1]
WORLD = ROOT / "assets" / "world-llama"
PAGE = 16
# A fixed-seed sample of the answer key, every subset in it: all the facts (short prompts, and
# the subset held to 90%), and as many of the others as the time budget takes.
SAMPLE = {"facts": 152, "arithmetic": 100, "tables": 40, "long": 8}
MIN_FACTS_ACCURACY = 0.9
INT8_MAX_DROP = 0.02


def test_checkpoint_files_match_their_checksums():
    recorded = dict(reversed(line.split("  ")) for line in (WORLD / "SHA256SUMS").read_text().splitlines())
    assert set(recorded) == set(train_demo_model.CHECKPOINT_FILES)
    assert train_demo_model.checksums(WORLD) == recorded, "the committed demo model changed; retrain or restore it"


@pytest.fixture(scope="module")
def training() -> tuple[dict, list[str]]:
    """training.json, and the corpus world.py generates for its seed and size."""
    record = json.loads((WORLD / "training.json").read_text())
    hyper = record["hyperparameters"]
    return record, world.training_documents(hyper["seed"], hyper["documents"])


def test_world_is_the_one_the_model_was_trained_on(training):
    """world.py or world.json changed since training: the answer key no longer matches the model."""
    record, docs = training
    assert train_demo_model.corpus_hash(docs) == record["corpus_sha256"]


def test_rag_documents_are_the_worlds():
    on_disk = {p.name: p.read_text() for p in world.DOCS_DIR.glob("*.txt")}
    assert on_disk == world.documents()


def test_answer_key_never_asks_a_trained_question_closed_book(training):
    """No held-out question is trained without documents (world.py's NOTE: RAG training, with the
    answer in a document in the prompt, does use those phrasings)."""
    text = "".join(d for d in training[1] if "Document:" not in d)
    for item in world.sample_key({"facts": 152, "arithmetic": 200}):
        assert f"{item.question}<|im_end|>" not in text and f"Q: {item.question}\n" not in text, item.question


def test_compare_logits():
    ref = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    same = compare_logits(ref, ref.clone())
    assert (same.positions, same.top1_agreement, same.max_abs_dlogprob) == (2, 1.0, 0.0)
    flipped = compare_logits(ref, torch.tensor([[1.0, 2.0, 0.0], [0.0, 3.0, 1.0]]))
    assert flipped.top1_agreement == 0.5 and flipped.max_abs_dlogprob == pytest.approx(1.0)
    with pytest.raises(ValueError, match="different shapes"):
        compare_logits(ref, ref[:1])


def test_greedy_matches_transformers():
    prompts = [it.prompt for it in world.sample_key({"facts": 2, "tables": 1}, seed=3)]
    tok = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(WORLD)
    with radixrt.Engine(model_path=str(WORLD), page_size=PAGE, max_total_tokens=8192) as engine:
        ours = engine.generate(prompts, {"temperature": 0, "max_new_tokens": 8})
    for prompt, out in zip(prompts, ours):
        ids = tok.encode(prompt, add_special_tokens=False)
        assert out["output_ids"] == hf_greedy(WORLD, ids, 8), prompt


# -- the answer key with fp and int8 KV ----------------------------------------------------------


@pytest.fixture(scope="module")
def accuracy_by_kv() -> dict[str, dict[str, float]]:
    items = world.sample_key(SAMPLE)
    out = {}
    for kv in ("auto", "int8"):
        with radixrt.Engine(model_path=str(WORLD), kv_cache_dtype=kv, page_size=PAGE, max_total_tokens=32768) as engine:
            replies = engine.generate([it.prompt for it in items], {"temperature": 0, "max_new_tokens": 12})
            assert_pool_idle(wait_idle(engine.get_server_info))
        out[kv] = world.accuracy(items, [r["text"] for r in replies])
        print(f"kv_cache_dtype {kv}: exact match {out[kv]}")
    return out


def test_fp_kv_answers_the_facts(accuracy_by_kv):
    assert accuracy_by_kv["auto"]["facts"] >= MIN_FACTS_ACCURACY, accuracy_by_kv["auto"]


def test_int8_kv_within_two_points_of_fp(accuracy_by_kv):
    assert accuracy_by_kv["int8"]["all"] >= accuracy_by_kv["auto"]["all"] - INT8_MAX_DROP, accuracy_by_kv


# -- the quantized-KV start-up check -------------------------------------------------------------


def runner(**kwargs):
    from radixrt.worker.model_runner import ModelRunner

    return ModelRunner(ServerArgs(model_path=str(WORLD), device="cpu", page_size=PAGE, max_total_tokens=4096, **kwargs))


def scales_file(tmp_path: Path, k: list, v: list) -> str:
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k_scale": k, "v_scale": v}))
    return str(path)


def test_startup_check_accepts_the_default_and_fits_fp8_scales():
    r = runner(kv_cache_dtype="fp8_e4m3")
    assert r.kv_check is not None and r.kv_check.top1_agreement >= KV_QUANT_MIN_AGREEMENT
    assert all(0 < s < 1 for s in r.cache.k_scale + r.cache.v_scale)  # fitted: K/V are far inside e4m3's 448


def test_startup_check_takes_a_scales_file(tmp_path):
    layers = len(runner(kv_cache_dtype="int8").cache.k)
    r = runner(kv_cache_dtype="fp8_e4m3", kv_scales_file=scales_file(tmp_path, [0.02] * layers, [0.01] * layers))
    assert r.cache.k_scale == [0.02] * layers and r.cache.v_scale == [0.01] * layers


def test_startup_check_refuses_a_broken_scales_file(tmp_path):
    layers = 4
    # scales 1e-4: nothing above 0.045 survives the cast, every K and V is clamped flat
    with pytest.raises(KVCalibrationError, match="below kv_quant_min_agreement"):
        runner(kv_cache_dtype="fp8_e4m3", kv_scales_file=scales_file(tmp_path, [1e-4] * layers, [1e-4] * layers))
    with pytest.raises(ValueError, match="k_scale must list 4 numbers"):
        runner(kv_cache_dtype="fp8_e4m3", kv_scales_file=scales_file(tmp_path, [0.1], [0.1] * layers))
    with pytest.raises(ValueError, match="not a finite positive number"):
        runner(kv_cache_dtype="fp8_e5m2", kv_scales_file=scales_file(tmp_path, [0.1] * layers, [0.1, -1, 0.1, 0.1]))


def test_server_refuses_to_start_below_the_floor(tmp_path):
    prompts = tmp_path / "calibration.txt"
    prompts.write_text("R1: A=12.5 B=80.3 C=44.1\nR2: A=9.6 B=31.0 C=77.7\n\nWhere does Mara Quill live?\n")
    with pytest.raises(RuntimeError, match="kv_quant_min_agreement 1.0"):
        radixrt.Engine(model_path=str(WORLD), kv_cache_dtype="fp8_e5m2", kv_quant_min_agreement=1.0,
                       kv_calibration_file=str(prompts), page_size=PAGE, max_total_tokens=4096)


# -- the demo's programs -------------------------------------------------------------------------


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def answer_of(question: str) -> str:
    w = world.load_world()
    for subject, _, phrasings, answer in world.facts(w):
        if question in phrasings:
            return answer
    raise KeyError(question)


@pytest.fixture(scope="module")
def world_server():
    with running_server(WORLD, "--page-size", str(PAGE), "--max-total-tokens", "16384") as (url, _):
        yield url


def test_demo_programs_answer_right(world_server):
    url = world_server
    qa = load_example("few_shot_qa").main(url)
    # three known questions, checked one by one: a wrong answer fails
    assert qa["questions"] == ["Where does Zeno Penrose live?", "In what year was Ulric Lindqvist born?",
                               "What animal does Jory Brandt keep?"]
    assert qa["answers"] == ["Pellmarsh", "2005", "goat"]
    # run_batch sends the three at once, in no fixed order: whichever the scheduler admits first computes
    # the shared few-shot prefix, and the other two (held a step for it, or later) find it cached
    assert all(p > 50 for p in qa["prompt_tokens"]) and sorted(qa["cached_tokens"])[1] > 0

    tot = load_example("tree_of_thought").main(url)
    assert tot["thoughts"] == [answer_of(f"What does {c} do for a living?") for c in tot["candidates"]]
    assert tot["towns"] == ["Ostrel", "Pellmarsh", "Estmoor"] and tot["conclusion"] == "Tobin Reed lives in Pellmarsh."
    assert all(c >= tot["prefix_tokens"] - PAGE for c in tot["branch_cached_tokens"])

    chat = load_example("multi_turn_chat").main(url)
    assert [a.strip() for a in chat["answers"]] == ["Halden Bay", "22100", "ferret"]
    assert [m["role"] for m in chat["messages"]] == ["system"] + ["user", "assistant"] * 3
    assert chat["cached_tokens"][-1] > 0

    rag = load_example("rag_pipeline")
    first = rag.main(url)
    assert [a.strip() for a in first["answers"]] == [answer_of(q) for q in first["question_texts"]]
    assert all(r == sorted(r) and len(r) == 2 for r in first["retrieved"])
    second = rag.main(url)  # same prompts again: all but each prompt's last page comes from the cache
    assert second["answers"] == first["answers"]
    assert second["cached_tokens"] >= second["prompt_tokens"] - first["questions"] * PAGE
    assert_pool_idle(wait_idle(lambda: server_info(url)))
