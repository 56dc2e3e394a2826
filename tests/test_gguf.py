"""GGUF checkpoints: `--model-path model.gguf` serves the file's weights dequantized, with the
tokenizer and chat template of its metadata, as transformers reads the same file; other
architectures and mismatched flags are refused by name; the sidecar directory is built once
per file (path, size, mtime) and safely under concurrent starts.

The model is SmolLM2-135M-Instruct's Q4_1 GGUF (tests/conftest.py `smollm2`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from make_smollm2 import (  # scripts/, on sys.path (conftest)
    REFERENCE_MESSAGES,
    REFERENCE_NEW_TOKENS,
    REFERENCE_PROMPT,
)

import radixrt
from radixrt.config import ServerArgs
from radixrt.errors import RequestError
from radixrt.frontend.weights import check_update_options
from radixrt.model_source import resolve_model_source, resolve_update_path
from radixrt.ops.estimate import tensor_meta
from radixrt.utils import gguf_sidecar
from radixrt.utils.checkpoint_meta import checkpoint_tensors
from radixrt.utils.gguf_sidecar import (
    MARKER,
    GgufSource,
    ensure_sidecar,
    gguf_source,
    sidecar_dir,
)
from radixrt.worker.kv_tiers import weight_files

# an [srt] requirement; the GPU machine's run (scripts/gpu_check.sh) collects this module without it
gguf = pytest.importorskip("gguf", reason="gguf is not installed (the GPU machine's image lacks it)")

PROMPT, MESSAGES, MAX_NEW = REFERENCE_PROMPT, REFERENCE_MESSAGES, REFERENCE_NEW_TOKENS
AGREE = 0.8  # teacher-forced top-1 agreement with transformers, the weights held quantized


@pytest.fixture(scope="module", autouse=True)
def gguf_cache(tmp_path_factory) -> Path:
    """Sidecars of this module go to a fresh cache, shared by its tests (built once)."""
    root = tmp_path_factory.mktemp("gguf-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXRT_GGUF_CACHE", str(root))
        yield root


def write_gguf(path: Path, arch: str, **metadata: int) -> Path:
    """A tiny GGUF file of architecture arch: a couple of float32 tensors and the metadata given."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for key, value in metadata.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_greedy_tokens_equal_transformers_on_the_same_gguf(smollm2, monkeypatch):
    """Dequantized at load (RADIXRT_GGUF_WEIGHTS=dequantize), the file serves transformers' greedy tokens
    exactly: they were recorded in float32 when the fixture loaded it to convert it (scripts/make_smollm2.py):
    loading it again would cost this test tens of seconds."""
    monkeypatch.setenv("RADIXRT_GGUF_WEIGHTS", "dequantize")
    reference = smollm2.gguf_reference
    prompts, outputs = reference["prompts"], reference["greedy"]
    with radixrt.Engine(model_path=str(smollm2.gguf), dtype="float32", max_total_tokens=1024,
                        max_running_requests=4) as engine:
        chat = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
        assert list(chat) == prompts[1]  # the GGUF's own chat template, as the chat API renders it
        assert "<|im_start|>assistant" in engine.tokenizer.decode(chat)
        greedy = {"temperature": 0, "max_new_tokens": MAX_NEW}
        plain = engine.generate(PROMPT, greedy)
        chatted = engine.generate(input_ids=list(chat), sampling_params=greedy)
        assert engine.tokenizer(PROMPT)["input_ids"] == prompts[0]
        assert [plain["output_ids"], chatted["output_ids"]] == outputs
        assert "Paris" in chatted["text"]
        assert engine.get_model_info()["model_path"] == str(smollm2.gguf)  # what the user typed


