"""scripts/gpu_check.sh --dry-run: everything the device run does up to the GPU, checked here
without a GPU, .whl/ or the network, and each of its inputs broken in turn.

The dry run installs radixrt (built from a copy of what the device tool carries) with the device's
recipe into a temporary target, lists the FlashInfer modules the run needs (constructing their
JitSpecs where flashinfer-python imports), collects the `cuda`-marked tests, and sizes the carry.
A broken input fails its step by name and the run's exit status, and never stops the later steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def dry_run(steps: str | None = None, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, **env}
    full_env.pop("OUT", None)  # the dry run's log goes to its own temporary folder
    if steps is not None:
        full_env["STEPS"] = steps
    return subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=300)


def summary(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def full_dry_run() -> subprocess.CompletedProcess:
    return dry_run()


def test_dry_run_checks_every_step_and_exits_0(full_dry_run):
    out = full_dry_run.stdout
    assert full_dry_run.returncode == 0, out + full_dry_run.stderr
    assert "gpu_check (dry): 4 of 4 steps ok" in summary(full_dry_run)
    for line in (
        "install: radixrt wheel built from the tree: radixrt-",
        "install: the 11 wheels the image lacks are each in the wheel recipe scripts/gpu_wheels.sh",
        "install: radixrt, radixrt.kernels and radixrt.lang import from ",
        "jit: 13 attention modules from 6 shapes",
        "tests: marker expression 'cuda', registered in pyproject.toml",
        "tests: the selection has tests naming each of: fp8 tensor_core graph",
        "carry: the tree (",
    ):
        assert line in out, line
    # flashinfer-python is not installed here: said so, and its inputs checked instead
    assert ("no JitSpec was constructed" in out) or ("JitSpecs constructed (not compiled)" in out)
    selected = [ln.strip() for ln in out.splitlines() if ln.startswith("  tests/") and "::" in ln]
    assert "tests/test_cuda.py::test_tensor_core_decode_graphs_match_the_torch_backend[fp8_e4m3]" in selected
    assert any("test_torch_backend.py" in t and "flashinfer" in t for t in selected)
    assert not any("test_torch_backend.py" in t and t.endswith("-torch]") for t in selected)  # its CPU cases
    for step in ("install", "jit", "tests", "carry"):
        assert f"\n{step}: ok (" in out, step


def test_a_wheel_the_recipe_does_not_fetch_fails_install(tmp_path):
    recipe = tmp_path / "gpu_wheels.sh"
    recipe.write_text((ROOT / "scripts" / "gpu_wheels.sh").read_text().replace("flashinfer-python==0.6.13", ""))
    proc = dry_run("install", WHEEL_RECIPE=str(recipe))
    assert proc.returncode == 1
    assert f"install: FAILED: no wheel for flashinfer-python in the wheel recipe {recipe}" in proc.stdout
    assert "0 of 1 steps ok" in summary(proc) and summary(proc).endswith("FAILED: install")


def test_a_requirement_neither_the_image_nor_the_wheels_provide_fails_install():
    wheels = "flashinfer-python apache-tvm-ffi msgspec fastapi uvicorn starlette pydantic pydantic-core annotated-types typing-inspection"
    proc = dry_run("install", DEVICE_WHEELS=wheels)  # pyzmq left out
    assert proc.returncode == 1
    assert "install: FAILED: radixrt needs pyzmq on the device" in proc.stdout and "FAILED: install" in summary(proc)


def test_each_bad_spec_input_is_named():
    bad = {
        "8/2/48 bf16 bf16 full": "head_dim 48: FlashInfer's kernels take 64, 128, 256",
        "8/2/64 fp32 bf16 full": "dtype 'fp32' is none of bf16, fp16, fp8_e4m3, fp8_e5m2",
        "8/3/64 bf16 bf16 full": "8 query heads over 3 KV heads",
        "8/2/64 bf16 fp16 full": "kv dtype torch.float16: FlashInfer reads the model's dtype (torch.bfloat16) or fp8",
        "8/2/64 bf16 bf16 sliding": "kind 'sliding' is none of full, window, cap, window+cap",
        "8/2 bf16 bf16 full": "want: heads/kv_heads/head_dim q_dtype kv_dtype kinds",
    }
    proc = dry_run("jit", JIT_SHAPES="\n".join(["16/8/128 bf16 bf16 full", *bad]))
    assert proc.returncode == 1 and "FAILED: jit" in summary(proc)
    for shape, why in bad.items():  # every bad line, not only the first
        assert f"jit: FAILED: shape {shape!r}: {why}" in proc.stdout, shape


def test_an_unregistered_marker_fails_tests():
    proc = dry_run("tests", CUDA_MARK="gpu")
    assert proc.returncode == 1
    assert "tests: FAILED: CUDA_MARK 'gpu' names gpu, not registered in pyproject.toml (cuda, e2e, unit)" in proc.stdout
    assert "FAILED: tests" in summary(proc)


def test_an_oversize_carry_fails_carry_naming_the_largest_file(tmp_path):
    big = tmp_path / "carried"
    big.mkdir()
    with open(big / "weights.bin", "wb") as f:
        f.truncate(50 * 2**20)  # sparse: its size without the disk or the time
    proc = dry_run("carry", CARRY=f".whl {big}")
    assert proc.returncode == 1
    assert "carry: FAILED:" in proc.stdout and "over the 64 MiB limit" in proc.stdout
    assert f"{big / 'weights.bin'} (50.0 MiB)" in proc.stdout and "FAILED: carry" in summary(proc)


def test_a_failed_step_does_not_stop_the_next_and_unknown_steps_are_refused():
    proc = dry_run("tests,carry", CUDA_MARK="gpu")
    assert proc.returncode == 1 and "\ncarry: ok (" in proc.stdout
    assert "1 of 2 steps ok" in summary(proc) and summary(proc).endswith("FAILED: tests")
    proc = dry_run("install,decode")
    assert proc.returncode == 2 and "unknown step 'decode' for this mode; steps: install,jit,tests,carry" in proc.stderr


def test_jit_modules_follow_the_kernels_flashinfer_plans():
    """The precompile list is FlashInferBackend's own choice (radixrt/kernels/flashinfer_backend.py): CUDA-core
    decode below a GQA group of 4, the fa2 prefill kernel for decode at 4 and above, fa3 prefill on
    SM90 when q and KV share a 16-bit dtype, windows and caps as compile-time variants."""
    import torch
    from radixrt.kernels import LayerAttention
    from radixrt.kernels.flashinfer_backend import JitModule, jit_modules

    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    full, local = LayerAttention(0.1), LayerAttention(0.1, window=8, softcap=2.0)
    mod = lambda kind, backend, kv=bf16, hd=64, w=False, c=False: JitModule(kind, backend, bf16, kv, hd, w, c)  # noqa: E731
    assert jit_modules(12, 4, 64, bf16, bf16, [full, full]) == [mod("decode", ""), mod("prefill", "fa3")]
    assert jit_modules(8, 2, 128, bf16, bf16, [full]) == [mod("prefill", "fa2", hd=128), mod("prefill", "fa3", hd=128)]
    assert jit_modules(8, 2, 64, bf16, e4m3, [full]) == [mod("prefill", "fa2", kv=e4m3)]  # fa3 wants an fp8 query
    assert jit_modules(4, 2, 64, bf16, e4m3, [full]) == [mod("decode", "", kv=e4m3), mod("prefill", "fa2", kv=e4m3)]
    assert jit_modules(12, 4, 64, bf16, bf16, [full], sm90=False) == [mod("decode", ""), mod("prefill", "fa2")]
    assert jit_modules(8, 2, 64, bf16, bf16, [local, full, local]) == [
        mod("prefill", "fa2", w=True, c=True), mod("prefill", "fa3", w=True, c=True), mod("prefill", "fa2"), mod("prefill", "fa3")]
    with pytest.raises(ValueError, match="head_dim 96"):
        jit_modules(8, 2, 96, bf16, bf16, [full])
    with pytest.raises(ValueError, match="dtype torch.float32"):
        jit_modules(8, 2, 64, torch.float32, torch.float32, [full])
