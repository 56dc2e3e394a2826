"""SmolLM2-135M as other llama.cpp types, for GGUF benchmarks beside llama.cpp (bench/gguf_speed.sh).

The shipped file (scripts/make_smollm2.py) is Q4_1. From its tensors, dequantized to float32 (the values
the bf16 checkpoint holds, before its bf16 rounding), this writes the same model, metadata and tokenizer
unchanged, as:
  F16.gguf     every 2-D weight float16 (the input llama.cpp's quantizer wants);
  Q8_0.gguf    every 2-D weight Q8_0, by the `gguf` package's quantizer;
  Q4_0.gguf    2-D weights Q4_0 by the `gguf` package, the token embedding (tied: also the output) Q8_0,
               as in the shipped file;
  Q4_K_M.gguf  llama.cpp's own quantizer (llama_model_quantize, through llama-cpp-python) on F16.gguf,
               written only where llama_cpp imports. K-quants need rows of 256: SmolLM2's 576-wide inputs
               take llama.cpp's fallbacks (Q5_0, Q8_0), only ffn_down (1,536 wide) gets Q4_K / Q6_K.
  MIXED.gguf   a mix like Q4_K_M's without llama.cpp (MIXED below; Q6_K by quantize_q6_k), for tests: every
               format radixrt holds, and fused layers whose parts differ (an even layer's Q5_0 q, k and Q8_0 v).
Norms and other 1-D tensors stay float32. Deterministic; a file already there is kept.

    python scripts/make_gguf_variants.py --src models/smollm2-0.1.2/model.gguf --out DIR [--types Q4_0,Q8_0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize, quantize

Q = gguf.GGMLQuantizationType
FILE_TYPE = {"F16": gguf.LlamaFileType.MOSTLY_F16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M}
VIRTUAL = ("GGUF.", "general.architecture", "general.file_type")  # the reader's own, or set by the writer


MIXED = {"attn_q": ("Q5_0", "Q5_0"), "attn_k": ("Q5_0", "Q5_0"), "attn_v": ("Q8_0", "Q5_0"), "attn_output": ("Q5_1", "Q5_1"),
         "ffn_gate": ("Q4_1", "Q4_1"), "ffn_up": ("Q4_1", "Q4_1"), "ffn_down": ("Q6_K", "Q8_0")}  # (even, odd layers)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """values [rows, cols] (cols a multiple of 256) as Q6_K blocks: per 16 a 6-bit grid n - 32 of step
    d sc_j (its largest |x| at 31 steps), sc_j int8 against the block's float16 d (the largest step at 127)."""
    x = values.astype(np.float32).reshape(-1, 16, 16)  # [blocks, sub-blocks, 16]
    step = np.abs(x).max(axis=2) / 31  # [blocks, 16]
    d = (step.max(axis=1) / 127).astype(np.float16)
    sc = np.where(d[:, None] > 0, np.round(step / np.maximum(d[:, None].astype(np.float32), 1e-30)), 0).clip(-128, 127).astype(np.int8)
    scale = d[:, None].astype(np.float32) * sc
    n = np.where(scale[..., None] > 0, np.round(x / np.maximum(scale[..., None], 1e-30)), 0).clip(-32, 31).astype(np.int16) + 32
    n = n.reshape(-1, 2, 4, 32).astype(np.uint8)  # [blocks, half, i, l]: element l + 32 i of each half of 128
    low, high = n & 15, n >> 4
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(-1, 128)  # byte l + 32 c: nibble 0 element i = c, nibble 1 i = c + 2
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.reshape(-1, 1).view(np.uint8)], axis=1)
    return blocks.reshape(values.shape[0], -1)


def tensor_type(name: str, target: str) -> Q:
    if target == "MIXED":
        parts = name.split(".")
        if name == "token_embd.weight" or parts[0] != "blk":
            return Q.Q8_0
        return Q[MIXED[parts[2]][int(parts[1]) % 2]]
    if target == "F16":
        return Q.F16
    if target == "Q4_0" and name == "token_embd.weight":
        return Q.Q8_0
    return Q[target]


def write(src: gguf.GGUFReader, path: Path, target: str) -> None:
    arch = src.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(path), arch)
    for key, field in src.fields.items():
        if key.startswith(VIRTUAL):
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    w.add_file_type(FILE_TYPE.get(target, gguf.LlamaFileType.GUESSED))
    for t in src.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        if values.ndim < 2:
            w.add_tensor(t.name, values)
            continue
        qtype = tensor_type(t.name, target)
        data = values.astype(np.float16) if qtype == Q.F16 else quantize_q6_k(values) if qtype == Q.Q6_K else quantize(values, qtype)
        w.add_tensor(t.name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_quantize(src: Path, out: Path, target: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{target}")
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {target}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--types", default="F16,Q8_0,Q4_0,Q4_K_M")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(a.src)
    for target in a.types.split(","):
        path = a.out / f"{target}.gguf"
        if path.exists():
            print(path)
            continue
        tmp = path.with_suffix(".tmp")
        if target == "Q4_K_M":
            f16 = a.out / "F16.gguf"
            if not f16.exists():
                write(reader, f16, "F16")
            llama_quantize(f16, tmp, target)
        else:
            write(reader, tmp, target)
        tmp.rename(path)
        print(path)


if __name__ == "__main__":
    main()
