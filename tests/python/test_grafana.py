"""The Grafana dashboard (share/grafana/gpucleanup.json) asks only for what the metrics have: every metric
and label its queries name is found in a real scrape of a real exporter, over a kernel on the fake driver
seen idle and then parked."""

from __future__ import annotations

import json
import re
import time
import types
import urllib.request
from pathlib import Path

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gpucleanup.outside import exporter as exporters  # noqa: E402
from gpucleanup.in_kernel.status_endpoint import StatusEndpoint  # noqa: E402
from gpucleanup.records.totals import Totals  # noqa: E402
from support import GiB  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[2] / "share" / "grafana" / "gpucleanup.json"

#: PromQL's functions and aggregations the dashboard may use, and its keywords
FUNCTIONS = {"sum", "max", "min", "avg", "count", "topk", "bottomk", "increase", "rate", "irate", "delta",
             "clamp_min", "clamp_max", "time", "max_over_time", "min_over_time", "avg_over_time", "vector", "scalar"}
GROUPING = ("by", "without", "on", "ignoring", "group_left", "group_right")
KEYWORDS = {"and", "or", "unless", "bool", "offset", *GROUPING}


def query_names(expr: str):
    """(metric names, label names) a PromQL expression refers to."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    text = re.sub(r"\[[^\]]*\]", "", text)  # range durations
    text = re.sub(r"\$\{?\w+\}?", "0", text)  # dashboard variables
    labels = set()
    for _, names in re.findall(r"\b(" + "|".join(GROUPING) + r")\s*\(([^)]*)\)", text):
        labels |= {n.strip() for n in names.split(",") if n.strip()}
    text = re.sub(r"\b(" + "|".join(GROUPING) + r")\s*\([^)]*\)", " ", text)
    for matchers in re.findall(r"\{([^}]*)\}", text):
        labels |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    text = re.sub(r"\{[^}]*\}", " ", text)
    metrics = set()
    for name, call in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", text):
        if name in KEYWORDS:
            continue
        if call:
            assert name in FUNCTIONS, f"{expr}: {name}() is not a function the test knows"
        else:
            metrics.add(name)
    return metrics, labels


def test_query_names_reads_metrics_and_labels():
    assert query_names('sum by (user, pid) (increase(a_total{device="0", uuid=~"GPU-.*"}[1h])) > $x * 60') == (
        {"a_total"}, {"user", "pid", "device", "uuid"})
    assert query_names("b and on (pid) (max without (le) (c) > 3)") == ({"b", "c"}, {"pid", "le"})


def _scrape(exporter) -> list:
    token = exporter.token_file.read_text().strip()
    request = urllib.request.Request(exporter.url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        text = response.read().decode()
    return [(s.name, dict(s.labels)) for f in text_string_to_metric_families(text) for s in f.samples]


@pytest.fixture
def scraped(runtime, fake_cuda):
    """{metric name: every label name its samples carry} over two scrapes of a real exporter: a kernel that
    cleaned two cells on GPU0 (pinned host memory freed too), idle, then parked."""
    fake_cuda.reset({"devices": [{"name": "Fake H100", "primary_active": True, "total_bytes": 80 * GiB,
                                  "free_bytes": 70 * GiB}]})
    ep = StatusEndpoint()
    ep.start(types.SimpleNamespace(user_ns={"__session__": "/home/me/fit.ipynb"}))
    assert ep.error is None, ep.error
    exporter = exporters.start_exporter(0, runtime_dir=runtime, timeout=5.0)
    try:
        totals = Totals(started_ns=time.time_ns())
        for cell, live in ((1, 2 * GiB), (2, 3 * GiB)):
            record = {"cell": cell, "devices": [{"index": 0, "settle": {"status": "done", "waited_s": 0.01},
                                                 "freed_bytes": {"cupy": GiB}, "live_bytes": {"cupy": live},
                                                 "cached_bytes": {"cupy": GiB}, "outside_bytes": 0}],
                      "pinned": {"freed_bytes": {"cupy": GiB // 16}, "background": [], "pending": False, "pools": {}},
                      "idle": []}
            totals.add(record)
            ep.publish(dict(record, totals=totals.as_dict()))
        ep.set_state({"state": "idle", "since_ns": time.time_ns()})
        samples = _scrape(exporter)
        ep.park_step("begin")
        ep.park_step("parked", 5 * GiB)
        try:
            samples += _scrape(exporter)
        finally:
            ep.park_step("resumed")
    finally:
        exporter.shutdown()
        ep.close()
    found = {}
    for name, labels in samples:
        found.setdefault(name, set()).update(labels)
    return found


def _targets():
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target


def test_the_dashboard_has_the_issues_panels():
    titles = {title for title, _ in _targets()}
    assert {"GPU memory held by user", "GPU memory by kernel", "Idle kernels holding GPU memory",
            "Parked in host memory, per GPU", "Cells cleaned per hour, by user"} <= titles


def test_every_query_names_only_metrics_and_labels_of_a_real_scrape(scraped):
    assert {"gpucleanup_kernel_idle_seconds", "gpucleanup_device_parked_bytes"} <= set(scraped)  # both states seen
    checked = 0
    for title, target in _targets():
        metrics, labels = query_names(target["expr"])
        assert metrics, (title, target["expr"])
        missing = metrics - set(scraped)
        assert not missing, f"{title}: {sorted(missing)} not in the scrape"
        have = set().union(*(scraped[m] for m in metrics))
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        assert labels | legend <= have, f"{title}: labels {sorted((labels | legend) - have)} not on {sorted(metrics)}"
        checked += 1
    assert checked >= 10


def test_the_readmes_table_names_every_series_of_a_real_scrape_and_no_other(scraped):
    readme = (DASHBOARD.parents[2] / "README.md").read_text()
    table = readme[readme.index("Every series (labels as above"):readme.index("A kernel that does not answer shows")]
    named = set(re.findall(r"`(gpucleanup_[a-z_]+)", table))
    families = set()
    for name in scraped:
        base = re.sub(r"_(bucket|sum|count|created)$", "", name)
        if base + "_total" not in scraped:  # a counter's _created goes with its _total
            families.add(base)
    assert families - named == set()
    # the one series a scrape of answering kernels never carries: the error of a kernel that did not answer
    assert named - families == {"gpucleanup_kernel_error"}
