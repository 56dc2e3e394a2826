"""LoRA adapters in the model: a bounded bank of slots per fused layer, filled from PEFT
checkpoints, and the per-step delta each layer adds for the rows whose request runs an adapter.

A site (one fused layer: qkv_proj, o_proj, gate_up_proj or down_proj of a layer) holds, for
every slot, A [parts * R, in] and B^T [parts * R, out] (R: --max-lora-rank). A fused layer of
several checkpoint modules (q/k/v_proj into qkv_proj) gives each part its own block of R
rank rows, and B only that part's output rows in that block, so one pair of matmuls serves
all parts: delta = (x @ A^T) @ B^T. B holds the adapter's scaling folded in. A rank below R
leaves zeros.

The tensors of each adapter stay in host memory (`host`, as many as --max-loaded-loras): read in a
background thread when it is registered (`read`), so its first load into a slot, and every load
after an eviction, is a copy that waits for no file.

Per step the runner names, for each adapter in the batch, its slot and the rows of its
requests (`LoraBank.plan`: runs of consecutive rows, or one gather per adapter); each site then
adds x[rows] @ A^T @ B^T to those rows of the base output, in place.
(Multiplying every slot's A and B at once, each row masked to its own slot, cost more at 16
adapters on decode steps of 8 rows: 0.45x the base model against 0.64x for the groups.) The base output is
computed once for the whole batch. One matmul pair per adapter in
the step: the grouped form of SGLang's segmented GEMM, in plain torch (the same code runs
on CUDA, untested here).

Tensor parallelism: each tensor is sharded by the plan of the base weight it adds to
(LlamaForCausalLM._shard_plan): a column-parallel layer's B keeps this rank's output rows
(A whole); a row-parallel layer's A keeps this rank's input columns (B whole), and its
delta joins the partial sums before their all-reduce, so no collective is added.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from radixrt.models.config import ModelConfig
from radixrt.models.parallel import TPGroup, rank_heads
from radixrt.settings.lora import (
    ADAPTER_WEIGHTS,
    SITE_PARTS,
    AdapterConfig,
    AdapterError,
)

PEFT_PREFIX = "base_model.model."
MAX_RUNS_PER_ADAPTER = 3  # past this many runs of rows per adapter, one gather per adapter costs less


@dataclass
class LoraBatch:
    """The step's adapters: (slot, rows) per group of batch rows that run one adapter; rows is a
    slice (a run of consecutive rows, read and written in place) or an index tensor (the rows of
    an adapter scattered through the batch). Empty: the base model alone."""

    groups: list[tuple[int, slice | torch.Tensor | None]] = field(default_factory=list)  # None: every row


class LoraSite:
    """One fused layer's slots, and the delta it adds to the layer's output."""

    def __init__(self, layer: torch.nn.Module, slots: int, rank: int, parts: int, batch: LoraBatch) -> None:
        weight = layer.weight
        out, inp = (weight.shape[0], weight.shape[1])
        self.rank, self.batch = rank, batch
        # A^T and B^T, [slots, in, parts * R] and [slots, parts * R, out]; `a` and `b` are each slot's view
        self.At = torch.zeros(slots, inp, parts * rank, dtype=weight.dtype, device=weight.device)
        # B transposed ([slots, parts * R, out]): every slot's B^T stacked is one [slots * parts * R, out] view
        self.Bt = torch.zeros(slots, parts * rank, out, dtype=weight.dtype, device=weight.device)
        self.a, self.b = list(self.At.unbind(0)), list(self.Bt.unbind(0))

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add each adapter's delta to its rows of y (the base output of x, [T, out], a new tensor
        in the layer's compute dtype, which x is in too), in place: a run of rows (or all of them,
        rows None) accumulates into y through addmm_. Few torch calls: a decode step is made of them."""
        for slot, rows in self.batch.groups:
            if rows is None:
                y.addmm_(torch.mm(x, self.a[slot]), self.b[slot])
            elif isinstance(rows, slice):
                y[rows].addmm_(torch.mm(x[rows], self.a[slot]), self.b[slot])
            else:
                y.index_add_(0, rows, torch.mm(torch.mm(x[rows], self.a[slot]), self.b[slot]))


