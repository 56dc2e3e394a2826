"""The choice of a compiled attention variant per shape class (kernels/kernel_choice.py): measured
on a probe of the model's shape, a variant that disagrees with the scalar reference never chosen,
the result cached by CPU, builds, shape and threads, and RADIXRT_CPU_KERNEL_ISA forcing one."""

from __future__ import annotations

import json

import pytest
import torch
from radixrt.kernels import kernel_choice
from radixrt.kernels.kernel_choice import CLASSES, Shape, choose_kernels, measure, pick
from radixrt.kernels.native_attention import build_variant
from radixrt.kernels.native_build import ISA_ENV, runnable_isas
from support.kernels import require_native

SHAPE = Shape(heads=6, kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)


class Wrong:
    """A kernel that answers a little off: what a broken variant would return."""

    def __init__(self, real) -> None:
        self.real, self.isa, self.lib = real, real.isa, real.lib

    def __call__(self, *args, **kwargs):
        out, lse = self.real(*args, **kwargs)
        return out + 0.1, lse


@pytest.fixture
def variants(monkeypatch, tmp_path) -> dict:
    """Every variant this CPU runs, built; choices cached under tmp_path; nothing forced."""
    require_native()
    monkeypatch.delenv(ISA_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return {isa.name: build_variant(isa) for isa in runnable_isas() if SHAPE.head_dim % isa.lanes == 0}


def test_pick_takes_the_fastest_only_past_the_margin():
    assert pick({"avx512bf16": 1.0, "avx512": 0.5, "avx2": 0.7}, "avx512bf16") == "avx512"
    assert pick({"avx512bf16": 1.0, "avx512": 0.97}, "avx512bf16") == "avx512bf16"  # noise: the flags' best stays
    assert pick({"avx512bf16": 1.0, "avx512": 1.2}, "avx512bf16") == "avx512bf16"


def test_every_class_gets_a_measured_variant_and_a_wrong_one_is_dropped(variants):
    if len(variants) < 2:
        pytest.skip(f"this CPU runs one variant ({', '.join(variants)}): there is nothing to choose between")
    best = next(iter(variants))
    kernels = {"wrong": Wrong(variants[best]), **variants}
    names, ms, dropped = measure(kernels, SHAPE)
    assert set(dropped) == {"wrong"} and "differs from the scalar variant's" in dropped["wrong"]
    timed = {n for n in variants if n != "scalar"}
    for c in CLASSES:
        assert set(ms[c]) == timed and all(t > 0 for t in ms[c].values())
        assert names[c] == pick(ms[c], next(n for n in variants if n != "scalar"))


def test_the_choice_is_cached_by_cpu_builds_and_shape(variants, monkeypatch, tmp_path):
    if len(variants) < 2:
        pytest.skip(f"this CPU runs one variant ({', '.join(variants)}): nothing is measured")
    first = choose_kernels(SHAPE)
    assert first.reason.startswith("measured at start")
    [path] = list((tmp_path / "radixrt" / "kernels").glob("attention-choice-*.json"))
    assert json.loads(path.read_text())["choice"] == first.names()
    monkeypatch.setattr(kernel_choice, "measure", lambda *a: pytest.fail("measured again despite the cache"))
    again = choose_kernels(SHAPE)
    assert again.names() == first.names() and again.reason.startswith("measured at an earlier start")
    # another shape is another key; a cache naming a variant not at hand, or unreadable, is measured anew
    calls = []

    def fake_measure(kernels, shape):
        calls.append(shape)
        return {c: "scalar" for c in CLASSES}, {c: {"scalar": 1.0} for c in CLASSES}, {}

    monkeypatch.setattr(kernel_choice, "measure", fake_measure)
    other = Shape(8, 2, 64, 1, torch.bfloat16)
    assert choose_kernels(other).names() == {c: "scalar" for c in CLASSES} and calls == [other]
    path.write_text("{not json")
    choose_kernels(SHAPE)
    assert calls == [other, SHAPE]


def test_a_forced_variant_serves_every_class_unmeasured(variants, monkeypatch):
    name = list(variants)[-1]
    monkeypatch.setenv(ISA_ENV, name)
    monkeypatch.setattr(kernel_choice, "measure", lambda *a: pytest.fail("a forced variant is not measured"))
    choice = choose_kernels(SHAPE)
    assert choice.names() == {c: name for c in CLASSES} and choice.reason == f"{ISA_ENV}={name}"
