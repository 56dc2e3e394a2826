"""Every figure the scheduler reports reaches a reader: each SchedulerStats field is a metric on
/metrics (server/metrics.py's maps), or is listed as shown by get_server_info only; no map names
a figure the struct lacks; and a scheduler's live stats become every metric the maps promise."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import generate_latest
from radixrt.messages import SchedulerStats
from radixrt.server import metrics
from support.scheduling import make, req, run


def fields() -> set[str]:
    return set(SchedulerStats.__struct_fields__)


def test_every_field_is_a_metric_or_shown_by_get_server_info_only():
    exported = (set(metrics.SGLANG_GAUGES) | set(metrics.SCHEDULER_FIGURES) | set(metrics.LABELLED)
                | set(metrics.LABELLED_GAUGES) | {"retractions"})
    assert not (exported - set(metrics.DERIVED)) - fields(), "a metric maps a figure SchedulerStats lacks"
    assert not metrics.INFO_ONLY - fields(), "INFO_ONLY lists a figure SchedulerStats lacks"
    assert not metrics.INFO_ONLY & exported, "a figure is both exported and listed as get_server_info only"
    missing = fields() - exported - metrics.INFO_ONLY
    assert not missing, f"figures no reader shows: {sorted(missing)}"


def test_a_renamed_or_missing_figure_fails_where_the_stats_are_built():
    s, w = make(num_pages=64, page_size=4)
    good = msgspec.structs.asdict(s.stats())
    with pytest.raises(TypeError, match="renamed_pages"):
        SchedulerStats(**{**good, "renamed_pages": 1})
    with pytest.raises(TypeError, match="cached_pages"):
        SchedulerStats(**{k: v for k, v in good.items() if k != "cached_pages"})


def test_live_stats_become_every_metric_and_every_info_key():
    s, w = make(num_pages=64, page_size=4, tiers={"host_pages": 32}, enable_hierarchical_cache=True)
    run(s, w, [req(f"r{i}", [i % 50 + 1] * 20, 4) for i in range(4)])
    reg = metrics.ServerMetrics(s.stats, model_name="m").registry
    text = generate_latest(reg).decode()
    names = [name for name, *_ in metrics.SGLANG_GAUGES.values()] + [name for name, *_ in metrics.SCHEDULER_FIGURES.values()]
    names += [name for name, *_ in metrics.LABELLED.values()] + ["sglang:num_retracted_requests_total"]
    for name in names:
        assert name.removesuffix("_total") in text, name
    assert 'radixrt:retractions_by_cause_total{cause="admission"}' in text
    assert 'radixrt:kv_retention_requests_total{policy="none"} 4.0' in text
    info = s.stats().info()
    assert info["prompt_tokens"] == 80 and info["retractions_admission"] == 0 and info["kv_retention_requests_none"] == 4
    assert not any(isinstance(v, dict) for v in info.values())
