"""Shared fixtures: the tiny checkpoints (built once, deterministically) and the one server
that several modules test against."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

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


@pytest.fixture(scope="session")
def server(llama_path) -> Iterator[str]:
    """The URL of a server on the tiny llama with SERVER_ARGS, started once for every module that
    tests against a default server (test_server, test_lang, ...) and stopped at the session's end.
    A module that needs other flags defines its own `server` fixture, which overrides this one."""
    from server_proc import SERVER_ARGS, running_server  # here: it imports torch (via helpers), which CPU-only sessions skip

    with running_server(llama_path, *SERVER_ARGS) as (url, _):
        yield url
