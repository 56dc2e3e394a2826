"""ServerArgs validation: a bad setting fails at construction, naming the argument."""

from __future__ import annotations

import dataclasses

import pytest
from radixrt.cli_args import add_server_args, server_args_from
from radixrt.config import FEATURES, ServerArgs


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"nnodes": 2, "tp_size": 2}, "dist_init_addr"),
        ({"nnodes": 2, "tp_size": 3, "dist_init_addr": "h:1"}, "multiple of nnodes"),
        ({"nnodes": 2, "tp_size": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank"),
        ({"dist_init_addr": "no-port"}, "dist_init_addr"),
        ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs"),
        ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype"),
        ({"preemption_mode": "pause"}, "preemption_mode"),
        ({"hicache_size": -1}, "hicache_size"),
        ({"hicache_dir": "/tmp/x"}, "enable_hierarchical_cache"),
        ({"enable_hierarchical_cache": True, "disable_radix_cache": True}, "disable_radix_cache"),
        ({"enable_hierarchical_cache": True, "hicache_dir": "/tmp/x", "hicache_disk_size": 0}, "hicache_disk_size"),
        ({"swap_min_tokens": -5}, "swap_min_tokens"),
        ({"radix_eviction_policy": "fifo"}, "radix_eviction_policy must be lru, lfu or cost"),
        ({"hicache_write_policy": "write_around"}, "hicache_write_policy must be write_through"),
        ({"hicache_load_policy": "never"}, "hicache_load_policy must be measured or always"),
        ({"max_pinned_fraction": 1.5}, "max_pinned_fraction"),
        ({"max_pinned_namespace_fraction": -0.1}, "max_pinned_namespace_fraction"),
        ({"bogus_flag": 1}, "bogus_flag"),
    ],
)
def test_bad_settings_name_the_argument(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ServerArgs.from_kwargs(model_path="m", **kwargs)


def test_the_cli_spells_the_new_flags_as_sglang():
    import argparse

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    ns = parser.parse_args(["--model-path", "m", "--tp-size", "4", "--nnodes", "2", "--node-rank", "1",
                            "--dist-init-addr", "10.0.0.1:5000", "--kv-cache-dtype", "int8", "--enable-hierarchical-cache",
                            "--hicache-size", "2.5", "--hicache-dir", "/tmp/hc", "--preemption-mode", "swap",
                            "--disable-cuda-graph", "--cuda-graph-max-bs", "64", "--radix-eviction-policy", "lfu",
                            "--hicache-write-policy", "write_back", "--max-pinned-fraction", "0.1"])
    args = server_args_from(ns)
    assert (args.nnodes, args.node_rank, args.dist_init_addr, args.kv_cache_dtype) == (2, 1, "10.0.0.1:5000", "int8")
    assert args.enable_hierarchical_cache and args.hicache_size == 2.5 and args.hicache_dir == "/tmp/hc"
    assert args.preemption_mode == "swap" and args.disable_cuda_graph and args.cuda_graph_max_bs == 64
    assert (args.radix_eviction_policy, args.hicache_write_policy, args.max_pinned_fraction) == ("lfu", "write_back", 0.1)


def test_each_setting_belongs_to_one_feature_with_its_check():
    """radixrt/settings/: every ServerArgs field is declared by exactly one feature's settings, with
    help text; each feature validates its own fields (check), and ServerArgs adds no field of its own."""
    owners: dict[str, list[str]] = {}
    for feature in FEATURES:
        assert feature.__module__.startswith("radixrt.settings."), feature
        assert "check" in vars(feature), f"{feature.__name__} has no check of its own"
        for f in dataclasses.fields(feature):
            owners.setdefault(f.name, []).append(feature.__name__)
            assert f.metadata.get("help"), f"{feature.__name__}.{f.name} has no help text"
    fields = [f.name for f in dataclasses.fields(ServerArgs)]
    assert sorted(fields) == sorted(owners)
    assert {name: o for name, o in owners.items() if len(o) > 1} == {}
    assert fields[0] == "model_path"  # the CLI lists the model first


@pytest.mark.parametrize("feature_name", ["HttpArgs", "KVArgs", "SchedulingArgs", "LoraArgs", "HiCacheArgs",
                                          "SpeculativeArgs", "DistributedArgs"])
def test_a_features_check_runs_on_its_own_settings(feature_name):
    """Each feature's check raises for its own bad value, named, before ServerArgs' cross-feature rules."""
    bad = {"HttpArgs": ("max_n", 0), "KVArgs": ("page_size", 0), "SchedulingArgs": ("max_prefill_tokens", 0),
           "LoraArgs": ("max_loras_per_batch", 0), "HiCacheArgs": ("hicache_disk_max_errors", 0),
           "SpeculativeArgs": ("speculative_algorithm", "EAGLE"), "DistributedArgs": ("dp_size", 0)}
    feature = next(f for f in FEATURES if f.__name__ == feature_name)
    name, value = bad[feature_name]
    assert name in {f.name for f in dataclasses.fields(feature)}
    with pytest.raises(ValueError, match=name if feature_name != "SpeculativeArgs" else "EAGLE"):
        ServerArgs.from_kwargs(model_path="m", **{name: value})
