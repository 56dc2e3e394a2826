"""LoRA adapters as the server knows them before any weight is read: the `--lora-paths`
entries, a PEFT checkpoint's adapter_config.json checked against the server's limits, the
content fingerprint that keys an adapter's KV, and the OpenAI `model: "base:adapter"` rule.

Every process reads these: the frontend refuses a bad adapter at the door (naming it), the
scheduler keys cache namespaces by the fingerprint, the worker loads the tensors
(radixrt/models/lora.py) into the sites named here.

A PEFT module name maps onto the fused layer it adds to: q/k/v_proj onto qkv_proj,
gate/up_proj onto gate_up_proj, as SGLang normalizes them.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import msgspec

from radixrt.settings.fields import arg

# the fused layers LoRA can add to, in the order the model runs them
LORA_SITES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# a PEFT (or --lora-target-modules) module name -> the site it adds to
SITE_OF = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "qkv_proj": "qkv_proj",
           "o_proj": "o_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
           "gate_up_proj": "gate_up_proj", "down_proj": "down_proj"}
SITE_PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}  # rank blocks a site's slot holds
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."  # SGLang's refusals
NOT_LOADED = "The following requested LoRA adapters are not loaded: {name}\nLoaded adapters: {loaded}."
MOE_PARTS = (".experts.", ".block_sparse_moe.", ".mlp.gate.")  # module paths inside a sparse block
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoraRef(msgspec.Struct, frozen=True):
    """An adapter the server may serve: its name (what requests send as lora_path), its
    directory, and whether it keeps its slot (pinned: never evicted)."""

    lora_name: str
    lora_path: str
    pinned: bool = False


class AdapterConfig(msgspec.Struct, frozen=True):
    """What the server reads of one adapter's adapter_config.json, already checked."""

    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    sites: tuple[str, ...]  # the LORA_SITES it adds to
    fingerprint: str  # of its config and weights' bytes: a new adapter under an old name has new KV


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names it."""


def parse_lora_paths(values: list[str]) -> list[LoraRef]:
    """SGLang's --lora-paths forms: `NAME=PATH`, a bare `PATH` (its name is the path), or a JSON
    object {"lora_name", "lora_path", "pinned"}."""
    refs = []
    for value in values:
        text = value.strip()
        if text.startswith("{"):
            try:
                refs.append(msgspec.json.decode(text, type=LoraRef))
            except msgspec.ValidationError as e:
                raise ValueError(f"--lora-paths {value!r}: {e}") from None
        elif "=" in text:
            name, path = text.split("=", 1)
            refs.append(LoraRef(name.strip(), path.strip()))
        else:
            refs.append(LoraRef(text, text))
    names = [r.lora_name for r in refs]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-paths names an adapter twice: {names}")
    return refs


def target_sites(modules: list[str] | None) -> tuple[str, ...] | None:
    """--lora-target-modules as sites (None: from the adapters given at start); `all`: every site."""
    if not modules:
        return None
    if "all" in modules:
        return LORA_SITES
    unknown = [m for m in modules if m not in SITE_OF]
    if unknown:
        raise ValueError(f"--lora-target-modules: {unknown} are not among {sorted(SITE_OF)} or 'all'")
    return tuple(s for s in LORA_SITES if s in {SITE_OF[m] for m in modules})


def read_adapter(ref: LoraRef, max_rank: int | None = None, sites: tuple[str, ...] | None = None) -> AdapterConfig:
    """ref's adapter_config.json, checked against the server's max rank and target sites
    (None: not checked). Raises AdapterError naming the adapter."""
    where = f"LoRA adapter {ref.lora_name!r} ({ref.lora_path})"
    folder = Path(ref.lora_path)
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise AdapterError(f"{where}: no PEFT checkpoint there ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    try:
        cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{where}: {ADAPTER_CONFIG} does not read: {e}") from None
    _check_supported(cfg, where)
    rank = int(cfg["r"])
    if max_rank is not None and rank > max_rank:
        raise AdapterError(f"{where}: its rank {rank} is larger than --max-lora-rank {max_rank}")
    modules = _target_modules(cfg, where)
    own = tuple(s for s in LORA_SITES if s in {SITE_OF[m] for m in modules})
    missing = [s for s in own if sites is not None and s not in sites]
    if missing:
        raise AdapterError(f"{where}: it targets {missing}, which are not in the server's LoRA target modules "
                           f"{list(sites or ())} (--lora-target-modules)")
    _check_modules(folder, where)
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterConfig(ref.lora_name, ref.lora_path, rank, scaling, own, _fingerprint(folder))


def _check_supported(cfg: dict, where: str) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise AdapterError(f"{where}: per-module ranks ({key}) are not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{where}: LoRA biases (bias={cfg['bias']!r}) are not supported")
    if cfg.get("use_dora") or cfg.get("fan_in_fan_out"):
        raise AdapterError(f"{where}: DoRA and fan_in_fan_out adapters are not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{where}: modules_to_save ({cfg['modules_to_save']}) is not supported")
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        raise AdapterError(f"{where}: its rank r={cfg.get('r')!r} is not a positive integer")


def _target_modules(cfg: dict, where: str) -> list[str]:
    modules = cfg.get("target_modules")
    if isinstance(modules, str):  # PEFT allows a regex or "all-linear"; SGLang reads the names
        raise AdapterError(f"{where}: target_modules {modules!r} is a pattern; name the modules")
    if not modules:
        raise AdapterError(f"{where}: adapter_config.json names no target_modules")
    unsupported = [m for m in modules if m not in SITE_OF]
    if unsupported:
        raise AdapterError(f"{where}: LoRA on {unsupported} is not supported (attention and dense MLP "
                           f"projections: {sorted(SITE_OF)})")
    return list(modules)


def _check_modules(folder: Path, where: str) -> None:
    """Refuse LoRA on a mixture-of-experts block (its experts or router) by the module's name; the
    header is all that is read."""
    from safetensors import (
        safe_open,  # the serving runtime's dependency, not the client's
    )

    with safe_open(str(folder / ADAPTER_WEIGHTS), framework="pt") as f:
        moe = [k for k in f.keys() if any(part in k for part in MOE_PARTS)]
    if moe:
        raise AdapterError(f"{where}: LoRA on MoE experts and routers is not supported ({moe[0]})")


def _fingerprint(folder: Path) -> str:
    h = hashlib.sha256()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        with open(folder / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:16]


def split_model_name(model: str | None) -> tuple[str | None, str | None]:
    """OpenAI `model`: "base:adapter" -> (base, adapter); without a colon, (model, None)."""
    if model is None or ":" not in model:
        return model, None
    base, adapter = model.split(":", 1)
    return base.strip(), adapter.strip() or None


EVICTION_POLICIES = ("lru", "fifo")
LORA_BACKENDS = ("triton", "csgmv", "ascend", "torch_native")  # SGLang's names: every one runs our torch code


class LoraServing(msgspec.Struct, frozen=True):
    """The server's LoRA pool, resolved from its flags, at SGLang's two levels: the adapters
    registered (at most --max-loaded-loras: past it the least recently used unpinned one is
    unloaded), and the --max-loras-per-batch slots their weights run from (a step runs at most
    that many adapters; which idle one leaves a slot is --lora-eviction-policy's choice). Also:
    the adapters given at start, and the rank and sites every slot is sized for (from the flags,
    else the largest and the union of those adapters')."""

    adapters: tuple[AdapterConfig, ...]
    pinned: tuple[str, ...]  # names of the start-up adapters given as pinned
    rank: int
    sites: tuple[str, ...]
    slots: int  # --max-loras-per-batch: adapters whose weights the model holds, so adapters one step runs
    max_loaded: int | None  # --max-loaded-loras: adapters registered at most (None: any number)
    eviction_policy: str

    @classmethod
    def of(cls, args) -> LoraServing | None:
        """None without --enable-lora. Raises ValueError (an AdapterError naming the adapter)."""
        if not args.enable_lora:
            return None
        refs = parse_lora_paths(args.lora_paths or [])
        sites = target_sites(args.lora_target_modules)
        adapters = tuple(read_adapter(r, args.max_lora_rank, sites) for r in refs)
        rank = args.max_lora_rank or max(a.rank for a in adapters)
        sites = sites or tuple(s for s in LORA_SITES if any(s in a.sites for a in adapters))
        return cls(adapters, tuple(r.lora_name for r in refs if r.pinned), rank, sites, args.max_loras_per_batch,
                   args.max_loaded_loras, args.lora_eviction_policy)


@dataclass(frozen=True)
class LoraArgs:
    enable_lora: bool = arg(False, "serve LoRA adapters (set by --lora-paths): docs/lora.md")
    lora_paths: list[str] | None = arg(
        None, "adapters served from the start: NAME=PATH, PATH (named by its path) or JSON "
        '{"lora_name": ..., "lora_path": ..., "pinned": false}; PATH is a PEFT checkpoint directory'
    )
    max_lora_rank: int | None = arg(None, "the largest adapter rank the slots hold (default: the largest of --lora-paths)")
    lora_target_modules: list[str] | None = arg(
        None, "the modules adapters may add to: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj qkv_proj "
        "gate_up_proj, or all (default: those of --lora-paths)"
    )
    max_loras_per_batch: int = arg(
        8, "adapter slots in the model: the distinct adapters one step runs at most (the base model not counted)"
    )
    max_loaded_loras: int | None = arg(
        None, "adapters registered at most; loading one more unloads the least recently used unpinned one "
        "(default: no limit)"
    )
    lora_eviction_policy: str = arg("lru", "which idle unpinned adapter leaves its slot for another: lru or fifo")
    lora_backend: str = arg(
        "csgmv", "SGLang's LoRA kernels (triton, csgmv, ascend, torch_native): every choice runs radixrt's grouped "
        "torch matmuls"
    )

    def check(self) -> None:
        """SGLang's checks of the LoRA flags (check_lora_server_args), as ValueErrors. As in SGLang,
        --lora-paths turns LoRA on."""
        if self.lora_paths and not self.enable_lora:
            object.__setattr__(self, "enable_lora", True)
        if self.max_loras_per_batch <= 0:
            raise ValueError("max_loras_per_batch must be positive")
        if self.lora_eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"lora_eviction_policy must be one of {EVICTION_POLICIES}, got {self.lora_eviction_policy!r}")
        if self.lora_backend not in LORA_BACKENDS:
            raise ValueError(f"lora_backend must be one of {LORA_BACKENDS}, got {self.lora_backend!r}")
        if not self.enable_lora:
            return
        modules = self.lora_target_modules or []
        if "all" in modules and len(modules) > 1:
            raise ValueError("If 'all' is specified in --lora-target-modules, it should be the only module specified.")
        if not self.lora_paths and (self.max_lora_rank is None or not modules):
            raise ValueError("When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
                             "--lora-target-modules for LoRA initialization.")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        loaded = self.max_loaded_loras
        if loaded is not None and loaded < self.max_loras_per_batch:
            raise ValueError("max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                             f"max_loaded_loras={loaded}, max_loras_per_batch={self.max_loras_per_batch}")
        if loaded is not None and len(self.lora_paths or []) > loaded:
            raise ValueError("The number of LoRA paths should not exceed max_loaded_loras. "
                             f"max_loaded_loras={loaded}, lora_paths={len(self.lora_paths)}")

    @property
    def lora(self) -> LoraServing | None:
        """The LoRA pool (None without --enable-lora), from the start-up adapters' configs (read
        and hashed on each call: the processes call it once, at start)."""
        return LoraServing.of(self)
