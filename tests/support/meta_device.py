"""A ModelRunner on the `meta` device standing in for a GPU, with FlashInfer faked: shapes without
data, so anything a step reads back from the device shows up (tests/test_host_syncs.py says how)."""

from __future__ import annotations

import sys
import traceback
import types
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from radixrt.kernels import flashinfer_backend as fb

DEVICE = torch.device("meta")  # the stand-in GPU
PAGE = 4

# Tensor functions that copy device data to the host (or need its values to size their output).
READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
    torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
    torch.Tensor.masked_select, torch.masked_select, torch.Tensor.unique, torch.unique, torch.equal, torch.allclose,
}


def on_device(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


def is_read(func, args: tuple, kwargs: dict) -> bool:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if func in READS:
        return any(on_device(t) for t in tensors)
    if func is torch.Tensor.to:  # .to("cpu") / .to(torch.device("cpu")) of a device tensor
        target = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
        return on_device(args[0]) and any(torch.device(t).type == "cpu" for t in target)
    if func is torch.Tensor.copy_:  # a host tensor filled from a device one
        return not on_device(args[0]) and on_device(args[1])
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):  # a boolean mask index syncs for its size
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(on_device(i) and i.dtype == torch.bool for i in index)
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):  # tensor repeats without output_size
        return on_device(args[1] if len(args) > 1 else kwargs.get("repeats")) and kwargs.get("output_size") is None
    return False


def where() -> str:
    """The innermost caller outside torch and this file's recorder."""
    for frame in reversed(traceback.extract_stack()[:-2]):  # less where() and __torch_function__
        if "/torch/" not in frame.filename:
            return f"{'/'.join(frame.filename.rsplit('/', 2)[-2:])}:{frame.lineno} {frame.line}"
    return "?"


def stand_in(func, args: tuple) -> Any:
    """Something of the right kind to go on with (the meta tensor has no values to give)."""
    t = args[0]
    if func in (torch.Tensor.__bool__, torch.equal, torch.allclose):
        return True
    if func in (torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__index__):
        return 1
    if func is torch.Tensor.__float__:
        return 1.0
    if func is torch.Tensor.tolist:
        return torch.ones(t.shape, dtype=torch.int64).tolist()
    if func is torch.Tensor.__getitem__:
        return t.flatten()
    if func is torch.Tensor.copy_:
        return t
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
        return t
    return torch.ones(t.shape, dtype=t.dtype)  # .cpu(), .to("cpu"), .numpy()-like reads


class DeviceReads(TorchFunctionMode):
    """Records every device-to-host read (and the sampler's mark) in order."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_read(func, args, kwargs):
            self.events.append(f"{getattr(func, '__name__', func)} at {where()}")
            return stand_in(func, args)
        return func(*args, **kwargs)

    def before_sample(self) -> list[str]:
        return self.events[: self.events.index(SAMPLED)] if SAMPLED in self.events else self.events


SAMPLED = "-- the sampled ids --"


class RecordingWrapper:
    """flashinfer.Batch{Decode,Prefill}WithPagedKVCacheWrapper as far as plan() and run() go."""

    def __init__(self, workspace, layout, use_cuda_graph=False, use_tensor_cores=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None, **_) -> None:
        self.graph = use_cuda_graph
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.plans: list[dict[str, torch.Tensor]] = []

    def plan(self, *args, **kwargs) -> None:
        names = ("qo_indptr", "indptr", "indices", "last_page_len") if len(args) == 8 else ("indptr", "indices", "last_page_len")
        csr = dict(zip(names, args))
        self.plans.append(csr)
        if self.graph:  # into the captured buffers (host -> device, device -> device)
            indptr_buf, indices_buf, last_buf = self.buffers
            indptr_buf.copy_(csr["indptr"])
            last_buf.copy_(csr["last_page_len"])
            indices_buf[: len(csr["indices"])].copy_(csr["indices"])
        for name in ("qo_indptr", "indptr", "last_page_len"):  # FlashInfer 0.6.13 plans from these on the CPU
            if name in csr:
                csr[name].to("cpu")

    def run(self, q: torch.Tensor, kv, k_scale=None, v_scale=None) -> torch.Tensor:
        return torch.empty_like(q)


class MarkingSampler:
    """The sampler's place in the step: it marks where the sampled ids are read back."""

    reads: DeviceReads | None = None

    def __init__(self, max_slots: int, vocab_size: int, device: torch.device) -> None:
        pass

    def add(self, *args, **kwargs) -> None:
        pass

    def remove(self, slot: int) -> None:
        pass

    def sample_isolated(self, logits: torch.Tensor, slots: list[int]):
        assert self.reads is not None
        self.reads.events.append(SAMPLED)
        return types.SimpleNamespace(ids=[0] * len(slots), errors={})


def make_meta_runner(model_path, monkeypatch, **args):
    """A ModelRunner whose device is `meta` (standing in for CUDA), with FlashInfer faked and its
    sampler marking where the sampled ids are read. args: ServerArgs fields beyond the defaults here."""
    from radixrt.config import ServerArgs
    from radixrt.models.registry import MODEL_FAMILIES
    from radixrt.worker import model_runner as mr
    from radixrt.worker import runner_setup

    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = fake.BatchPrefillWithPagedKVCacheWrapper = RecordingWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(fb, "DEVICE_TYPES", ("cuda", "meta"))
    monkeypatch.setattr(runner_setup, "resolve_device", lambda name: DEVICE)

    def meta_model(path, cfg, dtype, device, tp, scheme):  # the shapes alone: meta tensors hold no weights
        with torch.device(device):
            return MODEL_FAMILIES[cfg.model_type](cfg, tp).to(dtype=dtype).eval()

    monkeypatch.setattr(runner_setup, "load_model", meta_model)
    monkeypatch.setattr(mr, "Sampler", MarkingSampler)
    defaults = dict(device="cpu", attention_backend="flashinfer", page_size=PAGE, max_total_tokens=512, max_running_requests=8)
    return mr.ModelRunner(ServerArgs(model_path=str(model_path), **{**defaults, **args}))
