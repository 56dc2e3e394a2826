"""Server arguments: one frozen dataclass assembled from each feature's settings
(radixrt/settings/), validated at construction.

Field names are SGLang's (snake_case of the CLI flags). `ServerArgs.from_kwargs`
rejects unknown names, so a typo is an error rather than a silent default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from radixrt.retention.policies import wants_mass
from radixrt.settings.cache import CacheArgs
from radixrt.settings.chat import ChatArgs
from radixrt.settings.constrained import ConstrainedArgs
from radixrt.settings.distributed import DistributedArgs
from radixrt.settings.hicache import HiCacheArgs
from radixrt.settings.http import HttpArgs
from radixrt.settings.kv import KVArgs
from radixrt.settings.lora import LoraArgs
from radixrt.settings.model import ModelArgs
from radixrt.settings.pooling import PoolingArgs
from radixrt.settings.quant import QuantArgs
from radixrt.settings.retention import RetentionArgs
from radixrt.settings.scheduling import SchedulingArgs
from radixrt.settings.speculative import SpeculativeArgs

_NOT_WITH_LORA = {"speculative_algorithm": "speculative decoding", "quantization": "a quantized base model"}


# A dataclass takes its bases' fields from the last base to the first: the CLI lists ModelArgs' first.
@dataclass(frozen=True)
class ServerArgs(SpeculativeArgs, HiCacheArgs, RetentionArgs, DistributedArgs, ConstrainedArgs, PoolingArgs, ChatArgs,
                 CacheArgs, LoraArgs, SchedulingArgs, KVArgs, QuantArgs, HttpArgs, ModelArgs):
    def __post_init__(self) -> None:
        for feature in FEATURES:
            feature.check(self)
        self._check_across()

    def _check_across(self) -> None:
        """The rules that tie two features together."""
        if self.enable_lora:
            for flag, what in _NOT_WITH_LORA.items():
                if getattr(self, flag):
                    raise ValueError(f"--enable-lora cannot be combined with {what} (--{flag.replace('_', '-')} "
                                     f"{getattr(self, flag)}): radixrt's LoRA adds to full-precision base layers "
                                     "only, and its drafts would not see the adapter")
            # the per-step adapter groups are not graph-capturable: decode runs eagerly under LoRA
            object.__setattr__(self, "disable_cuda_graph", True)
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache needs the radix cache; drop disable_radix_cache")
        if wants_mass(self.retention.policy) and self.attention_backend == "flashinfer":
            raise ValueError("kv_retention heavy_hitter needs per-page attention mass, which the flashinfer backend "
                             "does not report: use attention_backend torch, or kv_retention sink_window")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)


FEATURES = tuple(reversed(ServerArgs.__bases__))  # each feature's settings, in the order their checks run
