"""Labels from paths: the class index of a dataset laid out as ``<root>/<class>/<name>`` (``sampler.label``).

The index is built by the daemon from the *whole* remote listing, never from what happens to be cached (a rolling
cache may not hold every class yet), and kept in the cache directory (``classes.json``, ``CacheLayout.classes_file``)
so that trainers read the same list (``EpochLoaderFactory.classes``). Indices are stable: the first listing numbers
the classes in sorted order; a class that appears in a later listing gets the next free index (one log line says
so); a class that disappears keeps its index. A daemon restarted on the same cache continues the same index, and
nodes that list the same remote build the same one.

The file is the contract between the daemon (writer) and trainers (readers)::

    {"version": 1, "rule": "parent", "classes": ["cat", "dog", ...]}   # class i is classes[i]

It is replaced atomically (write to a temporary file, rename), so a reader sees the old list or the new one.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable
from pathlib import Path

from cachefeed._errors import CachefeedError
from cachefeed._fsutil import atomic_write
from cachefeed._logs import get_logger

__all__ = ["LABEL_RULES", "ClassIndex", "class_name", "read_classes"]

log = get_logger(__name__)

LABEL_RULES = ("parent",)  # the registry: config validates sampler.label against it
FORMAT_VERSION = 1


def class_name(path: str, rule: str) -> str:
    """The class of the object at ``path`` under ``rule`` (``"parent"``: the name of its directory)."""
    if rule != "parent":
        raise ValueError(f"unknown label rule {rule!r}")
    return posixpath.basename(posixpath.dirname(path.rstrip("/")))


class ClassIndex:
    """The daemon's side: class name -> index, persisted in ``path`` (see the module docstring)."""

    def __init__(self, path: Path, rule: str, *, file_mode: int = 0o640) -> None:
        self.path = path
        self.rule = rule
        self._file_mode = file_mode
        self.classes: list[str] = read_classes(path) if path.exists() else []
        self._index = {name: i for i, name in enumerate(self.classes)}
        self._said_one_class = False

    def update(self, paths: Iterable[str]) -> list[str]:
        """Add the classes of a listing that are not indexed yet (sorted, after the known ones); save if any.
        Returns the new class names."""
        return self.add({class_name(path, self.rule) for path in paths})

    def add(self, found: Iterable[str]) -> list[str]:
        """Add class names not indexed yet (sorted, after the known ones); save if any. The daemon calls this
        with each listing page's names, before the page's objects are handed out; pages come in path order
        (``_remote/listing.py``), so a ``<root>/<class>/<name>`` layout still numbers its classes in sorted
        order, and nodes reading the same pages build the same index. Returns the new class names."""
        new = sorted(set(found) - self._index.keys())
        if new:
            first = len(self.classes)
            for name in new:
                self._index[name] = len(self.classes)
                self.classes.append(name)
            self._save()
            if first:
                log.info(
                    "%d new classes in the listing get indices %d..%d: %s",
                    len(new),
                    first,
                    len(self.classes) - 1,
                    ", ".join(new[:10]) + (", ..." if len(new) > 10 else ""),
                )
            else:
                log.info(
                    "%d %s from the listing (%s)",
                    len(new),
                    "class" if len(new) == 1 else "classes",
                    ", ".join(new[:10]) + ("..." * (len(new) > 10)),
                )
        return new

    def check_listing(self) -> None:
        """After a whole listing: a single class labels every sample 0, which is what ``"parent"`` gives a flat
        layout or webdataset shards in one directory (their label is usually a member, ``cls``). Said once, as a
        warning naming the class: the config is valid (a one-class dataset exists), but most likely not meant."""
        if len(self.classes) != 1 or self._said_one_class:
            return
        self._said_one_class = True
        log.warning(
            "sampler.label = %r found one class in the whole listing, %r: every sample gets label 0. The label is "
            "the index of each object's directory (<root>/<class>/<name>); webdataset shards usually carry theirs as "
            "a member (.cls), which is a field of its own: remove sampler.label, or lay the objects out by class",
            self.rule,
            self.classes[0],
        )

    def label(self, path: str) -> int:
        """The index of ``path``'s class (KeyError if the listing that holds it was not given to ``update``)."""
        return self._index[class_name(path, self.rule)]

    def _save(self) -> None:
        doc = {"version": FORMAT_VERSION, "rule": self.rule, "classes": self.classes}
        atomic_write(self.path, json.dumps(doc).encode(), mode=self._file_mode)


def read_classes(path: Path) -> list[str]:
    """The class names of a cache's ``classes.json`` (``[]`` when the daemon does not label by path)."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise CachefeedError(f"{path}: cannot read the class index: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION or not isinstance(doc.get("classes"), list):
        raise CachefeedError(f"{path}: not a class index of version {FORMAT_VERSION}")
    return [str(name) for name in doc["classes"]]
