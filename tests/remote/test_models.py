"""NOTE [ botocore's models, loaded once and plainly ] (``cachefeed/_remote/models.py``): the sessions the daemon
warms load botocore's data as botocore does, the same data in the same order, and know the same services.

The witnesses are botocore's own loader reading the same files, and a real S3 client (moto) built from a warmed
session listing and fetching.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import OrderedDict
from typing import Any

import pytest
from botocore.exceptions import UnknownServiceError
from botocore.loaders import Loader

from cachefeed._config import RemoteConfig
from cachefeed._remote import Remote, client, models
from cachefeed._testing.local_s3 import LocalS3, storage_options

# What making an S3 client loads: the generic data, then the service's model and endpoint rules
GENERIC = ("endpoints", "partitions", "sdk-default-configuration", "_retry")
S3_MODELS = ("service-2", "endpoint-rule-set-1", "paginators-1", "waiters-2")


def no_ordered_dicts(value: Any) -> bool:
    if isinstance(value, OrderedDict):
        return False
    if isinstance(value, dict):
        return all(no_ordered_dicts(v) for v in value.values())
    if isinstance(value, list):
        return all(no_ordered_dicts(v) for v in value)
    return True


@pytest.mark.parametrize("name", GENERIC)
def test_the_generic_data_is_botocores_in_botocores_order_as_plain_dicts(name: str) -> None:
    ours, theirs = models.ModelLoader().load_data(name), Loader().load_data(name)
    assert json.dumps(ours) == json.dumps(theirs)  # every key, value and order
    assert no_ordered_dicts(ours)


@pytest.mark.parametrize("type_name", S3_MODELS)
def test_the_s3_models_are_botocores_in_botocores_order(type_name: str) -> None:
    ours = models.ModelLoader().load_service_model("s3", type_name)
    assert json.dumps(ours) == json.dumps(Loader().load_service_model("s3", type_name))
    assert no_ordered_dicts(ours)


@pytest.mark.parametrize("name", ["s3", "sts", "sso-oidc", "no-such-service", "", ".", "../s3", "s3/2006-03-01"])
def test_a_service_is_known_exactly_when_botocores_whole_list_names_it(name: str) -> None:
    listed = Loader().list_available_services("service-2")
    assert (name in models.ModelLoader().list_available_services("service-2")) == (name in listed)


def test_the_whole_list_read_as_a_list_is_botocores() -> None:
    known = models.ModelLoader().list_available_services("service-2")
    listed = Loader().list_available_services("service-2")
    assert list(known) == listed and len(known) == len(listed) and known[0] == listed[0]
    assert "s3" in known and "no-such-service" not in known  # answered from the list once it is read


def test_an_unknown_service_is_refused_naming_the_known_ones() -> None:
    loader = models.session().get_component("data_loader")
    with pytest.raises(UnknownServiceError, match=r"no-such-service.*\bs3\b"):
        loader.load_service_model("no-such-service", "service-2")


def test_a_data_path_set_in_the_environment_is_searched_first(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AWS_DATA_PATH`` (botocore's ``data_path``): a model placed there is the one loaded, as with botocore's."""
    shipped = Loader().load_service_model("s3", "paginators-1")
    version = Loader().determine_latest_version("s3", "paginators-1")
    custom = {**shipped, "pagination": {"ListObjectsV2": {"input_token": "x", "output_token": "y"}}}
    directory = os.path.join(tmp_path, "s3", version)
    os.makedirs(directory)
    with open(os.path.join(directory, "paginators-1.json"), "w") as handle:
        json.dump(custom, handle)
    monkeypatch.setenv("AWS_DATA_PATH", str(tmp_path))
    loaded = models.session().get_component("data_loader").load_service_model("s3", "paginators-1")
    assert loaded["pagination"]["ListObjectsV2"]["input_token"] == "x"
    assert loaded == Loader(extra_search_paths=[str(tmp_path)]).load_service_model("s3", "paginators-1")


def test_a_warmed_session_loads_with_the_model_loader_and_fetches(s3: LocalS3, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "_WARM_SESSIONS", {})
    s3.client().create_bucket(Bucket="models")
    s3.client().put_object(Bucket="models", Key="p/a.bin", Body=b"abc" * 100)
    remote = Remote(RemoteConfig(url="s3://models/p", storage_options=storage_options(s3.endpoint)))
    assert remote.warm_session()
    (warmed,) = client._WARM_SESSIONS.values()
    assert isinstance(warmed.get_component("data_loader"), models.ModelLoader)

    async def fetch() -> bytes:
        try:
            (obj,) = remote.list_objects()
            return await remote.fetch(obj)
        finally:
            await remote.aclose()

    assert asyncio.run(fetch()) == b"abc" * 100


def test_a_users_own_session_is_used_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiobotocore.session import AioSession

    monkeypatch.setattr(client, "_WARM_SESSIONS", {})
    own = AioSession()
    options = {**storage_options("http://127.0.0.1:9"), "session": own}
    Remote(RemoteConfig(url="s3://models/p", storage_options=options)).warm_session()
    assert not isinstance(own.get_component("data_loader"), models.ModelLoader)
