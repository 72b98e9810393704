"""deploy/kubernetes/: every document is valid against the Kubernetes API schema (kubernetes-validate bundles the
schemas and runs offline), and the manifests agree with the config they carry and with ``cachefeed status``."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest

from cachefeed._config import parse_config
from cachefeed._status.verdict import Health

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -c constraints.txt -e '.[test]'")
yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
# 1.29: the first with native sidecars (trainer-with-cache-sidecar.yaml); and the newest schema bundled
VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
_QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def documents(path: Path) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def find(kind: str, name: str) -> dict[str, Any]:
    for path in MANIFESTS:
        for document in documents(path):
            if document["kind"] == kind and document["metadata"]["name"] == name:
                return document
    raise AssertionError(f"no {kind} {name} in {DEPLOY}")


def quantity(text: str) -> int:
    number, unit = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi|Ti)?", text).groups()  # type: ignore[union-attr]
    return int(number) * _QUANTITY.get(unit or "", 1)


def config_of(config_map: str) -> Any:
    return parse_config(tomllib.loads(find("ConfigMap", config_map)["data"]["train.toml"]), env={})


def test_there_are_manifests() -> None:
    assert {path.name for path in MANIFESTS} >= {
        "cachefeed-daemonset.yaml",
        "trainer-job.yaml",
        "trainer-with-cache-sidecar.yaml",
    }


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_document_is_valid_against_the_kubernetes_api_schema(path: Path, version: str) -> None:
    for document in documents(path):
        # strict: a misspelt or misplaced field is an error, as kubectl's server-side field validation makes it
        kubernetes_validate.validate(document, version, strict=True)


def test_the_validation_catches_a_misplaced_field() -> None:
    daemonset = find("DaemonSet", "cachefeed")
    daemonset["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, VERSIONS[-1], strict=True)


def _probe_codes(probe: dict[str, Any]) -> set[int]:
    """The exit statuses of ``cachefeed status`` a probe passes on: the plain command passes on 0 only; the shell
    form lists them in its ``case``."""
    command = probe["exec"]["command"]
    if command[0] == "cachefeed":
        return {0}
    script = command[-1]
    assert script.startswith("cachefeed status --config /etc/cachefeed/train.toml >/dev/null;"), script
    codes = re.search(r"case \$\? in ([0-9|]+)\) exit 0;; esac; exit 1$", script)
    assert codes, script
    return {int(code) for code in codes.group(1).split("|")}


def _container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in [*spec.get("initContainers", []), *spec["containers"]] if c["name"] == name)


def test_the_daemonset_runs_one_critical_daemon_per_node_probed_by_cachefeed_status() -> None:
    daemonset = find("DaemonSet", "cachefeed")
    spec = daemonset["spec"]["template"]["spec"]
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert spec["priorityClassName"] == "system-node-critical"
    daemon = _container(spec, "cachefeed")
    assert daemon["args"] == ["daemon", "--config", "/etc/cachefeed/train.toml"]
    assert _probe_codes(daemon["readinessProbe"]) == {int(Health.RUNNING)}
    alive = {int(Health.RUNNING), int(Health.DEGRADED), int(Health.NOT_READY)}  # not 3 (stale, gone) nor 4
    assert _probe_codes(daemon["livenessProbe"]) == _probe_codes(daemon["startupProbe"]) == alive
    config = config_of("cachefeed-config")
    # the config is mounted where the daemon and the probes read it
    mounts = {mount["name"]: mount["mountPath"] for mount in daemon["volumeMounts"]}
    assert mounts["config"] == "/etc/cachefeed"
    # the cache lies on the hostPath volume, in a directory the init container gives to the daemon's user
    assert config.cache.dir.is_relative_to(mounts["cache"])
    volume = next(v for v in spec["volumes"] if v["name"] == "cache")
    assert volume["hostPath"]["path"] == mounts["cache"]
    init = shlex.join(_container(spec, "cache-dir")["command"])
    user = spec["securityContext"]["runAsUser"]
    assert init == f"install -d -o {user} -g {spec['securityContext']['runAsGroup']} -m 0750 {config.cache.dir}"
    # the metrics port is the config's, on every interface, and announced for the scrape
    assert config.status.metrics_address == "0.0.0.0"
    [port] = daemon["ports"]
    assert (port["name"], port["containerPort"]) == ("metrics", config.status.metrics_port)
    annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(config.status.metrics_port)


def test_the_trainer_reads_the_nodes_cache_as_one_writable_volume_in_the_daemons_group() -> None:
    daemon_spec = find("DaemonSet", "cachefeed")["spec"]["template"]["spec"]
    spec = find("Job", "train")["spec"]["template"]["spec"]
    trainer = _container(spec, "trainer")
    [cache_mount] = [m for m in trainer["volumeMounts"] if m["name"] == "cache"]
    assert not cache_mount.get("readOnly") and "subPath" not in cache_mount  # hard links: one writable mount
    volume = next(v for v in spec["volumes"] if v["name"] == "cache")
    assert (
        volume["hostPath"]["path"]
        == next(v for v in daemon_spec["volumes"] if v["name"] == "cache")["hostPath"]["path"]
    )
    assert spec["nodeSelector"] == daemon_spec["nodeSelector"]
    assert daemon_spec["securityContext"]["runAsGroup"] in spec["securityContext"]["supplementalGroups"]
    assert spec["securityContext"]["runAsUser"] != daemon_spec["securityContext"]["runAsUser"]
    assert config_of("cachefeed-config").cache.file_mode == 0o660  # another user pins: protected_hardlinks
    dshm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"]["medium"] == "Memory" and quantity(dshm["emptyDir"]["sizeLimit"]) > 64 << 20
    assert {"name": "dshm", "mountPath": "/dev/shm"} in trainer["volumeMounts"]


def test_a_memory_cache_in_a_sidecar_is_sized_to_cache_max_bytes_and_charged_to_the_daemon() -> None:
    spec = find("Job", "train-with-cache")["spec"]["template"]["spec"]
    config = config_of("cachefeed-sidecar-config")
    volume = next(v for v in spec["volumes"] if v["name"] == "cache")
    assert volume["emptyDir"]["medium"] == "Memory"
    assert quantity(volume["emptyDir"]["sizeLimit"]) == config.cache.max_bytes
    assert config.cache.min_free_bytes == 0
    daemon = _container(spec, "cachefeed")
    assert daemon["restartPolicy"] == "Always"  # a native sidecar
    assert quantity(daemon["resources"]["limits"]["memory"]) >= config.cache.max_bytes + (2 << 30)
    assert _probe_codes(daemon["startupProbe"]) == {0, 2, 5}
    [mount] = [m for m in daemon["volumeMounts"] if m["name"] == "cache"]
    assert config.cache.dir.is_relative_to(mount["mountPath"])


_PIN_UNDER_MOUNTS = """
import errno, subprocess, sys
from pathlib import Path
from cachefeed._cache.snapshots import Snapshot
cache, view = Path(sys.argv[1]), Path(sys.argv[2])
run = lambda *argv: subprocess.run(argv, check=True)
run("mount", "--make-rprivate", "/")
run("mount", "--bind", str(cache), str(view))
run("mount", "-o", "remount,bind,ro", str(view))
run("mount", "--bind", str(cache / "snapshots"), str(view / "snapshots"))  # writable snapshots/ on top
try:
    Snapshot.create(view, "t-e000000")
except OSError as exc:
    print("split:", errno.errorcode.get(exc.errno, exc.errno))
run("umount", str(view / "snapshots"))
run("umount", str(view))
run("mount", "--bind", str(cache), str(view))  # one writable mount, as trainer-job.yaml does
with Snapshot.create(view, "t-e000001") as snapshot:
    print("one mount:", snapshot.samples, "samples pinned")
"""


def test_a_read_only_cache_mount_with_a_writable_snapshots_mount_cannot_pin(tmp_path: Path) -> None:
    """Why trainer-job.yaml mounts the cache as one writable volume: hard links never cross mounts."""
    import os
    import shutil
    import subprocess
    import sys

    from tests.trainer.test_loader import build_cache

    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs root, unshare and mount (a private mount namespace)")
    cache = build_cache(tmp_path / "cache", 40)
    view = tmp_path / "view"
    view.mkdir()
    done = subprocess.run(
        ["unshare", "-m", sys.executable, "-c", _PIN_UNDER_MOUNTS, str(cache), str(view)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        pytest.skip(f"this container refuses mount namespaces: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["split: EXDEV", "one mount: 40 samples pinned"], done.stdout
