"""The DSL from a torch-free install: a fresh venv, `pip install <repo>` (the base install, no
extras), a program run against the session's shared server (started from the dev venv).

The base install is the client (the DSL and its HTTP backend); the serving runtime's
dependencies (torch, transformers, ...) come with the `srt` extra: `pip install radixrt[srt]`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a source install needs; copied so the build never writes build/ or *.egg-info into the repo.
PROJECT_FILES = ("pyproject.toml", "README.md", "radixrt")
SERVER_ONLY = {"torch", "transformers", "tokenizers", "safetensors", "pyzmq", "uvloop", "fastapi", "uvicorn"}

PROGRAM = r'''
import json, sys
import radixrt as rt

@rt.function
def qa(s, question):
    s += rt.system("You are brief.")
    s += rt.user(question)
    s += rt.assistant(rt.gen("answer", max_tokens=8, temperature=0))
    s += rt.user("Tea or coffee?")
    s += rt.assistant(rt.select("pick", ["tea", "coffee"]))

rt.set_default_backend(rt.RuntimeEndpoint(sys.argv[1]))
state = qa.run(question="Name a river.")
print(json.dumps({"answer": state["answer"], "pick": state["pick"], "messages": state.messages(),
                  "torch_loaded": "torch" in sys.modules}))
'''


def base_dependencies(pyproject: Path) -> list[str]:
    return tomllib.loads(pyproject.read_text())["project"]["dependencies"]


def requirement_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def copy_project(dst: Path) -> Path:
    dst.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in PROJECT_FILES:
        src = ROOT / name
        shutil.copytree(src, dst / name, ignore=ignore) if src.is_dir() else shutil.copy2(src, dst / name)
    return dst


def clean_env() -> dict[str, str]:
    """This environment without anything that would put the repo or the dev venv on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout)


def make_client_venv(root: Path, project: Path) -> Path:
    """A new venv with the project's base install; its python."""
    out = run([sys.executable, "-m", "venv", str(root / "venv")], root, 120)
    assert out.returncode == 0, out.stderr
    python = root / "venv" / "bin" / "python"
    # --no-build-isolation only where the venv already has a setuptools new enough for the
    # build (pyproject asks >= 68); otherwise pip builds in isolation, fetching setuptools.
    probe = "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 68)"
    isolation = ["--no-build-isolation"] if run([str(python), "-c", probe], root, 60).returncode == 0 else []
    out = run([str(python), "-m", "pip", "install", "--quiet", *isolation, str(project)], root, 900)
    assert out.returncode == 0, out.stdout + out.stderr
    return python


def test_base_install_runs_a_program_without_torch(tmp_path, server):
    heavy = sorted({requirement_name(d) for d in base_dependencies(ROOT / "pyproject.toml")} & SERVER_ONLY)
    # Checked first: with these in the base install, pip would fetch gigabytes and the rest must fail anyway.
    assert not heavy, f"the base install must be the torch-free client; move {heavy} to the [srt] extra"

    python = make_client_venv(tmp_path, copy_project(tmp_path / "src"))
    probe = run([str(python), "-c", "import torch"], tmp_path, 60)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr

    client = run([str(python), "-c", PROGRAM, server], tmp_path, 120)
    reference = run([sys.executable, "-c", PROGRAM, server], tmp_path, 120)  # the dev venv, same server
    assert client.returncode == 0, client.stderr
    assert reference.returncode == 0, reference.stderr
    got, want = json.loads(client.stdout.splitlines()[-1]), json.loads(reference.stdout.splitlines()[-1])

    assert got["torch_loaded"] is False
    assert got["pick"] in ("tea", "coffee")
    assert [m["role"] for m in got["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert got["messages"][2]["content"] == got["answer"]
    assert {k: got[k] for k in ("answer", "pick", "messages")} == {k: want[k] for k in ("answer", "pick", "messages")}
