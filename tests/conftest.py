"""Shared fixtures: the tiny checkpoints (built once, deterministically) and engines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from make_tiny_model import ensure_model  # noqa: E402

FAMILIES = ("llama", "qwen2")


@pytest.fixture(scope="session")
def model_paths() -> dict[str, Path]:
    return {family: ensure_model(family) for family in FAMILIES}


@pytest.fixture(scope="session")
def llama_path(model_paths) -> Path:
    return model_paths["llama"]
