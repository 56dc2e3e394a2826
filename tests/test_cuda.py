"""On a CUDA GPU: the whole engine with each attention backend against transformers' fp32
logprobs on the same weights. Skips, saying why, without a GPU (or without flashinfer).

The 100M model (head_dim 64) is used: FlashInfer's kernels want head_dim 64/128/256, and
the tiny models' is 16. bf16 on the GPU against an fp32 reference: logprobs agree to about
0.1, while a wrong mask or page mapping is off by whole nats.

Decode CUDA graphs: replay against eager FlashInfer decode on the same pool (exact and
padded batch sizes, padding never touching a real page), and the engine's greedy output
with graphs on and off; tensor-core decode (a GQA group of 4 or more) under graphs, on a
bf16 and an fp8 pool, against the torch backend.

Every test here carries the `cuda` marker: scripts/gpu_check.sh runs `pytest -m cuda` on the
GPU machine. Engines capture few graphs (cuda_graph_max_bs) where the count does not matter.
"""

from __future__ import annotations

import math
import random

import pytest
import radixrt
import torch
from support.helpers import corpus_prompts, hf_logprobs
from make_tiny_model import ensure_model
from radixrt.kernels import AttentionMetadata, LayerAttention

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")]


@pytest.mark.parametrize("backend", ["flashinfer", "torch"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_on_cuda_matches_transformers_logprobs(backend, page_size, llama_path):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer-python (the `cuda` extra) is not installed")
    path = ensure_model("llama", "100m")
    prompts = corpus_prompts(llama_path, [40, 150, 300], seed=31)  # token ids < 1024 fit its vocabulary
    with radixrt.Engine(model_path=str(path), dtype="bfloat16", device="cuda", attention_backend=backend,
                        page_size=page_size, chunked_prefill_size=64, max_total_tokens=8192, cuda_graph_max_bs=4) as engine:
        results = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0},
                                  return_logprob=True, logprob_start_len=0)
        info = engine.get_server_info()
        assert info["free_pages"] + info["cached_pages"] == info["num_pages"]
    for ids, res in zip(prompts, results):
        out = res["output_ids"]
        ref = hf_logprobs(path, ids + out)  # fp32 on the CPU
        got = [t[0] for t in res["meta_info"]["input_token_logprobs"][1:]] + [t[0] for t in res["meta_info"]["output_token_logprobs"]]
        want = [ref[j - 1, (ids + out)[j]].item() for j in range(1, len(ids) + len(out))]
        diffs = [abs(a - b) for a, b in zip(got, want)]
        assert max(diffs) < 0.25 and sum(diffs) / len(diffs) < 0.05, (max(diffs), sum(diffs) / len(diffs))


# -- decode CUDA graphs (radixrt/worker/cuda_graph.py) ------------------------------------------

GRAPH_TOL = 0.25  # max |logit| difference, graph replay against eager FlashInfer (bf16; split-KV may differ)


def graph_runner(page_size: int):
    """A ModelRunner on the 100M model whose decode graphs cover batch sizes 1, 2, 4, 8, 16."""
    pytest.importorskip("flashinfer", reason="flashinfer-python (the `cuda` extra) is not installed")
    from radixrt.config import ServerArgs
    from radixrt.worker.model_runner import ModelRunner

    args = ServerArgs(model_path=str(ensure_model("llama", "100m")), dtype="bfloat16", device="cuda",
                      page_size=page_size, max_total_tokens=32768, max_running_requests=16)
    runner = ModelRunner(args)
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8, 16]
    return runner


