"""The quantized KV pool's start-up check, and the one fp-versus-quantized comparison.

With kv_cache_dtype int8 or fp8 the worker, before it serves (and before CUDA
graph capture, which folds the fp8 scales in), runs a few prompts twice: once
over a small pool in the model's dtype, once over the real, quantized pool.

  * fp8: each layer's k_scale / v_scale is set from the K/V ranges the fp run
    wrote (16 x amax / the format's largest finite value), unless a scales file
    gives them (`--kv-scales-file`, JSON {"k_scale": [...], "v_scale": [...]},
    one positive number per layer);
  * both: `compare_logits` measures top-1 agreement and the largest
    |delta logprob| of the fp run's top token over every prompt position; the
    worker logs them and refuses to start when agreement is below
    `--kv-quant-min-agreement`.

`compare_at` (behind `compare_logits`) is the project's one definition of "how far
quantized KV moved the model" (bench/kv_quant_quality.py, the tests, this check and
the quality spot checks of worker/spot_check.py use it), and
`teacher_forced_logits` the one way to get every position's logits over a pool.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from radixrt.kernels import AttentionMetadata, PagedKVCache

logger = logging.getLogger(__name__)

# Built-in calibration text: prose, a number-dense table (where quantized KV fails first) and code.
BUILTIN_PROMPTS = (
    "The river ferry crosses twice an hour in summer and once an hour in winter. Its keeper writes the "
    "water level, the wind and the number of passengers in a book that has been kept since the bridge "
    "upstream fell, and on quiet evenings he reads the old entries aloud to anyone waiting on the bank.",
    "Station readings, one row per hour:\n"
    + "\n".join(f"{h:02d}:00 temp={(h * 37) % 29 + 3.5:.1f} rain={(h * 13) % 7 / 10:.1f} "
                f"wind={(h * 53) % 41:d} pressure={1003 + (h * 7) % 19:d}" for h in range(24)),
    "def merge(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
)
CALIBRATION_CHUNK = 32  # prefill chunk: later chunks read the earlier ones back from the pool
MAX_CALIBRATION_TOKENS = 512  # per prompt
# fp8 keeps the same relative precision over its whole normal range, so a scale only decides where
# saturation and subnormals begin. Fitting amax exactly to the largest value clamped K/V the
# calibration had not seen (bench/kv_quant_quality.py on the demo model: e4m3 held-out top-1
# agreement 0.981 against 0.990 with scale 1.0); 16x headroom keeps four binades above the observed
# range and still lifts small-range layers out of the subnormals.
FP8_HEADROOM = 16.0


@dataclass(frozen=True)
class PrecisionReport:
    """How far a candidate run's logits are from the reference's, position by position."""

    positions: int
    top1_agreement: float  # fraction of positions whose argmax is the reference's argmax
    max_abs_dlogprob: float  # largest |logprob difference| of the reference's argmax token
    mean_abs_dlogprob: float

    def __str__(self) -> str:
        return (f"top-1 agreement {self.top1_agreement:.4f} over {self.positions} positions, "
                f"max |dlogprob| {self.max_abs_dlogprob:.4f} (mean {self.mean_abs_dlogprob:.5f})")


def compare_logits(reference: torch.Tensor, candidate: torch.Tensor) -> PrecisionReport:
    """reference, candidate: [N, vocab] logits at the same N positions (same inputs) -> the report,
    measured at the reference's top token."""
    if reference.shape != candidate.shape:
        raise ValueError(f"logits of different shapes: {tuple(reference.shape)} and {tuple(candidate.shape)}")
    ref_lp = torch.log_softmax(reference.float(), -1)
    cand_lp = torch.log_softmax(candidate.float(), -1)
    top = ref_lp.argmax(-1, keepdim=True)  # [N, 1]
    return compare_at(ref_lp.gather(-1, top).squeeze(-1), top.squeeze(-1), cand_lp.gather(-1, top).squeeze(-1),
                      cand_lp.argmax(-1))


def compare_at(ref_logprob: torch.Tensor, ref_top: torch.Tensor, cand_logprob: torch.Tensor,
               cand_top: torch.Tensor) -> PrecisionReport:
    """The comparison itself, over N positions: each run's logprob of the token measured there
    (ref_logprob, cand_logprob: [N] float) and each run's top token (ref_top, cand_top: [N] int).
    compare_logits measures at the reference's top token; a quality spot check
    (worker/spot_check.py) at the token the live server emitted, whose top it was."""
    if not len(ref_logprob) == len(ref_top) == len(cand_logprob) == len(cand_top) > 0:
        raise ValueError(f"positions differ or are none: {len(ref_logprob)}, {len(ref_top)}, {len(cand_logprob)}, "
                         f"{len(cand_top)}")
    delta = (ref_logprob.float() - cand_logprob.float()).abs()  # [N]
    return PrecisionReport(
        positions=len(delta),
        top1_agreement=(cand_top == ref_top).float().mean().item(),
        max_abs_dlogprob=delta.max().item(),
        mean_abs_dlogprob=delta.mean().item(),
    )


