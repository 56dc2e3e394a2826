"""Speculative decoding through a real server: STANDALONE at tensor parallel 2 (the draft model
sharded like the target, verification on both ranks), and NGRAM draft trees there (the kept
branches' KV moved on both ranks), give the greedy tokens of plain decoding (with logit_bias and
stop_regex too),
meta_info carries SGLang's spec_* fields, /metrics SGLang's spec gauges, get_server_info the
figures, and no page leaks; flags that cannot apply refuse to start, by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
from support.draft_models import first_layers_draft
from support.helpers import tokenizer
from support.server_proc import assert_healthy_and_idle, running_server, server_info

from radixrt.config import ServerArgs

ROOT = Path(__file__).resolve().parents[1]
WORLD = ROOT / "assets" / "world-llama"
TEXTS = ["Where does Mara Quill live?", "R1: A=12.5 B=80.3 C=44.1\nR2: A=9.6 B=31.0 C=77.7\nR1:",
         "The capital of Estmoor is", "Table:\nR1: A=1.1 B=2.2\nR2: A=1.1 B=2.2\nR3:"]
GREEDY = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
# logit_bias and stop_regex are exact under speculation (the worker biases each draft position's
# logits as plain decoding would; the scheduler takes accepted tokens one by one through the stop checks)
BIASED = {**GREEDY, "logit_bias": {"5": 2.0, "40": -3.0}, "stop_regex": [r"C=\d+\.\d"]}
COMMON = ("--page-size", "16", "--max-total-tokens", "4096", "--dtype", "float32", "--tp-size", "2")


def generate(url: str, prompts: list[list[int]], params: dict = GREEDY) -> list[dict]:
    r = requests.post(url + "/generate", json={"input_ids": prompts, "sampling_params": params}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_standalone_at_tp2_matches_plain_decoding_and_reports_its_figures(tmp_path):
    draft = first_layers_draft(WORLD, 3, tmp_path / "draft")
    tok = tokenizer(WORLD)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    with running_server(WORLD, *COMMON) as (url, _):
        want = [r["output_ids"] for r in generate(url, prompts)]
        biased = [(r["output_ids"], r["meta_info"]["finish_reason"]) for r in generate(url, prompts, BIASED)]
    assert any(reason.get("matched") == BIASED["stop_regex"][0] for _, reason in biased), biased
    spec = ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(draft),
            "--speculative-num-steps", "2", "--speculative-draft-policy", "max")
    with running_server(WORLD, *COMMON, *spec) as (url, _):
        got = generate(url, prompts)
        assert [r["output_ids"] for r in got] == want
        for r in got:
            meta = r["meta_info"]
            assert meta["spec_verify_ct"] >= 1
            assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
            assert 0 <= meta["spec_accept_rate"] <= 1
        assert sum(r["meta_info"]["spec_accept_token_num"] for r in got) > 0
        got_biased = generate(url, prompts, BIASED)
        assert [(r["output_ids"], r["meta_info"]["finish_reason"]) for r in got_biased] == biased
        assert all(r["meta_info"]["spec_verify_ct"] >= 1 for r in got_biased)  # speculated, not run plainly
        metrics = requests.get(url + "/metrics", timeout=10).text
        assert "sglang:spec_accept_length{" in metrics and "sglang:spec_accept_rate{" in metrics
        info = server_info(url)
        assert info["spec_draft_tokens"] > 0 and info["spec_accept_length"] > 1
        assert_healthy_and_idle(url)
    # NGRAM trees: rank 0 verifies, and both ranks move the kept branches' KV (Ranks.share)
    trees = ("--speculative-algorithm", "NGRAM", "--speculative-ngram-min-bfs-breadth", "3",
             "--speculative-ngram-max-bfs-breadth", "3", "--speculative-draft-policy", "max")
    with running_server(WORLD, *COMMON, *trees) as (url, _):
        assert [r["output_ids"] for r in generate(url, prompts + prompts)] == want + want
        assert [(r["output_ids"], r["meta_info"]["finish_reason"]) for r in generate(url, prompts, BIASED)] == biased
        info = server_info(url)
        assert info["spec_tree_steps"] > 0 and info["spec_accepted_tokens"] > 0, info
        assert_healthy_and_idle(url)


@pytest.mark.parametrize("flags, refusal", [
    ({"speculative_algorithm": "EAGLE"}, "EAGLE heads"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_bfs_breadth": 3, "speculative_ngram_max_bfs_breadth": 2},
     "speculative_ngram_min_bfs_breadth"),
    ({"speculative_algorithm": "NGRAM", "speculative_accept_threshold_single": 0.5}, "speculative_accept_threshold_single"),
    ({"speculative_algorithm": "STANDALONE"}, "speculative_draft_model_path"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "d", "speculative_eagle_topk": 4},
     "speculative_eagle_topk"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1}, "speculative_num_draft_tokens"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_policy": "fixed"}, "speculative_draft_policy"),
])
def test_flags_that_cannot_apply_are_refused_by_name(flags, refusal):
    with pytest.raises(ValueError, match=refusal):
        ServerArgs(model_path="m", **flags)


def test_a_draft_with_another_vocabulary_is_refused_at_start(llama_path):
    from radixrt.worker.model_runner import ModelRunner

    with pytest.raises(ValueError, match="shares the target's tokenizer"):
        ModelRunner(ServerArgs(model_path=str(WORLD), device="cpu", max_total_tokens=1024,
                               speculative_algorithm="STANDALONE", speculative_draft_model_path=str(llama_path)))
