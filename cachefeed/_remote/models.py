"""botocore's data loader for the sessions the daemon warms, without two costs of a first S3 client.

NOTE [ botocore's models, loaded once and plainly ]
    Making a session's first client loads botocore's data: the endpoints of every AWS service (``endpoints.json``,
    over a megabyte), the S3 model and its endpoint rules, and a few small files. The supervisor does this once in
    its start (NOTE [ Warmed session ] in ``client.py``), which every cold job waits for, and the samplers forked
    after it inherit what it loaded. Two parts of that load cost more than the data calls for:

    * botocore's ``JSONFileLoader`` parses every file into ``OrderedDict`` objects (``object_pairs_hook``), built in
      Python one pair at a time: slower than ``json.loads``'s own dicts, and larger (the benchmark below prints the
      warm-up's CPU with each loader). Since Python 3.7 a plain ``dict`` keeps the file's order, and botocore reads
      the loaded data only as mappings (nothing in it calls ``move_to_end`` or ``popitem(last=False)``), so
      ``PlainJSONFileLoader`` parses into plain dicts. ``tests/remote/test_models.py`` checks that both give the
      same data in the same order.
    * Before loading a service's model, ``Loader.load_service_model`` checks that botocore knows the service by
      listing every service directory it ships and each one's API versions: hundreds of directory listings and
      thousands of ``stat`` calls, for the one name asked. ``ModelLoader.list_available_services`` answers ``in``
      for that one name (the same rule: a directory under a search path with an API version that holds the file)
      and lists every service only when something reads the whole list (botocore's error for an unknown name,
      ``Session.get_available_services``).

    ``python -m benchmarks.first_request`` prints what the supervisor's warm-up costs with and without this loader. Only
    the sessions cachefeed makes use it: a user's own ``storage_options["session"]`` is used as given, and a
    sampler started as a fresh interpreter lets s3fs build its session, as before. Where botocore's loader changes
    shape (no ``JSONFileLoader.load_file``, no ``Loader.list_available_services``), ``session`` returns botocore's
    own session unchanged.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any, overload

from aiobotocore.session import AioSession
from botocore.loaders import JSONFileLoader, Loader

__all__ = ["ModelLoader", "PlainJSONFileLoader", "session"]


def _payload(file_path: str) -> bytes | None:
    """The bytes of ``file_path`` + ``.json``, else of ``.json.gz`` uncompressed (the kinds botocore ships, in the
    order it tries them), else None."""
    if os.path.isfile(file_path + ".json"):
        with open(file_path + ".json", "rb") as handle:
            return handle.read()
    if os.path.isfile(file_path + ".json.gz"):
        with gzip.open(file_path + ".json.gz", "rb") as compressed:
            return compressed.read()
    return None


class PlainJSONFileLoader(JSONFileLoader):  # type: ignore[misc]  # botocore ships no annotations
    """``JSONFileLoader`` that parses into plain dicts (NOTE above); a file kind it does not know, botocore loads."""

    def load_file(self, file_path: str) -> Any:
        payload = _payload(file_path)
        if payload is None:
            return super().load_file(file_path)
        return json.loads(payload.decode("utf-8"))


class KnownServices(Sequence[str]):
    """What ``Loader.list_available_services(type_name)`` answers, listed only when read as a whole: ``name in``
    looks for that one service (NOTE above)."""

    def __init__(self, loader: Loader, type_name: str) -> None:
        self._loader = loader
        self._type_name = type_name
        self._listed: list[str] | None = None

    def __contains__(self, name: object) -> bool:
        if self._listed is not None:
            return name in self._listed
        if not isinstance(name, str) or not name or os.sep in name or name.startswith("."):
            return False
        for root in self._loader.search_paths:
            directory = os.path.join(root, name)
            try:
                versions = os.listdir(directory)
            except OSError:  # no such service there (or no such search path): try the next
                continue
            if any(self._loader.file_loader.exists(os.path.join(directory, v, self._type_name)) for v in versions):
                return True
        return False

    def _all(self) -> list[str]:
        if self._listed is None:
            self._listed = list(Loader.list_available_services(self._loader, self._type_name))
        return self._listed

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        return self._all()[index]


class ModelLoader(Loader):  # type: ignore[misc]  # botocore ships no annotations
    """botocore's ``Loader`` with plain-dict parsing and a one-name service check (NOTE above)."""

    FILE_LOADER_CLASS = PlainJSONFileLoader

    def list_available_services(self, type_name: str) -> KnownServices:
        return KnownServices(self, type_name)


def _search_paths(data_path: str | None) -> list[str] | None:
    """The extra search paths botocore makes of its ``data_path`` setting (``AWS_DATA_PATH``), or None."""
    if data_path is None:
        return None
    return [os.path.expanduser(os.path.expandvars(path)) for path in data_path.split(os.pathsep)]


def session(**kwargs: Any) -> AioSession:
    """An ``AioSession(**kwargs)`` whose data loader is a ``ModelLoader`` searching where botocore's would."""
    made = AioSession(**kwargs)
    if not callable(getattr(JSONFileLoader, "load_file", None)) or not callable(
        getattr(Loader, "list_available_services", None)
    ):
        return made
    made.register_component(
        "data_loader", ModelLoader(extra_search_paths=_search_paths(made.get_config_variable("data_path")))
    )
    return made