def fill_decode_batch(runner, n: int, rng: random.Random, free: list[int]) -> list:
    """n decodes on slots 0..n-1, of different lengths, each on fresh scattered pages holding a random prefix."""
    from radixrt.messages import BatchEntry

    cache, ps = runner.cache, runner.page_size
    entries = []
    for slot in range(n):
        kv_len = rng.randint(1, 600)  # after this step
        pages = [free.pop() for _ in range(math.ceil(kv_len / ps))]
        runner.slots.page_table[slot, : len(pages)] = torch.tensor(pages)
        for buf in cache.k + cache.v:
            buf[pages] = torch.randn(len(pages), *buf.shape[1:], device=buf.device).to(buf.dtype)
        entries.append(BatchEntry(slot=slot, input_ids=[rng.randrange(1000)], start_pos=kv_len - 1, new_pages=[], sample=True))
    return entries


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_graph_replay_matches_eager_flashinfer(page_size):
    """Exact (16, 8, 1, 2) and padded (13 -> 16, 5 -> 8, 3 -> 4) batch sizes. A padded batch right
    after a larger one on the same graph (16 then 13, 8 then 5) checks that stale rows are reset:
    padding rows must leave every real page as it was."""
    runner = graph_runner(page_size)
    graphs, cache, model = runner.graphs, runner.cache, runner.model
    rng = random.Random(page_size)
    torch.manual_seed(page_size)
    free = list(range(cache.num_pages))
    rng.shuffle(free)
    with torch.inference_mode():
        for buf in cache.k + cache.v:  # defined contents everywhere, so that "unchanged" can be checked
            buf.zero_()
        for n in [16, 13, 8, 5, 1, 3, 2]:
            meta, ids, pos = runner._prepare(fill_decode_batch(runner, n, rng, free))
            assert graphs.can_run(meta)
            runner.attn.init_forward(meta)
            want = model.compute_logits(model(ids, pos, runner.attn))  # [n, vocab], eager; writes the new K/V
            before = [buf.clone() for buf in cache.k + cache.v]
            got = model.compute_logits(graphs.replay(meta, ids, pos))
            diff = (got - want).abs()
            assert diff.max() < GRAPH_TOL and diff.mean() < 0.03, (n, diff.max().item(), diff.mean().item())
            top2 = want.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * GRAPH_TOL  # rows whose greedy token no tolerance can flip
            assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]), n
            for old, new in zip(before, cache.k + cache.v):  # only this step's slots and the pad page changed
                old, new = old.view(-1, *old.shape[2:]), new.view(-1, *new.shape[2:]).clone()
                for flat in (old, new):
                    flat[meta.out_slots] = 0
                    flat[cache.pad_slot :] = 0
                assert torch.equal(old, new), f"batch {n}: a padding row wrote a real page"
        one = torch.zeros(1, 1, dtype=torch.int64, device="cuda")
        assert not graphs.can_run(AttentionMetadata([2, 1], [2, 9], one.expand(2, 1), one[0].expand(3), page_size))
        assert not graphs.can_run(AttentionMetadata([1] * 17, [5] * 17, one.expand(17, 1), one[0].expand(17), page_size))


def test_engine_greedy_output_same_with_and_without_cuda_graphs(llama_path):
    """Requests that stop at different lengths walk the decode batch down through exact and
    padded graph sizes (6 -> 8, 5 -> 8, 4, 3 -> 4, 2, 1)."""
    pytest.importorskip("flashinfer", reason="flashinfer-python (the `cuda` extra) is not installed")
    path = ensure_model("llama", "100m")
    prompts = corpus_prompts(llama_path, [5, 40, 150, 300, 33, 77], seed=7)
    params = [{"max_new_tokens": m, "temperature": 0, "ignore_eos": True} for m in (24, 5, 17, 9, 30, 12)]
    runs = {}
    for disable in (False, True):
        with radixrt.Engine(model_path=str(path), dtype="bfloat16", device="cuda", page_size=16, max_total_tokens=8192,
                            max_running_requests=8, disable_cuda_graph=disable) as engine:
            runs[disable] = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
    for i, (graph, eager) in enumerate(zip(runs[False], runs[True])):
        assert len(graph["output_ids"]) == len(eager["output_ids"]) == params[i]["max_new_tokens"]
        for j, (a, b) in enumerate(zip(graph["output_ids"], eager["output_ids"])):
            if a != b:  # allowed only at a near tie (bf16 rounding in a different split-KV order), and ends the comparison
                top = eager["meta_info"]["output_top_logprobs"][j]
                margin = top[0][0] - top[1][0]
                assert margin < 0.05, f"prompt {i}, token {j}: {a} with graphs, {b} eager (eager margin {margin:.3f})"
                break
            lp_graph, lp_eager = (r["meta_info"]["output_token_logprobs"][j][0] for r in (graph, eager))
            assert abs(lp_graph - lp_eager) < 0.1, (i, j, lp_graph, lp_eager)


