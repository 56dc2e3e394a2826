"""update_weights_from_disk: the header check that refuses a checkpoint that does not fit, and
through a real engine: the old KV never serves the new weights (cached_tokens 0, transformers'
tokens on the new weights), a rollback finds the old weights' disk-tier pages, a refused
checkpoint leaves the old model serving, a request in flight finishes on the old weights with
the old weight_version while a request sent during the update waits for the new ones. The
tensor-parallel case (both ranks update) is in test_tensor_parallel.py, the HTTP route and its
admin key in test_server.py, SGLang's fields in test_sglang_fields.py."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import radixrt
import torch
from support.helpers import assert_no_page_leak, corpus_prompts, half_written_copy, hf_greedy, wait_for
from make_tiny_model import ensure_model
from radixrt.errors import RequestError
from radixrt.frontend.weights import check_update_options
from radixrt.utils.checkpoint_meta import checkpoint_tensors, incompatibility
from safetensors.torch import load_file, save_file

GREEDY = {"max_new_tokens": 8, "temperature": 0}
RETRAINED_SEED = 99  # the second checkpoint: the tiny llama's architecture, other weights


@pytest.fixture(scope="module")
def retrained_path():
    return ensure_model("llama", seed=RETRAINED_SEED)


# -- the header check -------------------------------------------------------------------


def test_the_check_reads_headers_and_names_what_differs(llama_path, retrained_path, model_paths, tmp_path):
    assert incompatibility(llama_path, retrained_path) is None  # same shapes, other values
    assert "model_type" in incompatibility(llama_path, model_paths["qwen2"])
    tensors = checkpoint_tensors(llama_path)
    assert tensors["model.embed_tokens.weight"].dtype == "F32" and sum(t.numel for t in tensors.values()) > 0
    bad = tmp_path / "bad"
    shutil.copytree(llama_path, bad)
    weights = load_file(bad / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    weights[name] = torch.zeros(weights[name].shape[0] + 1, weights[name].shape[1])
    save_file(weights, bad / "model.safetensors")
    assert name in incompatibility(llama_path, bad) and "shape" in incompatibility(llama_path, bad)
    del weights[name]
    save_file(weights, bad / "model.safetensors")
    assert "lacks" in incompatibility(llama_path, bad)
    (bad / "config.json").unlink()
    assert "config.json" in incompatibility(llama_path, bad)


def test_options_sglang_has_but_radixrt_cannot_honour_are_refused_by_name():
    check_update_options(None, torch_empty_cache=True, recapture_cuda_graph=True, token_step=3, flush_cache=True)
    for kwargs, field in (({"flush_cache": False}, "flush_cache"), ({"keep_pause": True}, "keep_pause"),
                          ({"is_async": True}, "is_async"), ({"load_format": "gguf"}, "load_format")):
        with pytest.raises(RequestError) as e:
            check_update_options(**kwargs)
        assert e.value.param == field


# -- through the engine -------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(llama_path, tmp_path_factory):
    hicache = tmp_path_factory.mktemp("hicache")
    with radixrt.Engine(model_path=str(llama_path), page_size=4, max_total_tokens=2048, log_level="warning",
                        enable_hierarchical_cache=True, hicache_dir=str(hicache),
                        hicache_load_policy="always") as e:  # the rollback reads the disk, whatever it costs
        yield e


def test_an_update_drops_the_old_kv_and_a_rollback_finds_it_on_disk(engine, llama_path, retrained_path, model_paths,
                                                                    tmp_path):
    prompt = corpus_prompts(llama_path, [50], seed=31)[0]
    first = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert engine.generate(input_ids=prompt, sampling_params=GREEDY)["meta_info"]["cached_tokens"] > 0
    before = engine.get_model_info()

    res = engine.update_weights_from_disk(str(retrained_path), weight_version="v2")
    assert res.success, res.message
    success, message, paused = res  # SGLang's tuple
    new = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert new["meta_info"]["cached_tokens"] == 0  # nothing computed with the old weights serves the new
    assert new["output_ids"] == hf_greedy(retrained_path, prompt, GREEDY["max_new_tokens"])
    assert new["output_ids"] != first["output_ids"] and new["meta_info"]["weight_version"] == "v2"
    info = engine.get_model_info()
    assert info["model_path"] == str(retrained_path) and info["weight_version"] == "v2"
    assert info["weights_fingerprint"] not in ("", before["weights_fingerprint"])

    refused = engine.update_weights_from_disk(str(model_paths["qwen2"]))
    assert not refused.success and "model_type" in refused.message and "keep serving" in refused.message
    assert engine.get_model_info() == info
    assert engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == new["output_ids"]
    with pytest.raises(ValueError, match="model_path"):
        engine.update_weights_from_disk(str(llama_path / "nowhere"))
    broken = engine.update_weights_from_disk(str(half_written_copy(llama_path, tmp_path / "broken")))
    assert not broken.success and "loading" in broken.message and "keep serving" in broken.message
    assert engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == new["output_ids"]  # rolled back
    assert engine.get_model_info() == info

    hits = engine.get_server_info()["disk_hit_pages"]
    assert engine.update_weights_from_disk(str(llama_path), weight_version="v1").success
    back = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert back["output_ids"] == first["output_ids"]
    assert back["meta_info"]["cached_tokens"] > 0  # the old weights' pages, persisted at the switch
    server = engine.get_server_info()
    assert server["disk_hit_pages"] > hits and server["weight_updates"] == 2
    assert engine.get_model_info()["weights_fingerprint"] == before["weights_fingerprint"]
    assert_no_page_leak(engine)


def test_in_flight_requests_finish_on_the_old_weights_and_new_ones_wait(engine, llama_path, retrained_path):
    engine.update_weights_from_disk(str(llama_path), weight_version="old")  # a known start
    long = {"max_new_tokens": 500, "temperature": 0, "ignore_eos": True}  # still running when the update comes
    prompt, later = corpus_prompts(llama_path, [20, 30], seed=32)
    reference = engine.generate(input_ids=prompt, sampling_params=long)["output_ids"]
    stream = engine.generate(input_ids=prompt, sampling_params=long, stream=True)
    next(stream)  # it runs
    update: dict = {}
    updater = threading.Thread(target=lambda: update.update(
        r=engine.update_weights_from_disk(str(retrained_path), weight_version="new")))
    updater.start()
    during = wait_for(engine.get_server_info, lambda i: i["weight_update_pending"] == 1, timeout=30)
    assert during["weight_update_pending"] == 1 and during["running"] == 1  # the update waits for it
    waited: dict = {}
    sender = threading.Thread(target=lambda: waited.update(r=engine.generate(input_ids=later, sampling_params=GREEDY)))
    sender.start()
    held = wait_for(engine.get_server_info, lambda i: i["held_for_weight_update"] == 1, timeout=30)
    assert held["weight_update_pending"] == 1 and held["held_for_weight_update"] == 1  # it waits for the new weights
    *_, done = stream
    updater.join(60)
    sender.join(60)
    assert done["output_ids"] == reference and done["meta_info"]["weight_version"] == "old"
    assert update["r"].success and update["r"].num_paused_requests == 1
    assert waited["r"]["meta_info"]["weight_version"] == "new"
    assert waited["r"]["output_ids"] == hf_greedy(retrained_path, later, GREEDY["max_new_tokens"])
    assert_no_page_leak(engine)


def test_abort_all_requests_ends_the_running_ones_first(engine, llama_path):
    long = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    stream = engine.generate(input_ids=corpus_prompts(llama_path, [20], seed=33)[0], sampling_params=long, stream=True)
    next(stream)
    res = engine.update_weights_from_disk(str(llama_path), abort_all_requests=True)
    *_, done = stream
    assert res.success
    assert done["meta_info"]["finish_reason"]["type"] == "abort" and len(done["output_ids"]) < 400
    assert "weights are being updated" in json.dumps(done["meta_info"]["finish_reason"])
    assert_no_page_leak(engine)