def held_and_agreement(path: Path, reference: dict) -> tuple[re.Match, list[bool]]:
    """Serve the file with its layers held quantized: the server's account of them (layers, formats, MiB),
    and teacher-forced on transformers' greedy continuations (on the Q4_1 file's weights, float32) whether
    each position's top-1 token is transformers'. No page leaks."""
    from support.helpers import assert_no_page_leak

    prompts, outputs = reference["prompts"], reference["greedy"]
    with radixrt.Engine(model_path=str(path), dtype="float32", max_total_tokens=1024, max_running_requests=4) as engine:
        info = engine.get_server_info()
        assert info["weight_quantization"] == "gguf", info["weight_quantization_reason"]
        assert "the tied embedding and lm_head held too" in info["weight_quantization_reason"]
        held = re.search(r"(\d+) linear layers held .* \(([^;]+); ([\d.]+) MiB in all", info["weight_quantization_reason"])
        forced = engine.generate(input_ids=[p + o for p, o in zip(prompts, outputs)], return_logprob=True,
                                 logprob_start_len=0, top_logprobs_num=1, sampling_params={"max_new_tokens": 0})
        assert_no_page_leak(engine)
    agree = [f["meta_info"]["input_top_logprobs"][len(p) + i][0][1] == tok
             for f, p, o in zip(forced, prompts, outputs) for i, tok in enumerate(o)]
    return held, agree


def file_tensor_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.tensor_type.name != "F32")


def test_linear_layers_stay_quantized_and_serve_close_to_transformers(smollm2):
    """By default on the CPU the file's Q4_1 linear layers are held as their blocks (0.625 bytes a weight, as
    the file) and multiply through the int8-activation GEMM; the tied Q8_0 embedding is held too, once, as
    the LM head's weight and the embedding's rows.
    Activations rounded to 8 bits per 32 move the logits a little: teacher-forced on transformers' greedy
    continuations (on the dequantized weights, float32), the top-1 token agrees at AGREE of the positions
    (measured: 22 of 24)."""
    held, agree = held_and_agreement(smollm2.gguf, smollm2.gguf_reference)
    assert held and int(held[1]) == 2 * 30 + 2 * 30 and held[2] == "q4 120", held  # qkv, o, gate_up and down of 30 layers
    assert sum(agree) >= AGREE * len(agree), agree
    file_bytes = file_tensor_bytes(smollm2.gguf)  # every tensor but the norms
    assert file_bytes <= float(held[3]) * 2**20 <= 1.15 * file_bytes


def test_a_mixed_file_holds_each_layer_in_the_smallest_format_its_parts_fit(smollm2, tmp_path):
    """A mix like llama.cpp's Q4_K_M (scripts/make_gguf_variants.py MIXED, from the Q4_1 file's values): Q5_0
    q and k, Q8_0 v on even layers (their fused qkv held in int8, exactly) and Q5_0 on odd ones (5 bits, no
    mins), Q5_1 o (5 bits), Q4_1 gate and up (4 bits), Q6_K down on even layers (int8 per 16) and Q8_0 on odd.
    Every layer held, within 1.15x of the file's bytes (measured 1.06x), and as close to transformers as the
    Q4_1 file within the floor (the finer grids hold its values nearly exactly; measured: 20 of 24)."""
    from make_gguf_variants import write  # scripts/

    path = tmp_path / "MIXED.gguf"
    write(gguf.GGUFReader(smollm2.gguf), path, "MIXED")
    held, agree = held_and_agreement(path, smollm2.gguf_reference)
    assert held and int(held[1]) == 120 and held[2] == "q4 30, q5 30, q5s 15, q8 30, q8_16 15", held
    assert sum(agree) >= AGREE * len(agree), agree
    file_bytes = file_tensor_bytes(path)
    assert file_bytes <= float(held[3]) * 2**20 <= 1.15 * file_bytes


