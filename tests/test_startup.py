"""Start-up as a user meets it: the README's Engine example runs as a plain script, and a
mistake at start-up (a hub id, a missing path, a bad flag, an unsupported model) ends in one
line and a non-zero exit, never a traceback, leaving no process behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from support.helpers import all_gone
from support.server_proc import ROOT, free_port

PROG = "radixrt launch_server: error:"


def processes_with_env(marker: str) -> list[int]:
    """Pids of our processes whose environment holds marker (a child inherits it)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def readme_engine_example() -> str:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    [block] = [b for b in blocks if 'radixrt.Engine(model_path="path/to/hf-checkpoint"' in b]
    return block


def test_readme_engine_example_runs_as_a_plain_script(llama_path, tmp_path):
    """No `if __name__ == "__main__":` needed: the children do not re-import the script."""
    script = tmp_path / "example.py"
    script.write_text(readme_engine_example().replace("path/to/hf-checkpoint", str(llama_path)))
    marker = f"RADIXRT_TEST_{uuid.uuid4().hex}"
    env = {**os.environ, marker: "1"}
    cmd = [sys.executable, str(script)]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "'completion_tokens':" in out.stdout, out.stdout  # the greedy answer's meta_info
    assert len(out.stdout.splitlines()) >= 3, out.stdout  # and the stream's chunks after it
    assert all_gone(processes_with_env(marker)), "a radixrt child outlived the script"


def launch(*argv: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "radixrt.launch_server", "--port", str(free_port()), *argv]
    return subprocess.run(cmd, cwd=ROOT / "tests", capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def assert_one_line_error(out: subprocess.CompletedProcess, code: int, *names: str) -> str:
    log = out.stdout + out.stderr
    assert out.returncode == code, log
    assert "Traceback" not in log, log
    [line] = [ln for ln in out.stderr.splitlines() if ln.startswith(PROG)]
    for name in names:
        assert name in line, line
    return line


@pytest.mark.parametrize("case", ["hub id", "missing dir", "no config.json"])
def test_a_model_path_that_is_not_a_checkpoint_is_one_line_before_anything_starts(case, tmp_path):
    path = {"hub id": "Qwen/Qwen2.5-0.5B-Instruct", "missing dir": str(tmp_path / "nope"),
            "no config.json": str(tmp_path)}[case]
    # a repo id is looked up in the Hugging Face cache: an empty one, with downloads off
    hub = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = launch("--model-path", path, timeout=30, env=hub)
    line = assert_one_line_error(out, 2, "model_path", path)
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert ("config.json" if case == "no config.json" else "not a local directory") in line
    if case == "hub id":
        assert all(part in line for part in ("revision main", str(tmp_path / "hub"), "HF_HUB_OFFLINE")), line


def test_a_bad_tokenizer_path_is_one_line(llama_path, tmp_path):
    out = launch("--model-path", str(llama_path), "--tokenizer-path", str(tmp_path / "nope"), timeout=30)
    assert_one_line_error(out, 2, "tokenizer_path")


@pytest.mark.parametrize(("argv", "names"), [
    (["--page-size", "0"], ["page_size", "0"]),
    (["--port", "abc"], ["--port", "abc"]),
])
def test_a_bad_flag_is_one_line_without_the_usage(llama_path, argv, names):
    out = launch("--model-path", str(llama_path), *argv, timeout=30)
    assert_one_line_error(out, 2, *names)
    assert "usage:" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr


@pytest.mark.parametrize("config", ["gpt2's own", "llama's with model_type gpt2"])
def test_an_unsupported_model_fails_in_the_worker_and_the_parent_says_so_in_one_line(config, llama_path, tmp_path):
    if config == "gpt2's own":
        cfg = {"model_type": "gpt2", "n_head": 2, "n_embd": 64, "n_layer": 2, "activation_function": "gelu_new"}
    else:
        cfg = {**json.loads((llama_path / "config.json").read_text()), "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = launch("--model-path", str(tmp_path), timeout=120)
    line = assert_one_line_error(out, 1, "worker 0 failed to start", "ValueError")
    assert ("'gpt2'" in line) and ("not supported" in line or "Llama-family" in line), line

