"""Prometheus metrics from the status document: names, values that agree with the document, both outputs."""

from __future__ import annotations

import logging
import os
import stat
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachefeed._config import StatusConfig
from cachefeed._errors import ConfigError
from cachefeed._status.metrics import _SCALARS, MetricsExporter, render_metrics
from cachefeed._status.schema import STATUS_SCHEMA
from cachefeed._testing.local_s3 import free_port
from tests.status.test_status import make_document

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_agree_with_the_document(tmp_path: Path) -> None:
    document = make_document(tmp_path)
    document["remote"]["quarantined_samples_total"] = 7
    samples = parse(render_metrics(document).decode())
    assert value(samples, "cachefeed_cache_bytes") == document["cache"]["bytes"]
    assert value(samples, "cachefeed_cache_max_bytes") == document["cache"]["max_bytes"]
    assert value(samples, "cachefeed_cache_pinned_bytes") == document["cache"]["pinned_bytes"]
    assert value(samples, "cachefeed_cache_snapshots") == 1
    assert value(samples, "cachefeed_cache_backpressured") == 0
    assert value(samples, "cachefeed_ingest_samples_total") == document["ingest"]["samples_total"]
    assert value(samples, "cachefeed_evicted_bytes_total") == document["evicted"]["bytes_total"]
    assert value(samples, "cachefeed_cache_turnover_seconds") == 860.0
    assert value(samples, "cachefeed_remote_errors_total", kind="forbidden") == 3
    assert value(samples, "cachefeed_remote_errors_total", kind="transient") == 53
    assert value(samples, "cachefeed_remote_passes_completed_total") == 3
    assert value(samples, "cachefeed_remote_quarantined_objects_total") == 2
    assert value(samples, "cachefeed_remote_quarantined_samples_total") == 7, "left-out samples can be alerted on"
    assert value(samples, "cachefeed_sampler_restarts_total", sampler="1") == 2
    assert value(samples, "cachefeed_sampler_objects_total", sampler="0") == 12_345
    assert value(samples, "cachefeed_sampler_state", sampler="1", state="restarting") == 1
    assert value(samples, "cachefeed_sampler_state", sampler="1", state="running") == 0
    assert value(samples, "cachefeed_state", state="running") == 1
    assert value(samples, "cachefeed_state", state="stopped") == 0
    assert value(samples, "cachefeed_degraded") == 0
    assert value(samples, "cachefeed_status_updated_timestamp_seconds") == pytest.approx(document["updated_at"])


def test_errors_without_a_kind_are_counted_as_other(tmp_path: Path) -> None:
    document = make_document(tmp_path, remote__errors_total=60, state="degraded", degraded_reasons=["x"])
    samples = parse(render_metrics(document).decode())
    assert value(samples, "cachefeed_remote_errors_total", kind="other") == 4
    assert value(samples, "cachefeed_degraded") == 1


def test_unknown_values_are_absent_not_zero(tmp_path: Path) -> None:
    document = make_document(tmp_path, evicted__turnover_s=None, remote__last_listed_at=None)
    names = {name for name, _ in parse(render_metrics(document).decode())}
    assert "cachefeed_cache_turnover_seconds" not in names
    assert "cachefeed_remote_last_listed_timestamp_seconds" not in names
    assert "cachefeed_cache_bytes" in names


def test_naming_conventions_and_schema_agreement(tmp_path: Path) -> None:
    families = list(text_string_to_metric_families(render_metrics(make_document(tmp_path)).decode()))
    names = {family.name for family in families}
    assert len(names) == len(families)
    for family in families:
        assert family.name.startswith("cachefeed_")
        assert family.documentation
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name.endswith("_total") or sample.name.endswith("_created"), sample.name
            assert not sample.name.endswith("_per_s")  # rates come from rate(), not from us
            for unit in ("bytes", "seconds"):
                if unit in sample.name:
                    assert sample.name.endswith((f"_{unit}", f"_{unit}_total")), sample.name
    # every exported scalar names a key of the status contract
    for section, key, name, _kind, _help in _SCALARS:
        spec = STATUS_SCHEMA[section] if section else STATUS_SCHEMA
        assert key in spec, (section, key, name)


def test_textfile_is_written_atomically_with_readable_mode(tmp_path: Path) -> None:
    textfile = tmp_path / "cachefeed.prom"
    exporter = MetricsExporter(StatusConfig(metrics_textfile=str(textfile)))
    document = make_document(tmp_path)
    exporter.update(document)
    assert stat.S_IMODE(textfile.stat().st_mode) == 0o644
    assert value(parse(textfile.read_text()), "cachefeed_cache_bytes") == document["cache"]["bytes"]

    # a concurrent reader (node-exporter) only ever sees whole files
    seen: list[str] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.wait(0.0005):  # waiting lets the writer thread have the GIL
            seen.append(textfile.read_text())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(200):
            document["cache"]["bytes"] = i
            exporter.update(document)
    finally:
        stop.set()
        reader.join()
    assert len(seen) > 10
    for text in seen:
        assert "cachefeed_sampler_state" in text  # near the end: a whole file
        parse(text)
    assert value(parse(textfile.read_text()), "cachefeed_cache_bytes") == 199
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cachefeed.prom"]  # no temp files left
    exporter.close()


