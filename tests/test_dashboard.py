"""deploy/: the Grafana dashboard and the Prometheus scrape example, held to the monitoring
contract (docs/metrics.md) and to a live server.

Without a server: the dashboard parses and every panel queries `${datasource}`; every PromQL
expression (each panel's targets, panels folded into rows included, and the `instance`
variable's query) names a metric, and only metrics docs/metrics.md lists; the names cover every
row of the doc's launch-checklist table; each histogram is shown as p50, p95 and p99; and
prometheus.yml scrapes job `radixrt` at /metrics.

Against the shared server: after a good and a bad request, /metrics declares every name the
dashboard queries (`Scrape.sample_names`, which includes labelled families with no samples yet).
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any, Iterator

import requests
import yaml  # PyYAML: a dependency of transformers (the srt extra)

from radixrt.ops.prom import Scrape

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "radixrt-dashboard.json"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
METRICS_DOC = ROOT / "docs" / "metrics.md"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
METRIC = re.compile(r"(?:sglang|radixrt):[A-Za-z0-9_:]+")
DOC_METRIC = re.compile(r"`((?:sglang|radixrt):[A-Za-z0-9_:*]+)")  # `*` stands for a family: radixrt:pages_*_total
QUANTILE = re.compile(r"histogram_quantile\(\s*([0-9.]+)\s*,.*?((?:sglang|radixrt):[A-Za-z0-9_:]+)_bucket")
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
# The checklist's histograms: each needs a panel of its p50, p95 and p99.
HISTOGRAMS = {
    "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
    "radixrt:time_per_output_token_seconds", "sglang:e2e_request_latency_seconds", "sglang:queue_time_seconds",
    "sglang:prompt_tokens_histogram", "sglang:generation_tokens_histogram", "radixrt:request_cached_fraction",
}
PERCENTILES = {0.5, 0.95, 0.99}


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(nodes: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows and the panels a folded row holds included."""
    for panel in nodes:
        yield panel
        yield from panels(panel.get("panels", []))


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: the panels' targets and the query variables' definitions."""
    targets = [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", [])]
    variables = [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return targets + variables


def base_name(name: str) -> str:
    """A histogram's series name without its _bucket/_sum/_count suffix."""
    for suffix in HISTOGRAM_SERIES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def dashboard_names() -> set[str]:
    return {name for expr in expressions(load_dashboard()) for name in METRIC.findall(expr)}


def checklist() -> dict[str, set[str]]:
    """docs/metrics.md's launch-checklist table: checklist item -> the metric names of its row."""
    section = METRICS_DOC.read_text().split("## The launch checklist", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| ")]
    return {item.strip(): set(DOC_METRIC.findall(metrics)) for item, metrics, _ in rows[1:]}  # rows[0]: the header


def test_dashboard_is_a_grafana_model_on_the_datasource_variable():
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] == 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["datasource"] == DATASOURCE
    ids = [p["id"] for p in panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"] == DATASOURCE and all(t["datasource"] == DATASOURCE for t in panel["targets"])


def test_every_expression_names_only_documented_metrics():
    documented = set(DOC_METRIC.findall(METRICS_DOC.read_text()))
    for expr in expressions(load_dashboard()):
        names = METRIC.findall(expr)
        assert names, f"no metric in {expr!r}"
        for opening, closing in ("()", "{}", "[]"):
            assert expr.count(opening) == expr.count(closing), f"unbalanced {opening}{closing} in {expr!r}"
        unknown = [n for n in names if not any(fnmatch.fnmatchcase(base_name(n), d) for d in documented)]
        assert not unknown, f"{expr!r} queries {unknown}, which docs/metrics.md does not list"


def test_dashboard_covers_every_row_of_the_launch_checklist():
    rows = checklist()
    assert {"TTFT", "queueing", "memory watermark", "failures"} <= rows.keys(), f"the table parsed as {sorted(rows)}"
    shown = {base_name(n) for n in dashboard_names()}
    missing = {item: sorted(n for n in names if not fnmatch.filter(shown, n)) for item, names in rows.items()}
    missing = {item: names for item, names in missing.items() if names}
    assert not missing, f"checklist metrics without a panel: {missing}"
    assert HISTOGRAMS <= set().union(*rows.values())


def test_histograms_show_p50_p95_p99():
    shown: dict[str, set[float]] = {}
    for panel in panels(load_dashboard()["panels"]):
        in_panel: dict[str, set[float]] = {}
        for target in panel.get("targets", []):
            for q, name in QUANTILE.findall(target["expr"]):
                in_panel.setdefault(name, set()).add(float(q))
        for name, qs in in_panel.items():
            assert qs == PERCENTILES, f"{panel['title']!r} shows {name} at {sorted(qs)}"
        shown.update(in_panel)
    assert HISTOGRAMS <= shown.keys(), f"no percentile panel for {sorted(HISTOGRAMS - shown.keys())}"


def test_prometheus_example_scrapes_the_radixrt_job():
    config = yaml.safe_load(PROMETHEUS.read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "radixrt")
    assert job["metrics_path"] == "/metrics" and job["scrape_interval"] == "5s"
    assert "127.0.0.1:30000" in [t for static in job["static_configs"] for t in static["targets"]]


def test_live_server_exports_every_dashboard_metric(server):
    # Samples first: a finished request and a refused one (400) fill the counters and histograms.
    for max_new_tokens, status in ((4, 200), (-1, 400)):
        body = {"text": "hello", "sampling_params": {"max_new_tokens": max_new_tokens}}
        res = requests.post(server + "/generate", json=body, timeout=60)
        assert res.status_code == status, res.text
    scrape = Scrape.parse(requests.get(server + "/metrics", timeout=10).text)
    missing = sorted(dashboard_names() - scrape.sample_names())
    assert not missing, f"/metrics lacks {len(missing)} names the dashboard queries: {missing}"
