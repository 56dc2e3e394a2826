"""Weight bytes in memory against a GGUF file's tensor bytes: each file loaded as the server loads it (bf16
model, linear layers and a tied embedding held as the file's blocks where they can be), every parameter's
bytes plus the held tiles' counted; and the file's types and their bytes beside. Run with the project's venv:

    .venv/bin/python bench/gguf_resident.py FILE.gguf [...] [--out bench/results/gguf/resident.json]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch

from radixrt.models import ModelConfig, load_model
from radixrt.settings.quant import WeightScheme
from radixrt.utils.gguf_sidecar import ensure_sidecar


def resident(path: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(path)
    types: collections.Counter[str] = collections.Counter()
    for t in reader.tensors:
        types[t.tensor_type.name] += int(t.n_bytes)
    sidecar = ensure_sidecar(path)
    model = load_model(sidecar, ModelConfig.from_dir(sidecar), torch.bfloat16, torch.device("cpu"),
                       scheme=WeightScheme("gguf", "bench", prequantized=True))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    layers, held, tied, formats = model.quant_held or (0, 0, False, {})
    file_bytes = sum(types.values())
    return {"file_tensor_bytes": file_bytes, "types_mib": {k: round(v / 2**20, 1) for k, v in types.items()},
            "resident_bytes": params + held, "held_layers": layers, "held_bytes": held, "tied_embedding_held": tied,
            "held_formats": formats,
            "ratio": (params + held) / file_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    out = {}
    for path in a.files:
        out[path.name] = r = resident(path)
        print(f"{path.name:14} file {r['file_tensor_bytes'] / 2**20:6.1f} MiB  resident {r['resident_bytes'] / 2**20:6.1f} MiB "
              f"({r['ratio']:.2f}x; {r['held_layers']} layers held {r['held_formats']}{', tied embedding held' if r['tied_embedding_held'] else ''})  "
              f"{r['types_mib']}", flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