@torch.inference_mode()
def teacher_forced_logits(model, attn, seqs: Sequence[Sequence[int]], chunk: int = CALIBRATION_CHUNK) -> list[torch.Tensor]:
    """Every position's logits ([len, vocab] float32 per sequence) of `seqs` run together in prefill
    chunks over attn's pool, sequence i on its own pages from i * pages_per_seq: the pool's first
    pages are overwritten (call it before the pool holds anything)."""
    cache: PagedKVCache = attn.cache
    page = cache.page_size
    pages_per_seq = math.ceil(max(map(len, seqs)) / page)
    if len(seqs) * pages_per_seq > cache.num_pages:
        raise ValueError(f"{len(seqs)} sequences of up to {pages_per_seq} pages do not fit a pool of {cache.num_pages}")
    dev = cache.k[0].device
    table = torch.arange(len(seqs) * pages_per_seq, device=dev).view(len(seqs), pages_per_seq)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for start in range(0, max(map(len, seqs)), chunk):
        live = [i for i, s in enumerate(seqs) if len(s) > start]
        pieces = [list(seqs[i][start : start + chunk]) for i in live]
        qo = [len(p) for p in pieces]
        positions = torch.cat([torch.arange(start, start + n) for n in qo]).to(dev)
        rows = torch.repeat_interleave(torch.tensor(live), torch.tensor(qo)).to(dev)
        slots = table[rows, positions // page] * page + positions % page
        attn.init_forward(AttentionMetadata(qo, [start + n for n in qo], table[live], slots, page))
        ids = torch.tensor([t for p in pieces for t in p], device=dev)
        logits = model.compute_logits(model(ids, positions, attn))
        for i, lg in zip(live, logits.split(qo)):
            out[i].append(lg)
    return [torch.cat(parts) for parts in out]


def calibration_prompts(tokenizer, path: str | None) -> list[list[int]]:
    """Token ids of the calibration prompts: the file's paragraphs (separated by blank lines), or the built-ins."""
    if path is None:
        texts = list(BUILTIN_PROMPTS)
    else:
        texts = [p.strip() for p in Path(path).read_text().split("\n\n") if p.strip()]
        if not texts:
            raise ValueError(f"kv_calibration_file {path} holds no text")
    return [tokenizer.encode(t, add_special_tokens=False)[:MAX_CALIBRATION_TOKENS] for t in texts]


def read_scales(path: str, num_layers: int) -> tuple[list[float], list[float]]:
    """The fp8 per-layer scales of a scales file, checked: one finite, positive number per layer for K and V."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or set(data) != {"k_scale", "v_scale"}:
        raise ValueError(f"kv_scales_file {path}: expected a JSON object with exactly 'k_scale' and 'v_scale'")
    for key in ("k_scale", "v_scale"):
        values = data[key]
        if not isinstance(values, list) or len(values) != num_layers:
            raise ValueError(f"kv_scales_file {path}: {key} must list {num_layers} numbers (one per layer)")
        bad = [i for i, v in enumerate(values) if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0]
        if bad:
            raise ValueError(f"kv_scales_file {path}: {key} of layer(s) {bad} is not a finite positive number")
    return [float(v) for v in data["k_scale"]], [float(v) for v in data["v_scale"]]


def fit_fp8_scales(reference: PagedKVCache, storage: torch.dtype) -> tuple[list[float], list[float]]:
    """Per layer FP8_HEADROOM * amax / storage's largest finite value, over a zero-filled fp pool the
    calibration wrote: the observed range sits FP8_HEADROOM below saturation."""
    fmax = torch.finfo(storage).max

    def scale(buf: torch.Tensor) -> float:
        amax = buf.abs().max().item()
        return FP8_HEADROOM * amax / fmax if amax > 0 else 1.0

    return [scale(k) for k in reference.k], [scale(v) for v in reference.v]


class KVCalibrationError(RuntimeError):
    """The quantized pool moved the model further than --kv-quant-min-agreement allows."""


def check_quantized_pool(
    model, attn, make_attn: Callable[[PagedKVCache], object], prompts: list[list[int]],
    scales_file: str | None, min_agreement: float,
) -> PrecisionReport:
    """Run `prompts` over a model-dtype pool and over attn's quantized pool (setting fp8 scales in
    between) and compare; raise KVCalibrationError below min_agreement. make_attn builds an
    attention backend over another pool."""
    cache: PagedKVCache = attn.cache
    num_layers, page, kv_heads, head_dim = len(cache.k), cache.page_size, cache.num_kv_heads, cache.head_dim
    share = cache.num_pages // len(prompts) * page  # the prompts run side by side: a small pool shortens them
    if share < 1:
        raise ValueError(f"a pool of {cache.num_pages} pages cannot hold {len(prompts)} calibration prompts")
    prompts = [p[:share] for p in prompts]
    pages = len(prompts) * math.ceil(max(map(len, prompts)) / page)
    reference = PagedKVCache(num_layers, pages, page, kv_heads, head_dim, cache.dtype, cache.k[0].device)
    for buf in reference.buffers:
        buf.zero_()  # fit_fp8_scales reads whole buffers: unwritten slots must not count
    ref_logits = teacher_forced_logits(model, make_attn(reference), prompts)
    if cache.layer_scaled:
        k_scale, v_scale = read_scales(scales_file, num_layers) if scales_file else fit_fp8_scales(reference, cache.storage_dtype)
        cache.k_scale[:], cache.v_scale[:] = k_scale, v_scale
        logger.info("%s per-layer scales (%s): k %s, v %s", cache.kv_dtype, scales_file or "calibrated",
                    [f"{x:.3g}" for x in k_scale], [f"{x:.3g}" for x in v_scale])
    report = compare_logits(torch.cat(ref_logits), torch.cat(teacher_forced_logits(model, attn, prompts)))
    logger.info("kv_cache_dtype %s against %s KV: %s", cache.kv_dtype, cache.dtype, report)
    if report.top1_agreement < min_agreement:
        raise KVCalibrationError(
            f"kv_cache_dtype {cache.kv_dtype}: the start-up check measured {report} against {cache.dtype} KV; "
            f"agreement is below kv_quant_min_agreement {min_agreement}. Use a more precise kv_cache_dtype "
            f"(int8 or auto), give scales that fit the model with kv_scales_file, or lower kv_quant_min_agreement."
        )
    return report
