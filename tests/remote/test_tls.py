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
from cachefeed._remote import Remote, RemoteObject
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


def test_a_daemons_s3_clients_build_one_tls_context_and_a_forked_sampler_fetches_over_it(
    s3: LocalS3, fault_proxy: FaultProxy, https_endpoint: tuple[str, Path], contexts_built: list[int]
) -> None:
    endpoint, cert = https_endpoint
    bodies = {f"{PREFIX}/o{i}.bin": os.urandom(1000 + i) for i in range(3)}
    for key, body in bodies.items():
        s3.client().put_object(Bucket=BUCKET, Key=key, Body=body)

    supervisor = remote_of(endpoint, cert)
    assert supervisor.warm_session()  # in preflight, before the samplers are forked
    assert contexts_built == [os.getpid()]
    objects = supervisor.list_objects()  # the listing client, over TLS
    assert len(objects) == 3
    supervisor.close()

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # a sampler: its own client, event loop and connections
        code = 1
        try:
            sampler = remote_of(endpoint, cert)
            got = fetch_all(sampler, objects)
            shas = [hashlib.sha256(body).hexdigest() for body in got]
            report = {"built_here": contexts_built.count(os.getpid()), "sha": shas}
            os.write(write_end, json.dumps(report).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        report = json.loads(pipe.read() or b"{}")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, report

    assert report["sha"] == [hashlib.sha256(bodies[obj.path.split("/", 1)[1]]).hexdigest() for obj in objects]
    assert fault_proxy.counts().ops.get("GetObject", 0) == 3  # fetched through the relay, one GET each
    assert report["built_here"] == 0, "the forked sampler loaded the CA bundle again"
    assert contexts_built == [os.getpid()], "the listing client loaded the CA bundle again"


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
