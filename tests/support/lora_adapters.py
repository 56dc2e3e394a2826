"""Random PEFT LoRA adapters for the tiny test checkpoints, and transformers + peft references.

`ensure_adapter(base, "a", seed=1)` builds (once, cached under `<repo>/models/lora/<base name>/`)
a deterministic adapter in PEFT's own format (adapter_config.json + adapter_model.safetensors);
`reference_greedy(base, adapter, ids, n)` is transformers' greedy generate with that adapter
merged into the float32 base (or the plain base when adapter is None). Nothing is downloaded.

Expects `scripts/` on sys.path, as tests/conftest.py arranges.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import peft
import torch
import transformers
from make_tiny_model import DEFAULT_MODELS_ROOT, STAMP_NAME, ensure_built
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

from support.helpers import hf_greedy

LORA_ROOT = DEFAULT_MODELS_ROOT / "lora"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")
DENSE_MLP_MODULES = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
# With init_lora_weights=False, peft leaves nn.Linear's default init on A and B (uniform, bound
# 1/sqrt(fan_in); B ~ U(-0.35, 0.35) at r=8). That delta already changes llama/qwen/phi3 greedy
# tokens, but not always Gemma's (embeddings scaled by sqrt(hidden), soft-capped logits): at
# scale 1, 2 of 3 gemma3_text seeds left all of 4 short prompts unchanged; at 2.5 every family
# and seed changed at least one of them (8 new tokens each).
B_SCALE = 2.5


def default_targets(model: PreTrainedModel) -> list[str]:
    """Attention and dense-MLP projections present in model; attention only for MoE models
    (our runtime refuses LoRA on experts, and their dense layers are left alone too)."""
    names = {name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    moe = any(name.endswith(".experts") for name, _ in model.named_modules())
    wanted = ATTENTION_MODULES if moe else ATTENTION_MODULES + DENSE_MLP_MODULES
    return [m for m in wanted if m in names]


def _load_base(base_path: Path) -> PreTrainedModel:
    # A fresh copy, never helpers.hf_model's: peft injects its layers into the model in place.
    return AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()


def _sort_target_modules(out_dir: Path) -> None:
    """peft writes target_modules from a set (order varies with PYTHONHASHSEED): sort it, so the
    same arguments give the same bytes. Same format as peft's own writer."""
    path = out_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


@dataclass(frozen=True)
class AdapterSpec:
    """What makes one random adapter: its seed and PEFT's LoraConfig values."""

    seed: int
    r: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] | None = None  # None: default_targets of the model
    use_rslora: bool = False

    def key(self) -> str:
        targets = sorted(self.target_modules) if self.target_modules else "default"
        return json.dumps({"seed": self.seed, "r": self.r, "alpha": self.alpha, "targets": targets,
                           "rslora": self.use_rslora, "b": B_SCALE})


def make_adapter(base_path: Path, out_dir: Path, spec: AdapterSpec) -> Path:
    """Write a random LoRA adapter for base_path into out_dir (always rebuilds; see ensure_adapter)."""
    model = _load_base(Path(base_path))
    targets = sorted(spec.target_modules or default_targets(model))
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=targets, init_lora_weights=False,
                        lora_dropout=0.0, use_rslora=spec.use_rslora, task_type="CAUSAL_LM")  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream alone
        torch.manual_seed(spec.seed)
        lora = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if ".lora_B." in name:
                param.mul_(B_SCALE)
    lora.save_pretrained(out_dir)
    (Path(out_dir) / "README.md").unlink(missing_ok=True)  # peft's model card: not needed
    _sort_target_modules(Path(out_dir))
    return Path(out_dir)


def _fingerprint(base_path: Path, spec: str) -> str:
    """Changes when the base checkpoint, this file, the arguments or the libraries change."""
    h = hashlib.sha256(spec.encode())
    stamp = base_path / STAMP_NAME
    h.update(stamp.read_bytes() if stamp.is_file() else str(base_path.resolve()).encode())
    h.update(Path(__file__).resolve().read_bytes())
    h.update(f"torch={torch.__version__} transformers={transformers.__version__} peft={peft.__version__}".encode())
    return h.hexdigest()


def ensure_adapter(base_path: Path, name: str, seed: int, **options) -> Path:
    """`models/lora/<base dir name>/<name>-s<seed>-<spec hash>`, built first when missing or stale
    (one builder at a time across processes; make_tiny_model.ensure_built). options: AdapterSpec's."""
    base_path = Path(base_path)
    if options.get("target_modules") is not None:
        options["target_modules"] = tuple(options["target_modules"])
    spec = AdapterSpec(seed, **options)
    key = spec.key()
    target = LORA_ROOT / base_path.name / f"{name}-s{seed}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"
    return ensure_built(target, _fingerprint(base_path, key), lambda tmp: make_adapter(base_path, tmp, spec))


@functools.lru_cache(maxsize=8)
def merged_model(base_path: Path, adapter_path: Path) -> PreTrainedModel:
    """The float32 base with the adapter merged into its weights (cached by the two paths)."""
    model = PeftModel.from_pretrained(_load_base(Path(base_path)), Path(adapter_path))
    return model.merge_and_unload().eval()


def reference_greedy(base_path: Path, adapter_path: Path | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens after prompt_ids (new ones only; may stop early at eos),
    with the adapter merged, or from the plain base when adapter_path is None."""
    if adapter_path is None:
        return hf_greedy(Path(base_path), prompt_ids, max_new_tokens)
    model = merged_model(Path(base_path), Path(adapter_path))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None, temperature=None,
        )  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()
