"""The cache_aware router's thresholds: ServerArgs settings with SGLang's --router-* names,
validated, and on the router's command line as the router's own parser reads them. No processes."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from radixrt.cli_args import add_server_args, server_args_from
from radixrt.config import ServerArgs
from radixrt.launch.router import router_command

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def flag_value(cmd: list[str], flag: str) -> str:
    assert cmd.count(flag) == 1, f"{flag} given {cmd.count(flag)} times: {cmd}"
    return cmd[cmd.index(flag) + 1]


def test_router_command_passes_the_default_thresholds():
    cmd = router_command(ServerArgs(model_path="m", dp_size=2), URLS, "cache_aware", 9000)
    assert flag_value(cmd, "--cache-threshold") == "0.3"
    assert flag_value(cmd, "--balance-abs-threshold") == "2"  # sglang_router's own default is 64
    assert flag_value(cmd, "--balance-rel-threshold") == "1.5"


def test_launch_server_flags_reach_the_router_command():
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = server_args_from(parser.parse_args([
        "--model-path", "m", "--dp-size", "2", "--router-cache-threshold", "0.5",
        "--router-balance-abs-threshold", "0", "--router-balance-rel-threshold", "1.0",
    ]))
    cmd = router_command(args, URLS, "cache_aware", 9000)
    assert [flag_value(cmd, f) for f in ("--cache-threshold", "--balance-abs-threshold", "--balance-rel-threshold")] == [
        "0.5", "0", "1.0"]


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                    reason="the router extra is not installed: pip install 'radixrt[router]'")
def test_the_router_parses_our_command_line_into_the_thresholds():
    from sglang_router.router_args import RouterArgs

    args = ServerArgs(model_path="m", dp_size=2, router_cache_threshold=0.25, router_balance_abs_threshold=7,
                      router_balance_rel_threshold=1.25)
    cmd = router_command(args, URLS, "cache_aware", 9000)
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    parsed = RouterArgs.from_cli_args(parser.parse_args(cmd[cmd.index("--host"):]))
    assert (parsed.cache_threshold, parsed.balance_abs_threshold, parsed.balance_rel_threshold) == (0.25, 7, 1.25)
    assert parsed.worker_urls == URLS and parsed.policy == "cache_aware"


@pytest.mark.parametrize("kwargs, words", [
    ({"router_cache_threshold": 1.5}, "router_cache_threshold must be in"),
    ({"router_cache_threshold": -0.1}, "router_cache_threshold must be in"),
    ({"router_balance_abs_threshold": -1}, "router_balance_abs_threshold must be >= 0"),
    ({"router_balance_rel_threshold": 0.5}, "router_balance_rel_threshold must be >= 1"),
])
def test_bad_thresholds_name_the_argument(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ServerArgs(model_path="m", dp_size=2, **kwargs)
