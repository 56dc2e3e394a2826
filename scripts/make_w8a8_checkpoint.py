"""Write a pre-quantized W8A8 (or W8A16) int8 checkpoint in compressed-tensors' format, for tests.

llm-compressor's int8 checkpoints ("int-quantized" format) hold, for every quantized Linear,
`weight` as int8 [out, in] and `weight_scale` [out, 1] (per-channel, symmetric: no zero
point), with config.json's quantization_config naming the scheme: weights 8-bit int symmetric
per channel; input activations 8-bit int symmetric dynamic per token (W8A8), or none (W8A16).
This writes that by hand from an unquantized checkpoint (lm_head, embeddings and norms stay as
they are), the config built and validated with the `compressed-tensors` package itself. The
scales are radixrt's (amax / 127, int8_linear.quantize_rows) rather than llm-compressor's
observers' (amax / 127.5), so the checkpoint holds exactly what `--quantization w8a8_int8`
makes at load: the tests check both serve the same tokens.

    python scripts/make_w8a8_checkpoint.py SRC_DIR OUT_DIR [--weight-only]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantization_config(weight_only: bool) -> dict:
    from compressed_tensors.quantization import (
        QuantizationConfig,
        preset_name_to_scheme,
    )

    scheme = preset_name_to_scheme("W8A8", ["Linear"])  # channel weights, dynamic token activations
    if weight_only:
        scheme.input_activations = None
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="int-quantized", ignore=["lm_head"],
                                quantization_status="compressed")
    return json.loads(config.model_dump_json(exclude_none=True))


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8, scale = amax / 127 in float32 (an all-zero row: scale 1)."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(w / scale).clamp_(-127, 127).to(torch.int8), scale


def make(src: Path, out: Path, weight_only: bool = False) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEAR_SUFFIXES:
                tensors[name], tensors[f"{module}.weight_scale"] = quantize_rows(t)
            else:
                tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(weight_only)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--weight-only", action="store_true", help="W8A16: no activation quantization (int8wo)")
    args = parser.parse_args(argv)
    print(make(args.src, args.out, args.weight_only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