class LoraBank:
    """Every site of a model, the slots they hold and the step's plan they read."""

    def __init__(self, model: torch.nn.Module, slots: int, rank: int, sites: tuple[str, ...], host_copies: int) -> None:
        """host_copies: adapters whose tensors stay in host memory after their first read (SGLang's
        CPU-side copies of the loaded adapters), least recently loaded out first."""
        self.model, self.slots, self.rank = model, slots, rank
        self.host: OrderedDict[str, Future[dict[str, tuple[torch.Tensor, torch.Tensor]]]] = OrderedDict()
        self.host_copies = host_copies
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="radixrt-lora-read")
        self.batch = LoraBatch()
        self.sites: dict[str, LoraSite] = {}
        for name, module in model.named_modules():
            site = name.rsplit(".", 1)[-1]
            if site in sites and hasattr(module, "weight") and name.startswith("layers."):
                module.lora = self.sites[name] = LoraSite(module, slots, rank, SITE_PARTS[site], self.batch)

    def nbytes(self) -> int:
        return sum(s.At.nbytes + s.Bt.nbytes for s in self.sites.values())

    def plan(self, row_slots: list[int], device: torch.device) -> None:
        """row_slots: each batch row's adapter slot (-1: the base model) -> the step's groups: one
        slice per run of rows of one adapter (the scheduler puts decodes of one adapter together,
        and a prefill chunk is a run), or, when the runs are many, one gather per adapter."""
        self.batch.groups.clear()
        slots = set(row_slots) - {-1}
        if not slots:
            return
        runs, start = [], 0
        for slot, run in itertools.groupby(row_slots):
            n = len(list(run))
            if slot >= 0:
                runs.append((slot, slice(start, start + n)))
            start += n
        if len(runs) == 1 and runs[0][1] == slice(0, len(row_slots)):  # one adapter for every row
            self.batch.groups.append((runs[0][0], None))
        elif len(runs) <= MAX_RUNS_PER_ADAPTER * len(slots):
            self.batch.groups.extend(runs)
        else:
            t = torch.tensor(row_slots, device=device)
            self.batch.groups.extend((slot, torch.nonzero(t == slot).flatten()) for slot in sorted(slots))

    def clear_plan(self) -> None:
        self.batch.groups.clear()

    def load(self, slot: int, adapter: AdapterConfig) -> None:
        """Fill slot with the adapter's tensors (this rank's shards); the slot's old ones are zeroed
        first. Raises AdapterError naming a module the adapter has and this model does not."""
        for site in self.sites.values():
            site.At[slot].zero_()
            site.Bt[slot].zero_()
        for module, (a, b) in self._pairs(adapter).items():
            self._load_module(slot, adapter, module, a, b)

    def read(self, adapter: AdapterConfig) -> Future:
        """Start reading the adapter's tensors into host memory (a thread; at once if already there)."""
        key = f"{adapter.name}@{adapter.fingerprint}"
        if key not in self.host:
            self.host[key] = self._reader.submit(_lora_pairs, adapter)
            while len(self.host) > self.host_copies:
                self.host.popitem(last=False)
        self.host.move_to_end(key)
        return self.host[key]

    def _pairs(self, adapter: AdapterConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        try:
            return self.read(adapter).result()  # waits only for a read still under way
        except Exception:
            self.host.pop(f"{adapter.name}@{adapter.fingerprint}", None)  # the next load reads again
            raise

    def _load_module(self, slot: int, adapter: AdapterConfig, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        model, r = self.model, a.shape[0]
        fused = getattr(model, "FUSED", {})
        for name, source in model.checkpoint_tensors([(module + ".weight", b)]):
            target, dst_rows, src_index = model._shard_plan(name)
            site = self.sites.get(target.removesuffix(".weight"))
            if site is None:
                raise AdapterError(f"LoRA adapter {adapter.name!r}: module {module!r} has no LoRA site in this "
                                   f"{type(model).__name__} (MoE experts and routers are not supported)")
            part = fused.get(name.split(".")[-2], (None, 0))[1]
            ranks = slice(part * self.rank, part * self.rank + r)
            if len(src_index) == 2:  # row-parallel: this rank's input columns of A, all of B
                site.At[slot, :, ranks] = a[src_index].T.to(site.At.dtype)
                site.Bt[slot, ranks] = (source[src_index[:1]] * adapter.scaling).T.to(site.Bt.dtype)
            else:
                site.At[slot, :, ranks] = a.T.to(site.At.dtype)
                site.Bt[slot, ranks, dst_rows] = (source[src_index] * adapter.scaling).T.to(site.Bt.dtype)


def lora_pool_bytes(cfg: ModelConfig, tp: TPGroup, slots: int, rank: int, sites: tuple[str, ...], itemsize: int) -> int:
    """Bytes of one rank's LoraBank (`radixrt estimate` counts them): per layer and site, A and B
    of every slot, in this rank's shard of the layer's shape."""
    _, heads, _, kv_heads = rank_heads(cfg, tp)
    inter = cfg.intermediate_size // tp.size
    d, h = cfg.head_dim, cfg.hidden_size
    shapes = {"qkv_proj": (h, (heads + 2 * kv_heads) * d), "o_proj": (heads * d, h),
              "gate_up_proj": (h, 2 * inter), "down_proj": (inter, h)}  # site -> (in, out) on this rank
    total = 0
    for layer in range(cfg.num_layers):
        sparse = cfg.moe is not None and layer in cfg.moe.layers
        for site in sites:
            if sparse and site in ("gate_up_proj", "down_proj"):
                continue
            inp, out = shapes[site]
            total += slots * SITE_PARTS[site] * rank * (inp + out)
    return total * itemsize


def _lora_pairs(adapter: AdapterConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name (as the model names it, e.g. layers.0.self_attn.q_proj) -> (A [r, in], B [out, r])."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(f"{adapter.path}/{ADAPTER_WEIGHTS}", framework="pt") as f:
        for key in f.keys():
            name = key.removeprefix(PEFT_PREFIX).removeprefix("model.")
            module, _, kind = name.rpartition(".lora_")
            if kind not in ("A.weight", "B.weight"):
                raise AdapterError(f"LoRA adapter {adapter.name!r}: tensor {key!r} is not a LoRA A or B weight")
            found.setdefault(module, {})[kind[0]] = f.get_tensor(key).float()
    pairs = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {adapter.name!r}: module {module!r} lacks its lora_A or lora_B")
        if ab["A"].shape[0] != adapter.rank or ab["B"].shape[1] != adapter.rank:
            raise AdapterError(f"LoRA adapter {adapter.name!r}: module {module!r} is not of rank {adapter.rank}")
        pairs[module] = (ab["A"], ab["B"])
    return pairs
