"""The client's wait meter and report format, the server's bucketed histogram, the client's
error hierarchy and typed options: pure pieces, no server."""

from __future__ import annotations

import inspect

import grpc
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tokenfeed.client import AsyncClient, Client, TokenfeedClientError, WireError
from tokenfeed.client import errors as client_errors
from tokenfeed.client.waits import BUCKETS, WaitMeter, WaitReport, bucket_of
from tokenfeed.server.telemetry.bucketed import BucketedHistogram


def test_bucket_of_follows_prometheus_le():
    assert bucket_of(0.0) == 0
    assert bucket_of(BUCKETS[0]) == 0  # le is inclusive
    assert bucket_of(BUCKETS[0] * 1.01) == 1
    assert bucket_of(BUCKETS[-1] + 1) == len(BUCKETS)


def test_meter_reports_deltas_and_keeps_what_a_failed_call_carried():
    meter = WaitMeter()
    meter.record(0.5)  # before the first request: counted in the first report
    assert meter.take(now=100.0) is None  # the first request only starts the clock
    meter.record(0.0002)
    meter.record(2.0)
    first = meter.take(now=110.0)
    assert first is not None
    assert first.elapsed == pytest.approx(10.0)
    assert first.waited == pytest.approx(2.5002)
    assert first.waits == 3 and first.counts[bucket_of(2.0)] == 1
    meter.give_back(first)  # its call failed before the server counted it
    meter.record(1.0)
    second = meter.take(now=115.0)
    assert second is not None
    assert second.elapsed == pytest.approx(15.0)  # the failed report's time is not lost
    assert second.waited == pytest.approx(3.5002) and second.waits == 4
    third = meter.take(now=116.0)
    assert third == WaitReport(1.0, 0.0, (0,) * (len(BUCKETS) + 1))


def test_report_round_trips_and_refuses_garbage():
    report = WaitReport(12.25, 0.75, tuple(range(len(BUCKETS) + 1)))
    again = WaitReport.decode(report.encode())
    assert again.counts == report.counts
    assert again.elapsed == pytest.approx(12.25) and again.waited == pytest.approx(0.75)
    bad = {
        "e=1;w=0": "fields",
        "e=x;w=0;c=" + ",".join("0" * (len(BUCKETS) + 1)): "could not convert",
        "e=1;w=0;c=1,2": "non-negative counts",
        "e=1;w=-1;c=" + ",".join("0" * (len(BUCKETS) + 1)): "out of range",
        "e=nan;w=0;c=" + ",".join("0" * (len(BUCKETS) + 1)): "out of range",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            WaitReport.decode(text)


def test_bucketed_histogram_exports_an_ordinary_histogram():
    registry = CollectorRegistry(auto_describe=True)
    hist = BucketedHistogram("t_wait_seconds", "waits", "tokenfeed_job", (0.01, 1.0), registry)
    hist.labels("a").add([2, 1, 1], 7.5)
    hist.labels("a").add([1, 0, 0], 0.001)
    with pytest.raises(ValueError, match="3 buckets"):
        hist.labels("a").add([1, 0], 0.0)
    text = generate_latest(registry).decode()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "t_wait_seconds"]
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert family.type == "histogram"
    assert samples[("t_wait_seconds_bucket", "0.01")] == 3
    assert samples[("t_wait_seconds_bucket", "1.0")] == 4
    assert samples[("t_wait_seconds_bucket", "+Inf")] == 5
    assert samples[("t_wait_seconds_count", None)] == 5
    assert samples[("t_wait_seconds_sum", None)] == pytest.approx(7.501)


def test_bucketed_observations_count_as_prometheus_histograms_observes():
    """observe(value, times) exports what prometheus_client's Histogram does after `times`
    observe(value) calls, values on a bucket's bound included (`le`: at most the bound)."""
    values = [(0.0004, 1), (0.0005, 3), (0.0007, 2), (0.001, 1), (2.0, 5), (99.0, 2), (0.3, 0)]
    bounds = (0.0005, 0.001, 0.5, 60.0)
    mine, theirs = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
    hist = BucketedHistogram("t_seconds", "s", "method", bounds, mine)
    ref = Histogram("t_seconds", "s", ["method"], buckets=bounds, registry=theirs)
    for value, times in values:
        hist.labels("m").observe(value, times)
        for _ in range(times):
            ref.labels("m").observe(value)
    hist.labels("m").observe(0.002)  # once by default
    ref.labels("m").observe(0.002)

    def samples(registry):
        text = generate_latest(registry).decode()
        [family] = [f for f in text_string_to_metric_families(text) if f.name == "t_seconds"]
        return {
            (s.name, s.labels.get("le")): s.value
            for s in family.samples
            if not s.name.endswith("_created")
        }

    got, want = samples(mine), samples(theirs)
    assert got.keys() == want.keys() and got[("t_seconds_count", None)] == 15
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key
    with pytest.raises(ValueError, match="times"):
        hist.labels("m").observe(1.0, -1)


def test_every_client_error_is_a_tokenfeed_client_error_with_a_grpc_code():
    assert issubclass(WireError, TokenfeedClientError) and issubclass(WireError, ValueError)
    assert WireError("x").code == grpc.StatusCode.DATA_LOSS
    for name in dir(client_errors):
        cls = getattr(client_errors, name)
        if isinstance(cls, type) and issubclass(cls, Exception):
            assert issubclass(cls, TokenfeedClientError), name
            assert isinstance(cls("m").code, grpc.StatusCode), name


@pytest.mark.parametrize("cls", [Client, AsyncClient])
def test_client_options_are_named_and_typed(cls):
    params = inspect.signature(cls).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), "no **options bag"
    for name in ("timeout", "prefetch", "token_file", "tls_root_certs", "report_waits"):
        assert params[name].kind is params[name].KEYWORD_ONLY
        assert params[name].annotation is not inspect.Parameter.empty, name
    with pytest.raises(TypeError, match="unexpected keyword"):
        cls("127.0.0.1:1", job="j", tiemout=3)
