"""Counters kept in code and exported to Prometheus (fabric/counters.py): the two never disagree."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fabric.counters import CountedCounter


def test_what_the_owner_reads_is_what_prometheus_exports() -> None:
    registry = CollectorRegistry()
    hits = CountedCounter("kvfabric_test_hits_total", "hits", ["source"], registry=registry)
    total = CountedCounter("kvfabric_test_requests_total", "requests", registry=registry)
    assert hits.value("peer") == 0.0 and total.value() == 0.0
    hits.labels("peer").inc(3)
    hits.labels("local").inc()
    total.inc(4)
    assert (hits.value("peer"), hits.value("local"), total.value()) == (3.0, 1.0, 4.0)
    assert registry.get_sample_value("kvfabric_test_hits_total", {"source": "peer"}) == 3.0
    assert registry.get_sample_value("kvfabric_test_requests_total") == 4.0


def test_counts_from_many_threads_are_all_kept() -> None:
    registry = CollectorRegistry()
    pulls = CountedCounter("kvfabric_test_pulls_total", "pulls", ["outcome"], registry=registry)

    def count() -> None:
        for _ in range(5000):
            pulls.labels("hit").inc()

    threads = [threading.Thread(target=count) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pulls.value("hit") == 20000.0 == registry.get_sample_value("kvfabric_test_pulls_total", {"outcome": "hit"})


def test_wrong_labels_are_refused_with_the_metric_named() -> None:
    pulls = CountedCounter("kvfabric_test_bad_total", "pulls", ["outcome"], registry=CollectorRegistry())
    with pytest.raises(ValueError, match="kvfabric_test_bad_total takes labels"):
        pulls.inc()
    with pytest.raises(ValueError, match="kvfabric_test_bad_total takes labels"):
        pulls.labels("hit", "extra")


def test_a_scrape_shows_the_counted_numbers_as_a_prometheus_counter_would() -> None:
    registry = CollectorRegistry()
    hits = CountedCounter("kvfabric_test_scraped_total", "hits", ["source"], registry=registry)
    hits.labels("peer").inc(2)
    text = generate_latest(registry).decode()
    assert "# TYPE kvfabric_test_scraped_total counter" in text
    assert 'kvfabric_test_scraped_total{source="peer"} 2.0' in text
    assert 'kvfabric_test_scraped_created{source="peer"}' in text
    with pytest.raises(ValueError, match="only go up"):
        hits.labels("peer").inc(-1)
