"""NOTE [ One TLS context ] (``cachefeed/_remote/tls.py``): the S3 clients of one process tree load the CA bundle
once, and still verify the server; a client that verifies against other certificates gets a context of its own.

Real TLS: a relay (``tests/support/tls_relay.py``, a process of its own) with a self-signed certificate for
127.0.0.1 in front of the counting proxy and moto. The witness of what was built is aiobotocore's own context
factory, counted; the witness of what was fetched is the bytes and the proxy's count of GETs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from cachefeed._config import RemoteConfig
from cachefeed._errors import RemoteError
from cachefeed._remote import Remote, RemoteObject, tls
from cachefeed._testing.local_s3 import LocalS3
from cachefeed._testing.proxy import FaultProxy
from tests.support.tls_relay import make_certificate

BUCKET = "data"
PREFIX = "tls"
RELAY = Path(__file__).parents[1] / "support" / "tls_relay.py"


@pytest.fixture
def https_endpoint(s3: LocalS3, fault_proxy: FaultProxy, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``(https endpoint, its certificate)``: TLS in front of the proxy in front of moto, the bucket created."""
    s3.client().create_bucket(Bucket=BUCKET)
    cert, key = make_certificate(tmp_path)
    upstream = urlsplit(fault_proxy.endpoint).port
    relay = subprocess.Popen(
        [sys.executable, str(RELAY), str(cert), str(key), str(upstream)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert relay.stdout is not None
        port = int(relay.stdout.readline())
        yield f"https://127.0.0.1:{port}", cert
    finally:
        relay.kill()
        relay.wait()
        if relay.stdout is not None:
            relay.stdout.close()


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a fresh daemon process would: no context cached, no client connected (other tests in
    this worker process may have fetched over S3 before)."""
    monkeypatch.setattr(tls, "_contexts", {})
    monkeypatch.setattr(tls, "_in_use", False)


@pytest.fixture
def contexts_built(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pid of each TLS context aiobotocore builds for an endpoint, from its own context factory."""
    import aiobotocore.httpsession as http

    built: list[int] = []
    real = http.create_urllib3_context

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(os.getpid())
        return real(*args, **kwargs)

    monkeypatch.setattr(http, "create_urllib3_context", counting)
    return built


def remote_of(endpoint: str, verify: Path | None) -> Remote:
    storage: dict[str, Any] = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    if verify is not None:
        storage["client_kwargs"] = {"verify": str(verify)}
    return Remote(RemoteConfig(url=f"s3://{BUCKET}/{PREFIX}", storage_options=storage, max_attempts=1))


def fetch_all(remote: Remote, objects: list[RemoteObject]) -> list[bytes]:
    async def main() -> list[bytes]:
        try:
            return list(await asyncio.gather(*(remote.fetch(obj) for obj in objects)))
        finally:
            await remote.aclose()

    return asyncio.run(main())


def in_a_forked_sampler(endpoint: str, cert: Path, contexts_built: list[int]) -> dict[str, Any]:
    """Fork a "sampler" that lists and fetches every object through a client of its own; what it fetched (the
    objects' paths and the bodies' SHA-256) and how many TLS contexts it built itself."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            sampler = remote_of(endpoint, cert)
            objects = sampler.list_objects()
            got = fetch_all(sampler, objects)
            report = {
                "built_here": contexts_built.count(os.getpid()),
                "fetched": {obj.path: hashlib.sha256(body).hexdigest() for obj, body in zip(objects, got, strict=True)},
            }
            os.write(write_end, json.dumps(report).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        found: dict[str, Any] = json.loads(pipe.read() or b"{}")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, found
    return found


def test_a_daemons_s3_clients_build_one_tls_context_and_samplers_forked_at_its_start_fetch_over_it(
    s3: LocalS3, fault_proxy: FaultProxy, https_endpoint: tuple[str, Path], contexts_built: list[int]
) -> None:
    """The daemon's order: the supervisor warms its session, forks its samplers, then lists."""
    endpoint, cert = https_endpoint
    bodies = {f"{BUCKET}/{PREFIX}/o{i}.bin": os.urandom(1000 + i) for i in range(3)}
    for path, body in bodies.items():
        s3.client().put_object(Bucket=BUCKET, Key=path.split("/", 1)[1], Body=body)
    expected = {path: hashlib.sha256(body).hexdigest() for path, body in bodies.items()}

    supervisor = remote_of(endpoint, cert)
    assert supervisor.warm_session()
    assert contexts_built == [os.getpid()]
    sampler = in_a_forked_sampler(endpoint, cert, contexts_built)
    assert sampler["fetched"] == expected, "the sampler fetched every object, verifying the server"
    assert sampler["built_here"] == 0, "the sampler loaded the CA bundle again"
    assert fault_proxy.counts().ops.get("GetObject", 0) == 3  # through the relay, one GET each
    assert len(supervisor.list_objects()) == 3  # the supervisor's listing client, over TLS
    supervisor.close()
    assert contexts_built == [os.getpid()], "the listing client loaded the CA bundle again"


def test_a_child_forked_after_its_parents_clients_connected_builds_a_context_of_its_own(
    s3: LocalS3, https_endpoint: tuple[str, Path], contexts_built: list[int]
) -> None:
    """Not a fork the daemon makes (it forks samplers only while the supervisor runs one thread; later samplers are
    fresh interpreters), but one a user's code may: a context the parent's connections use may hold OpenSSL's
    locks in another thread at the fork, so the child does not use it (NOTE [ One TLS context ], "Forks"), and
    still verifies the server."""
    endpoint, cert = https_endpoint
    s3.client().put_object(Bucket=BUCKET, Key=f"{PREFIX}/o.bin", Body=b"y" * 300)
    supervisor = remote_of(endpoint, cert)
    supervisor.warm_session()
    (obj,) = supervisor.list_objects()
    sampler = in_a_forked_sampler(endpoint, cert, contexts_built)
    assert sampler["fetched"] == {obj.path: hashlib.sha256(b"y" * 300).hexdigest()}
    assert sampler["built_here"] == 1
    supervisor.close()


def test_a_client_verifying_against_other_certificates_gets_its_own_context_and_refuses_the_server(
    s3: LocalS3, https_endpoint: tuple[str, Path], contexts_built: list[int]
) -> None:
    endpoint, cert = https_endpoint
    s3.client().put_object(Bucket=BUCKET, Key=f"{PREFIX}/o.bin", Body=b"x" * 100)
    trusting = remote_of(endpoint, cert)
    trusting.warm_session()
    (obj,) = trusting.list_objects()
    trusting.close()
    assert len(contexts_built) == 1  # a verify path of this test's own: built here

    default_bundle = remote_of(endpoint, None)  # the CA bundle botocore ships: it does not know this certificate
    untrusted = r"TLS certificate is not trusted \(self.signed certificate\).*client_kwargs.verify"
    with pytest.raises(RemoteError, match=untrusted):
        fetch_all(default_bundle, [obj])  # its context is its own (this process may hold one for it already)
