"""The small views of ServerArgs: each field is a ServerArgs setting of the same name and type, copied as set."""

from __future__ import annotations

import dataclasses

import pytest

from radixrt.config import ServerArgs
from radixrt.config_views import ConfigView, HttpConfig, PoolConfig, SchedulerConfig, TierConfig

VIEWS = (PoolConfig, TierConfig, HttpConfig, SchedulerConfig)
ARGS = {f.name: f for f in dataclasses.fields(ServerArgs)}


@pytest.mark.parametrize("view", VIEWS, ids=lambda v: v.__name__)
def test_view_fields_are_server_args_settings_of_the_same_type(view: type[ConfigView]):
    for f in dataclasses.fields(view):
        if f.name in ARGS:
            assert f.type == ARGS[f.name].type, f"{view.__name__}.{f.name}: {f.type} vs ServerArgs' {ARGS[f.name].type}"
        else:  # a derived value: a ServerArgs property of that name
            assert isinstance(getattr(ServerArgs, f.name, None), property), f"{view.__name__}.{f.name} is not a setting"


def test_views_copy_what_was_set_and_stay_frozen():
    args = ServerArgs(model_path="m", page_size=16, max_total_tokens=4096, api_key="k", allowed_hosts="a.example",
                      enable_hierarchical_cache=True, hicache_dir="/tmp/hc", tp_size=2, chunked_prefill_size=-1,
                      kv_retention="sink_window", kv_window_tokens=64)
    for view in VIEWS:
        v = view.of(args)
        assert {f.name: getattr(v, f.name) for f in dataclasses.fields(view)} == {
            f.name: getattr(args, f.name) for f in dataclasses.fields(view)}
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(v, dataclasses.fields(view)[0].name, None)
    assert SchedulerConfig.of(args).prefill_chunk == args.prefill_chunk == 1 << 62  # chunking off
    assert SchedulerConfig.of(args).retention.window_tokens == 64
    assert TierConfig.of(args).ranks_per_node == 2