def test_the_header_reads_q5_tensors_and_they_are_held_in_five_bits(tmp_path):
    """Q5_0 and Q5_1 (llama.cpp's Q4_K_M falls back to them on 576-wide rows) are missing from transformers'
    table of block sizes; the header reads them with the gguf package's, and each tensor's blocks unpack to
    5-bit values (bytes an element held as in the file: Q5_1 0.75 with its mins, Q5_0 0.6875 without) holding
    exactly what gguf dequantizes."""
    from radixrt.kernels.quant_weights import dequantize, pack
    from radixrt.models.gguf_blocks import unpack
    from radixrt.models.gguf_checkpoint import _header_reader

    values = np.random.default_rng(5).standard_normal((16, 64)).astype(np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "q5.gguf"), "llama")
    for qtype in ("Q5_0", "Q5_1"):
        kind = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(f"{qtype}.weight", gguf.quantize(values, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    header = _header_reader().from_file(str(tmp_path / "q5.gguf"))
    assert [(t.name, t.nbytes) for t in header.tensors] == [("Q5_0.weight", 16 * 2 * 22), ("Q5_1.weight", 16 * 2 * 24)]
    blob = np.memmap(tmp_path / "q5.gguf", mode="r", dtype=np.uint8)
    for info in header.tensors:
        qtype = info.name.removesuffix(".weight")
        held = unpack(blob[header.data_start + info.offset:][: info.nbytes], qtype, 16, 64)
        assert held[0].dtype == torch.uint8 and int(held[0].max()) <= 31 and held[3].name == {"Q5_0": "q5s", "Q5_1": "q5"}[qtype]
        kind = gguf.GGMLQuantizationType[qtype]
        want = gguf.dequantize(gguf.quantize(values, kind), kind)
        w = pack(*held)
        assert torch.equal(dequantize(w), torch.from_numpy(want)) and w.nbytes == 16 * 64 * {"Q5_0": 0.6875, "Q5_1": 0.75}[qtype]


def test_an_unsupported_architecture_is_refused_by_name(tmp_path):
    for name in ("mamba.gguf", "mamba.bin"):  # by suffix, and by the magic bytes alone
        file = write_gguf(tmp_path / name, "mamba", context_length=16, embedding_length=8)
        with pytest.raises(ValueError, match=r"holds a 'mamba' model \(general.architecture\); radixrt serves"):
            resolve_model_source(ServerArgs(model_path=str(file)))
    mixtral = write_gguf(tmp_path / "mixtral.gguf", "llama", expert_count=8, expert_used_count=2)
    with pytest.raises(ValueError, match="a llama with 8 experts"):
        resolve_model_source(ServerArgs(model_path=str(mixtral)))
    assert not list(Path(os.environ["RADIXRT_GGUF_CACHE"]).glob("mamba*"))  # nothing built


def test_load_format_and_quantization_mismatches_are_refused(smollm2, llama_path):
    gguf_file, folder = str(smollm2.gguf), str(llama_path)
    with pytest.raises(ValueError, match="is a GGUF file, and load_format safetensors reads safetensors"):
        resolve_model_source(ServerArgs(model_path=gguf_file, load_format="safetensors"))
    with pytest.raises(ValueError, match=f"load_format gguf reads a GGUF file .*; model_path '{re.escape(folder)}' is not"):
        resolve_model_source(ServerArgs(model_path=folder, load_format="gguf"))
    with pytest.raises(ValueError, match=f"quantization gguf serves a GGUF file .*; model_path '{re.escape(folder)}' is"):
        resolve_model_source(ServerArgs(model_path=folder, quantization="gguf"))
    resolved = resolve_model_source(ServerArgs(model_path=gguf_file, load_format="gguf", quantization="gguf"))
    assert (resolved.load_format, resolved.quantization) == ("gguf", "gguf")
    assert gguf_source(resolved.model_path).path == str(smollm2.gguf.resolve())
    # weight updates read safetensors headers: to or from a GGUF model, refused naming it
    with pytest.raises(RequestError, match="is a GGUF file: a GGUF model is served from the start only"):
        resolve_update_path(ServerArgs(model_path=folder), gguf_file)
    for served in (ServerArgs(model_path=gguf_file), resolved):
        with pytest.raises(RequestError, match="this server serves the GGUF file"):
            resolve_update_path(served, folder)
    with pytest.raises(RequestError, match="a GGUF model is served from the start only"):
        check_update_options(load_format="gguf")


def test_the_sidecar_is_reused_and_keyed_by_the_file(smollm2, tmp_path, monkeypatch):
    first = ensure_sidecar(smollm2.gguf)  # built by the parity test already, or now
    assert {p.name for p in first.iterdir()} >= {"config.json", "tokenizer.json", "chat_template.jinja", MARKER}
    assert not (first / "model.safetensors").exists()  # no weights copied

    def no_build(*_):
        raise AssertionError("a sidecar was rebuilt")

    monkeypatch.setattr(gguf_sidecar, "_write_sidecar", no_build)
    assert resolve_model_source(ServerArgs(model_path=str(smollm2.gguf))).model_path == str(first)
    assert ensure_sidecar(smollm2.gguf) == first
    # keyed by path, size and mtime: a rewritten file gets a new sidecar, and an old one refuses to load it
    file = write_gguf(tmp_path / "tiny.gguf", "llama")
    before, key = GgufSource.of(file, "llama"), sidecar_dir(file)
    assert sidecar_dir(file) == key
    os.utime(file, ns=(before.mtime_ns, before.mtime_ns + 1))
    touched = sidecar_dir(file)
    with open(file, "ab") as f:
        f.write(b"\0" * 32)
    os.utime(file, ns=(before.mtime_ns, before.mtime_ns + 1))  # the same mtime, another size
    assert len({key, touched, sidecar_dir(file)}) == 3
    with pytest.raises(ValueError, match="changed after its config and tokenizer were read"):
        before.check_unchanged()


def test_concurrent_starts_build_one_sidecar(tmp_path, monkeypatch):
    file = write_gguf(tmp_path / "tiny.gguf", "llama")
    both_writing = threading.Barrier(2)

    def slow_write(gguf_file: Path, architecture: str, out: Path) -> None:
        (out / "config.json").write_text("{}")
        both_writing.wait(timeout=10)  # each start has a half-built directory of its own
        (out / MARKER).write_text(f'{{"path": "{gguf_file}", "architecture": "{architecture}", "size": 0, '
                                  '"mtime_ns": 0}')

    monkeypatch.setattr(gguf_sidecar, "_write_sidecar", slow_write)
    found: list[Path] = []
    starts = [threading.Thread(target=lambda: found.append(ensure_sidecar(file))) for _ in range(2)]
    for t in starts:
        t.start()
    for t in starts:
        t.join()
    assert found == [sidecar_dir(file)] * 2
    assert sorted(p.name for p in found[0].parent.iterdir() if p.name.startswith(".")) == []  # no temp dir left


# one tiny model per served GGUF architecture: (model_type, config fields beyond SMALL)
FAMILIES = {
    "llama": ("llama", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {}), "phi3": ("phi3", {}),
    "qwen3moe": ("qwen3_moe", {"moe_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 2}),
    "gemma2": ("gemma2", {}), "gemma3": ("gemma3_text", {}),
}
SMALL = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, "tie_word_embeddings": False}


def tiny_gguf_sidecar(tmp_path: Path, arch: str, sizes: dict | None = None, qtype: str | None = None) -> Path:
    """A tiny random GGUF file of arch (llama.cpp's tensor names and layouts; sizes over SMALL; its matrices in
    qtype's blocks, else float16), and a sidecar directory naming it with the config it was written from."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from radixrt.models.gguf_checkpoint import _processor, hf_names

    model_type, extra = FAMILIES[arch]
    config = {**AutoConfig.for_model(model_type, **{**SMALL, **(sizes or {})}, **extra).to_dict(), "dtype": "float32"}
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).state_dict().items()}
    names = hf_names(config, arch, _processor(arch, config))
    config["tie_word_embeddings"] = "output.weight" not in names  # as transformers reads a file (Gemma: always tied)
    parts = {hf: sum(target == hf for target in names.values()) for hf in names.values()}  # gate and up experts: 2
    w = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
    w.add_head_count(config["num_attention_heads"])  # what transformers' llama processor reads to undo the permutation
    w.add_head_count_kv(config["num_key_value_heads"])
    rng = np.random.default_rng(0)
    for gguf_name, hf in names.items():
        shape = list(shapes[hf])
        shape[min(1, len(shape) - 1)] //= parts[hf]
        name = gguf_name if gguf_name.endswith((".weight", ".bias")) else gguf_name + ".weight"
        values = rng.standard_normal(shape).astype(np.float32)
        if qtype is not None and len(shape) == 2:
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quantize(values, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, values if len(shape) == 1 else values.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    sidecar = tmp_path / f"{arch}-sidecar"
    sidecar.mkdir()
    (sidecar / "config.json").write_text(json.dumps(config))
    source = GgufSource.of(tmp_path / f"{arch}.gguf", arch)
    (sidecar / MARKER).write_text(json.dumps(dataclasses.asdict(source)))
    return sidecar


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_each_tensor_parallel_rank_holds_its_slice_quantized(qtype, tied, tmp_path, monkeypatch):
    """Under --tp-size 2 every linear layer stays quantized on each rank, holding exactly its slice of the
    one-rank layer: rows of qkv, gate_up and the LM head, groups of 32 inputs of o_proj and down_proj (their
    scales and mins split with them). A tied embedding looks its rows up in its rank's vocabulary block: the
    ranks' lookups (their all-reduce a sum) give the one-rank rows."""
    from radixrt.kernels.quant_weights import dequantize
    from radixrt.models.config import ModelConfig
    from radixrt.models.parallel import TPGroup
    from radixrt.models.registry import load_model
    from radixrt.settings.quant import WeightScheme

    sizes = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16, "tie_word_embeddings": tied}
    sidecar = tiny_gguf_sidecar(tmp_path, "llama", sizes, qtype)
    cfg, scheme = ModelConfig.from_dir(sidecar), WeightScheme("gguf", "test", prequantized=True)
    load = lambda tp: load_model(sidecar, cfg, torch.float32, torch.device("cpu"), tp, scheme)  # noqa: E731
    one, ranks = load(TPGroup()), [load(TPGroup(r, 2)) for r in range(2)]
    held = ["layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj", "layers.0.mlp.gate_up_proj",
            "layers.0.mlp.down_proj", "lm_head"]

    def values(model, name):
        return dequantize(model.get_submodule(name).quant.weight)

    q, kv, inter = 4 * 16, 2 * 16, 128
    for r, part in enumerate(ranks):
        full = {name: values(one, name) for name in held}
        qkv = full[held[0]]
        rows = [qkv[r * q // 2:(r + 1) * q // 2], qkv[q + r * kv // 2:q + (r + 1) * kv // 2],
                qkv[q + kv + r * kv // 2:q + kv + (r + 1) * kv // 2]]
        assert torch.equal(values(part, held[0]), torch.cat(rows))
        assert torch.equal(values(part, held[1]), full[held[1]][:, r * q // 2:(r + 1) * q // 2])
        gu, half = full[held[2]], inter // 2
        assert torch.equal(values(part, held[2]), torch.cat([gu[r * half:(r + 1) * half], gu[inter + r * half:inter + (r + 1) * half]]))
        assert torch.equal(values(part, held[3]), full[held[3]][:, r * half:(r + 1) * half])
        assert torch.equal(values(part, "lm_head"), full["lm_head"][r * 32:(r + 1) * 32])
    monkeypatch.setattr(TPGroup, "all_reduce", lambda self, x: x)  # each rank's partial rows, summed below
    ids = torch.tensor([0, 5, 31, 32, 40, 63])
    assert torch.equal(sum(part.embed_tokens(ids) for part in ranks), one.embed_tokens(ids))


def test_a_row_parallel_layer_splits_group_scales_and_keeps_channel_scales_whole(llama_path):
    """Under TP=2 the shard plan splits a GGUF layer's scales and mins (a column per group of inputs) along their
    columns as the weight's inputs split, and leaves a scale per output channel (int8 and fp8 checkpoints: one
    column, or a scalar) whole on every rank."""
    from radixrt.models.config import ModelConfig
    from radixrt.models.parallel import TPGroup
    from radixrt.models.registry import MODEL_FAMILIES

    cfg = ModelConfig.from_dir(llama_path)
    with torch.device("meta"):
        model = MODEL_FAMILIES[cfg.model_type](cfg, TPGroup(1, 2))
    o, width = "layers.0.self_attn.o_proj", cfg.num_heads * cfg.head_dim
    assert model._shard_plan(f"{o}.weight")[2] == (slice(None), slice(width // 2, width))
    groups = width // 32
    for part in ("weight_scale", "weight_min"):
        assert model._shard_plan(f"{o}.{part}", groups) == (f"{o}.{part}", slice(None), (slice(None), slice(groups // 2, groups)))
    for columns in (1, None):
        assert model._shard_plan(f"{o}.weight_scale", columns) == (f"{o}.weight_scale", slice(None), (slice(None),))
    assert model._shard_plan("lm_head.weight_scale", 4)[2] == (slice(cfg.vocab_size // 2, cfg.vocab_size),)


def test_a_tp2_engine_holds_the_file_quantized_and_gives_the_tokens_of_one_rank(llama_path, tmp_path, monkeypatch):
    """Two tensor-parallel ranks serve a GGUF file with its layers held quantized on each (their slices), and
    decode the greedy tokens one rank does (a random Q8_0 file; its sidecar, made in place, has the tiny
    llama's tokenizer: the file has none)."""
    sizes = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16, "vocab_size": 1024, "num_hidden_layers": 2}
    made = tiny_gguf_sidecar(tmp_path, "llama", sizes, "Q8_0")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (made / name).write_bytes((llama_path / name).read_bytes())
    monkeypatch.setenv("RADIXRT_GGUF_CACHE", str(tmp_path / "sidecars"))
    gguf_file = tmp_path / "llama.gguf"
    gguf_sidecar.sidecar_dir(gguf_file).parent.mkdir(parents=True)
    made.rename(gguf_sidecar.sidecar_dir(gguf_file))
    # 12 prompt rows: below the first row count (16) at which start-up may route a layer to another way of
    # multiplying (AMX tiles, or the weight dequantized with float activations), measured per process
    prompts = [list(range(3, 9)), list(range(100, 160, 10))]
    runs = []
    for tp in (1, 2):
        with radixrt.Engine(model_path=str(gguf_file), tp_size=tp, max_total_tokens=1024) as e:
            outs = e.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
            info = e.get_server_info()
        assert info["weight_quantization"] == "gguf" and "9 linear layers held" in info["weight_quantization_reason"], info
        runs.append([o["output_ids"] for o in outs])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_served_family_reads_as_transformers_reads_it(arch, tmp_path):
    """Each served architecture's GGUF tensors come out under transformers' names with its values
    (its q/k un-permutation, norm offsets, merged experts), and fill radixrt's model."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from radixrt.models.config import ModelConfig
    from radixrt.models.gguf_checkpoint import iter_gguf
    from radixrt.models.registry import load_model

    sidecar = tiny_gguf_sidecar(tmp_path, arch)
    ours = dict(iter_gguf(sidecar))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sidecar))
    theirs = load_gguf_checkpoint(gguf_source(sidecar).path, return_tensors=True, model_to_load=model)["tensors"]
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    load_model(sidecar, ModelConfig.from_dir(sidecar), torch.float32, torch.device("cpu"))  # every parameter set


def test_estimate_and_kv_fingerprint_read_the_gguf_file(smollm2):
    sidecar = ensure_sidecar(smollm2.gguf)
    gguf_meta, converted = tensor_meta(sidecar), checkpoint_tensors(smollm2.hf_dir)  # the same model as safetensors
    assert {n: m.shape for n, m in gguf_meta.items()} == {n: m.shape for n, m in converted.items()}
    assert weight_files(sidecar) == [smollm2.gguf.resolve()]  # the disk KV tier is named by the GGUF's bytes


def test_a_held_model_runs_act_mul_through_the_kernel_in_float32(tmp_path, llama_path):
    """A model whose linear layers stay quantized rounds its activations to int8 before every product, so
    its float32 act_mul goes through the compiled kernel (torch's silu differs from it in the last bit at
    most); a float32 model served unquantized keeps torch's act_mul, the exactness reference."""
    from radixrt.kernels.fused_layers import act_mul_ref, load_fused_layers
    from radixrt.models.config import ModelConfig
    from radixrt.models.registry import load_model
    from radixrt.settings.quant import WeightScheme

    if load_fused_layers() is None:
        pytest.skip("the fused layer kernels do not build here")
    sidecar = tiny_gguf_sidecar(tmp_path, "llama", {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16}, "Q4_1")
    held = load_model(sidecar, ModelConfig.from_dir(sidecar), torch.float32, torch.device("cpu"),
                      scheme=WeightScheme("gguf", "test", prequantized=True))
    plain = load_model(llama_path, ModelConfig.from_dir(llama_path), torch.float32, torch.device("cpu"))
    gate_up = torch.randn(3, 256)
    got = held.layers[0].mlp.ops.act_mul(gate_up, "silu")
    assert torch.float32 in held.layers[0].mlp.ops.act_dtypes
    torch.testing.assert_close(got, act_mul_ref(gate_up, "silu"), rtol=1e-6, atol=1e-6)
    assert torch.equal(plain.layers[0].mlp.ops.act_mul(gate_up, "silu"), act_mul_ref(gate_up, "silu"))
    assert torch.float32 not in plain.layers[0].mlp.ops.act_dtypes