class ToyAttentionModel(torch.nn.Module):
    """Only attention: each layer projects q, k, v from the token's embedding and attends through the
    backend; the output is the sum over layers [T, heads * D]. Enough for a decode graph to capture."""

    def __init__(self, layers: int, heads: int, kv_heads: int, D: int, vocab: int = 1024, hidden: int = 256) -> None:
        super().__init__()
        self.shape = (heads, kv_heads, D)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(hidden, (heads + 2 * kv_heads) * D, bias=False) for _ in range(layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        heads, kv_heads, D = self.shape
        x = self.embed(input_ids)  # [T, hidden]
        out = torch.zeros(len(input_ids), heads * D, dtype=x.dtype, device=x.device)
        for layer, proj in enumerate(self.qkv):
            q, k, v = proj(x).split([heads * D, kv_heads * D, kv_heads * D], -1)
            o = attn.forward(q.reshape(-1, heads, D), k.reshape(-1, kv_heads, D), v.reshape(-1, kv_heads, D), layer)
            out = out + o.reshape(len(input_ids), -1)
        return out


def random_decode_steps(cache, max_pages: int, rng: random.Random):
    """Decode steps of 8, 5, 1 and 3 requests over random lengths on shuffled pages of `cache`:
    (n, AttentionMetadata, input ids [n], positions [n]) per step."""
    dev, ps = cache.k[0].device, cache.page_size
    for n in [8, 5, 1, 3]:
        free = list(range(cache.num_pages))
        rng.shuffle(free)
        kv_lens = [rng.randint(1, max_pages * ps) for _ in range(n)]
        tables = [[free.pop() for _ in range(math.ceil(L / ps))] for L in kv_lens]
        page_table = torch.tensor([t + [0] * (max_pages - len(t)) for t in tables], device=dev)
        out_slots = torch.tensor([t[(L - 1) // ps] * ps + (L - 1) % ps for t, L in zip(tables, kv_lens)], device=dev)
        meta = AttentionMetadata([1] * n, kv_lens, page_table, out_slots, ps)
        yield n, meta, torch.randint(0, 1024, (n,), device=dev), torch.tensor([L - 1 for L in kv_lens], device=dev)


def test_decode_graphs_run_each_layer_with_its_attention_kind():
    """Sliding + capped and full layers (two kinds, Gemma 2's pattern): every graph size holds one
    decode wrapper per kind, each planned per replay; replays match eager FlashInfer on sequences
    longer than the window (where a wrong kind's wrapper would read different KV)."""
    pytest.importorskip("flashinfer", reason="flashinfer-python (the `cuda` extra) is not installed")
    from radixrt.kernels import LayerAttention, PagedKVCache, create_attention_backend
    from radixrt.worker.cuda_graph import DecodeGraphRunner

    D, heads, kv_heads, ps, max_pages = 64, 8, 2, 16, 40
    local, full = LayerAttention(D**-0.5, window=32, softcap=20.0), LayerAttention(0.1)
    layers = [local, full, local]
    dev = torch.device("cuda")
    cache = PagedKVCache(len(layers), 8 * max_pages + 8, ps, kv_heads, D, torch.bfloat16, dev)
    attn = create_attention_backend("flashinfer", cache, heads, D, layers)
    assert attn.kinds == [local, full]
    torch.manual_seed(0)
    model = ToyAttentionModel(len(layers), heads, kv_heads, D).to(dev, torch.bfloat16)
    rng = random.Random(0)
    with torch.inference_mode():
        for buf in cache.k + cache.v:
            buf.copy_(torch.randn(buf.shape, device=dev).to(buf.dtype))
        graphs = DecodeGraphRunner(model, attn, [1, 2, 4, 8], max_pages)
        assert all(len(w) == 2 for w in graphs.wrappers.values())
        for n, meta, ids, pos in random_decode_steps(cache, max_pages, rng):
            attn.init_forward(meta)
            want = model(ids, pos, attn).float()  # eager; writes the new K/V
            got = graphs.replay(meta, ids, pos).float()
            torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2, msg=lambda m: f"batch {n}: {m}")


def test_sink_window_on_flashinfer_with_graphs_follows_the_torch_backend_past_the_context(llama_path):
    """Dropped pages, re-rotated sinks and rope rows past the table on FlashInfer (CUDA graphs on):
    the same greedy tokens as the torch backend on the GPU up to a near tie, past the context."""
    pytest.importorskip("flashinfer", reason="flashinfer-python (the `cuda` extra) is not installed")
    path = ensure_model("llama", "100m")
    (ids,) = corpus_prompts(llama_path, [40], seed=23)
    runs = {}
    for backend in ("flashinfer", "torch"):
        with radixrt.Engine(model_path=str(path), dtype="bfloat16", device="cuda", attention_backend=backend,
                            page_size=16, max_total_tokens=4096, cuda_graph_max_bs=1) as engine:
            n = engine.get_server_info()["context_length"] + 200
            sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True,
                  "kv_retention": {"policy": "sink_window", "window_tokens": 128}}
            runs[backend] = engine.generate(input_ids=ids, sampling_params=sp, return_logprob=True, top_logprobs_num=2)
            info = engine.get_server_info()
            assert info["kv_retention_peak_pages"] <= 1 + 128 // 16 + 1 and info["kv_retention_dropped_pages"] > 0
    fi, ref = runs["flashinfer"], runs["torch"]
    assert len(fi["output_ids"]) == len(ref["output_ids"]) == n
    for j, (a, b) in enumerate(zip(fi["output_ids"], ref["output_ids"])):
        if a != b:
            top = ref["meta_info"]["output_top_logprobs"][j]
            assert top[0][0] - top[1][0] < 0.05, f"token {j}: {a} on flashinfer, {b} on torch"
            break


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"], ids=["bf16", "fp8_e4m3"])
def test_tensor_core_decode_graphs_match_the_torch_backend(kv_cache_dtype):
    """A GQA group of 4 (FlashInfer decodes through its tensor-core kernel) under CUDA graphs, exact
    and padded batch sizes, on a bf16 pool and on an fp8 one (read as fp8, k_scale / v_scale passed):
    replays match eager FlashInfer, and both match the torch backend over the same pool."""
    pytest.importorskip("flashinfer", reason="flashinfer-python (the `cuda` extra) is not installed")
    from radixrt.kernels import PagedKVCache, create_attention_backend
    from radixrt.kernels.flashinfer_backend import TENSOR_CORE_GQA_GROUP
    from radixrt.worker.cuda_graph import DecodeGraphRunner

    D, heads, kv_heads, ps, max_pages = 64, 16, 4, 16, 32
    layers = [LayerAttention(D**-0.5)] * 2
    dev = torch.device("cuda")
    cache = PagedKVCache(len(layers), 8 * max_pages + 8, ps, kv_heads, D, torch.bfloat16, dev, kv_cache_dtype)
    attn = create_attention_backend("flashinfer", cache, heads, D, layers)
    assert heads // kv_heads >= TENSOR_CORE_GQA_GROUP and attn.use_tensor_cores
    reference = create_attention_backend("torch", cache, heads, D, layers)
    torch.manual_seed(1)
    model = ToyAttentionModel(len(layers), heads, kv_heads, D).to(dev, torch.bfloat16)
    rng = random.Random(1)
    with torch.inference_mode():
        everywhere = torch.arange(cache.num_pages * ps, device=dev)
        for layer in range(len(layers)):  # through write(), so that an fp8 pool holds quantized values
            cache.write(layer, everywhere, *(torch.randn(len(everywhere), kv_heads, D, device=dev).bfloat16() for _ in "kv"))
        graphs = DecodeGraphRunner(model, attn, [1, 2, 4, 8], max_pages)
        for n, meta, ids, pos in random_decode_steps(cache, max_pages, rng):
            reference.init_forward(meta)
            want = model(ids, pos, reference).float()  # every run writes the same new K/V
            attn.init_forward(meta)
            eager = model(ids, pos, attn).float()
            got = graphs.replay(meta, ids, pos).float()
            torch.testing.assert_close(got, eager, atol=3e-2, rtol=3e-2, msg=lambda m: f"batch {n}, graph vs eager: {m}")
            torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2, msg=lambda m: f"batch {n}, graph vs torch: {m}")