def test_textfile_problems(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        MetricsExporter(StatusConfig(metrics_textfile=str(tmp_path / "missing" / "x.prom")))
    directory = tmp_path / "textfiles"
    directory.mkdir()
    exporter = MetricsExporter(StatusConfig(metrics_textfile=str(directory / "x.prom")))
    directory.rmdir()  # removed under the running daemon: logged once, never raised
    with caplog.at_level(logging.WARNING, logger="cachefeed.status.metrics"):
        for _ in range(3):
            exporter.update(make_document(tmp_path))
    assert len([r for r in caplog.records if "metrics textfile" in r.getMessage()]) == 1
    directory.mkdir()
    exporter.update(make_document(tmp_path))
    assert (directory / "x.prom").exists()


def test_http_endpoint_on_loopback(tmp_path: Path) -> None:
    port = free_port()
    exporter = MetricsExporter(StatusConfig(metrics_port=port))
    try:
        assert exporter.port == port
        assert exporter._server.server_address[0] == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.read() == b""  # no document yet: nothing to claim
        document = make_document(tmp_path)
        exporter.update(document)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            samples = parse(response.read().decode())
        assert value(samples, "cachefeed_cache_samples") == document["cache"]["samples"]
        assert value(samples, "cachefeed_sampler_restarts_total", sampler="1") == 2
        # the private registry: no process or platform collectors of the default one
        assert not any(name.startswith(("process_", "python_")) for name, _ in samples)
        with pytest.raises(ConfigError, match=f"metrics_port = {port}"):
            MetricsExporter(StatusConfig(metrics_port=port))  # taken
    finally:
        exporter.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    exporter.close()  # idempotent
    assert os.path.exists(tmp_path)


def test_the_endpoint_listens_on_the_configured_address_for_a_scrape_from_another_pod(tmp_path: Path) -> None:
    from cachefeed._config import parse_config

    config = parse_config(
        {
            "remote": {"url": "s3://b/p"},
            "cache": {"dir": "/var/cache/cachefeed/t", "max_bytes": "1GiB"},
            "status": {"metrics_port": free_port(), "metrics_address": "0.0.0.0"},
        },
        env={},
    )
    exporter = MetricsExporter(config.status)
    try:
        assert exporter._server.server_address[0] == "0.0.0.0"  # every interface: the pod's IP too
        exporter.update(make_document(tmp_path))
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10) as response:
            assert value(parse(response.read().decode()), "cachefeed_cache_samples") is not None
    finally:
        exporter.close()
    with pytest.raises(ConfigError, match=r"status.metrics_address = 'localhost': expected an IP address"):
        parse_config(
            {
                "remote": {"url": "s3://b/p"},
                "cache": {"dir": "/var/cache/cachefeed/t", "max_bytes": "1GiB"},
                "status": {"metrics_address": "localhost"},
            },
            env={},
        )


@pytest.mark.parametrize("problem", ["port in use", "no textfile directory"])
def test_a_daemon_whose_metrics_cannot_start_exits_78_with_one_line(tmp_path: Path, problem: str) -> None:
    """A metrics port another process holds, or a textfile in a directory that does not exist: the daemon ended
    with a traceback and exit 1 (stopping a catalog thread not started yet), which systemd restarts every 5 s for
    good. It is a config error: one line, exit 78, which the unit does not restart."""
    import socket

    from cachefeed._config import toml_text
    from tests.support.cli import run_cli

    (tmp_path / "remote").mkdir()
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    status = (
        {"metrics_port": holder.getsockname()[1]}
        if problem == "port in use"
        else {"metrics_textfile": str(tmp_path / "missing" / "cachefeed.prom")}
    )
    config = tmp_path / "d.toml"
    config.write_text(
        toml_text(
            {
                "remote": {"url": (tmp_path / "remote").as_uri()},
                "cache": {"dir": str(tmp_path / "cache"), "max_bytes": "64MiB", "segment_bytes": "1MiB"},
                "status": status,
            }
        )
    )
    try:
        done = run_cli("daemon", "--config", str(config))
    finally:
        holder.close()
    assert done.returncode == 78, done.stderr
    assert "Traceback" not in done.stderr and "status.metrics_" in done.stderr, done.stderr
