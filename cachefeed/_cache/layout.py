"""Where everything lives inside a cache directory, and how to list it without trusting it.

::

    <root>/                 mode cache.dir_mode (0750): the trainers' group may read
      CACHEDIR.TAG          marks the directory as a cache for backup tools; also cachefeed's "this is a cache"
      lock                  the writer lock: flock(LOCK_EX) held by the daemon; its text names the holder
      status.json           the daemon's status document (see cachefeed/_status/schema.py)
      sources.json          the named sources ([[source]]), their tags and weights (see _cache/sources.py)
      budget.json           the budget and the epoch room a snapshot may pin (see _cache/room.py)
      made_with.json        the settings each source's cached samples were made with (see _cache/sources.py)
      classes.json          the class index of sampler.label (see cachefeed/_labels.py)
      segments/<seq>.seg    published segments; <seq> is 16 hex digits, increasing: the name orders by age
      tmp/<seq>.tmp         segments being written (removed at start-up: only the writer writes here)
      tmp/sampler-<i>.writing  the object sampler i is writing, for the supervisor if it dies (_daemon/protocol.py)
      snapshots/<id>.lock   an epoch pin's lock (see _cache/snapshots.py), created locked
      snapshots/<id>/       hard links to the pinned segments, plus MANIFEST and the trainers' marks: rank claims,
                            AHEAD, LEFT, what each rank served (see _cache/snapshots.py and _cache/reads.py)

File names never derive from remote keys: segments are named by sequence number, snapshots by a name the trainer
side builds from a run id and an epoch number (validated against ``SNAPSHOT_ID``). Listing functions here only
return regular files whose names match the expected pattern, checked with ``lstat``: symlinks, FIFOs and foreign
files are never followed or served.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from cachefeed._errors import CacheUnusableError, NoSuchCacheError

__all__ = [
    "DAEMON_RESTART_WINDOW_S",
    "SEGMENT_NAME",
    "SNAPSHOT_ENTRY_BYTES",
    "SNAPSHOT_FIXED_BYTES",
    "SNAPSHOT_ID",
    "CacheLayout",
    "LockHolder",
    "metadata_bytes",
    "read_holder",
    "segment_name",
    "segment_seq",
    "write_holder",
]

SEGMENT_NAME = re.compile(r"^[0-9a-f]{16}\.seg$")
SNAPSHOT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_LOOKED_AT = 64  # entries of a directory looked at to judge it (a dataset's root may hold millions)
# The names the layout uses (the properties below), the read ledger's (``reads.LEDGER_NAME``), and those a
# filesystem itself keeps at its mount point (a fresh one's ``lost+found``, quota files): what may be in a directory
# that becomes a cache (``CacheLayout.refusal``); restart catalogs are ``catalog-*.cfcat`` and pass files
# ``pass-*.cfpass`` (``CacheLayout._is_own``).
_OWN_NAMES = frozenset(
    {"segments", "tmp", "snapshots", "lock", "status.json", "CACHEDIR.TAG", "sources.json", "made_with.json"}
    | {"budget.json", "classes.json", "reads"}
    | {"lost+found", "aquota.user", "aquota.group", "quota.user", "quota.group"}
)
DAEMON_RESTART_WINDOW_S = 300.0  # a daemon whose status is this fresh is restarting, not gone (had_writer_within)
_TMP_NAME = re.compile(r"^[0-9a-f]{16}\.tmp$")
# What one more snapshot of N segments costs on disk, at most: per segment a directory entry for its hard link
# (ext4: 8 bytes + the 20-byte name, in leaf blocks an htree split may leave half empty) and its MANIFEST entry
# (msgpack [name, count, reads, tag] <= 37 bytes); per snapshot its directory's first and index blocks, the
# MANIFEST's last partial block and source table (at most MAX_SOURCES x ~80 bytes, _cache/sources.py), the lock file
# and the READ mark. Its rank claims (RANK.<k>, one per local rank, however many: _cache/snapshots.py) and its
# AHEAD and LEFT marks are empty files, an inode and a directory entry each with no data block, so the charge
# does not depend on the rank count, which the daemon does not know. Measured on ext4 with 9,000 segments, and
# with few segments pinned by several local ranks: see tests/cache/test_bound.py, which fails if either constant is
# too small.
SNAPSHOT_ENTRY_BYTES = 128
SNAPSHOT_FIXED_BYTES = 32 << 10
_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by cachefeed.\n"
    "# For information about cache directory tags, see https://bford.info/cachedir/\n"
)


def segment_name(seq: int) -> str:
    return f"{seq:016x}.seg"


def segment_seq(name: str) -> int:
    return int(name[:16], 16)


@dataclass(frozen=True, slots=True)
class LockHolder:
    """Who took the cache's lock last, as the lock file says: the daemon writes itself there once it holds the lock
    (``write_holder``), and a daemon refused, ``cachefeed status`` and a daemon's start read it (``read_holder``)."""

    pid: int
    host: str
    since: str


def write_holder(fd: int) -> None:
    """Write this process into the lock file open on ``fd`` (its lock held)."""
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
    text = json.dumps(me).encode()
    os.pwrite(fd, text, 0)
    os.ftruncate(fd, len(text))


def read_holder(fd: int) -> LockHolder | None:
    """The holder the lock file open on ``fd`` names; None where it names nobody (empty, or half written by a
    daemon that took the lock a moment ago). Raises OSError where the file cannot be read."""
    try:
        who = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
        return LockHolder(int(who["pid"]), str(who["host"]), str(who["since"]))
    except (ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The paths of one cache directory. Creating it is the writer's job (``create``); readers only ``check``."""

    root: Path

    @property
    def segments(self) -> Path:
        return self.root / "segments"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def snapshots(self) -> Path:
        return self.root / "snapshots"

    @property
    def lock_file(self) -> Path:
        return self.root / "lock"

    @property
    def status_file(self) -> Path:
        return self.root / "status.json"

    def has_writer(self) -> bool:
        """Whether a daemon (or any ``CacheStore``) holds the cache's writer lock now. Read-only: a shared,
        non-blocking ``flock`` that fails while the writer holds its exclusive one; a cache that cannot be
        checked counts as having one (the caller then behaves as with a daemon)."""
        return self.writer_state() is not False

    def had_writer_within(self, seconds: float) -> bool:
        """``has_writer``, or a daemon wrote its status within ``seconds``: one restarting (systemd's restart delay,
        a crash loop, a pod replaced) rather than a static cache, which no daemon has run on for longer."""
        if self.has_writer():
            return True
        try:
            return time.time() - os.stat(self.status_file).st_mtime < seconds
        except OSError:
            return False

    def writer_state(self) -> bool | None:
        """``has_writer``, with None where it cannot be told (the lock file exists but cannot be opened)."""
        try:
            fd = os.open(self.lock_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return None
        finally:
            os.close(fd)
        return False

    def lock_holder_pid(self) -> int | None:
        """The pid the lock file names: the daemon that took the lock last writes itself there (``CacheStore``);
        None where the file is missing, unreadable or names nobody."""
        try:
            fd = os.open(self.lock_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            holder = read_holder(fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        return None if holder is None else holder.pid

    @property
    def tag_file(self) -> Path:
        return self.root / "CACHEDIR.TAG"

    @property
    def sources_file(self) -> Path:
        """The configured sources, their tags and weights (``cachefeed/sources.py``)."""
        return self.root / "sources.json"

    def writing_file(self, index: int) -> Path:
        """The object sampler ``index`` is writing (``_daemon/protocol.py``, beside the socket); in ``tmp/``."""
        return self.tmp / f"sampler-{index}.writing"

    @property
    def made_with_file(self) -> Path:
        """The settings each source's cached samples were made with (``cachefeed/_cache/sources.py``)."""
        return self.root / "made_with.json"

    @property
    def budget_file(self) -> Path:
        """The budget and the epoch room one snapshot may pin (``cachefeed/_cache/room.py``)."""
        return self.root / "budget.json"

    def catalog_file(self, tag: int) -> Path:
        """The restart catalog of source ``tag`` (``cachefeed/_daemon/catalog_file.py``); metadata in the budget."""
        return self.root / f"catalog-{tag:08x}.cfcat"

    def pass_file(self, tag: int) -> Path:
        """How far source ``tag``'s current pass got (``cachefeed/_daemon/pass_file.py``); metadata in the budget."""
        return self.root / f"pass-{tag:08x}.cfpass"

    @property
    def classes_file(self) -> Path:
        """The class index of ``sampler.label`` (``cachefeed/_labels.py``)."""
        return self.root / "classes.json"

    def create(self, *, dir_mode: int = 0o750, file_mode: int = 0o640) -> None:
        """Create the directories with explicit modes. Refuses a root or subdirectory that is a symlink.

        The root gets ``dir_mode`` only when this call creates it: an existing root (made by the user, or by an
        earlier run) keeps its mode and owner, whoever runs the daemon; one the daemon's user cannot write is
        refused with its mode and owner. The subdirectories are the daemon's and always get their mode.

        Raises:
            CacheUnusableError: the directory cannot be created or written (the message names path and cause), or
                an existing one can never be a cache (``refusal``: a directory of other files, say).
        """
        try:
            self._create(dir_mode, file_mode)
        except OSError as exc:
            raise CacheUnusableError(
                f"cache.dir {self.root}: cannot create or write {exc.filename or self.root} "
                f"({exc.strerror or exc}): fix the path or its permissions"
            ) from None

    def _create(self, dir_mode: int, file_mode: int) -> None:
        try:
            self.root.mkdir(mode=dir_mode, parents=True)
            is_ours = True
        except FileExistsError:
            is_ours = False  # the user's (or an earlier run's) directory: its mode is kept, see below
        for directory in (self.root, self.segments, self.tmp, self.snapshots):
            try:
                directory.mkdir(mode=dir_mode)
            except FileExistsError:
                pass
            info = os.lstat(directory)
            if not stat.S_ISDIR(info.st_mode):
                where = "" if directory == self.root else f": {directory}"
                raise CacheUnusableError(f"cache.dir {self.root}{where} {_not_a_directory(info)}")
            if directory == self.root and not is_ours:
                self._check_usable_root(info)
                why = self.refusal()
                if why is not None:
                    raise CacheUnusableError(f"cache.dir {self.root}: {why}")
                continue
            os.chmod(directory, self._mode_of(directory, dir_mode), follow_symlinks=False)
        if not self.tag_file.exists():
            fd = os.open(self.tag_file, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, file_mode)
            with os.fdopen(fd, "w") as handle:
                handle.write(_TAG)

    def _check_usable_root(self, info: os.stat_result) -> None:
        """An existing root keeps its mode and owner (a directory the daemon did not create is not its to change,
        run as root or not); one the daemon's user cannot write is refused, saying so."""
        if os.access(self.root, os.W_OK | os.X_OK) or os.statvfs(self.root).f_flag & os.ST_RDONLY:
            return  # a read-only filesystem fails on the first write, which names it
        raise CacheUnusableError(
            f"cache.dir {self.root}: exists with mode {stat.S_IMODE(info.st_mode):04o} and owner uid {info.st_uid}, "
            f"not writable by uid {os.geteuid()} (the daemon's user); the daemon never changes the mode of a "
            "directory it did not create: make it writable for that user (chown or chmod) or choose another cache.dir"
        )

    def refusal(self) -> str | None:
        """Why ``root`` can never become a cache here, in words for an error; None where it can: it does not exist
        yet (the daemon creates it), it is a cache or one being made, or it is a directory the daemon may take.

        Never a cache: a path that is a file or a symbolic link, or lies below a file; a directory of other things
        (a dataset's root, however small, a home): one that holds any entry besides the cache's own names and a
        mount point's (``_is_own``). The daemon would charge them to its budget and evict around them, a cleanup of
        the cache would take them, and a trainer pointed at the dataset's root would wait for a cache there. An
        empty directory, or one cachefeed wrote, may become one. At most ``_LOOKED_AT`` entries are looked at. One
        rule for the daemon (``create``: exit 73), a trainer's wait for the cache and ``cachefeed status --watch``."""
        try:
            info = os.lstat(self.root)
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            above = next((parent for parent in self.root.parents if parent.exists()), self.root.parent)
            return f"{above} is a file, not a directory"
        except OSError:
            return None  # no permission to look: what the daemon or the reader meets next says so
        if not stat.S_ISDIR(info.st_mode):
            return _not_a_directory(info)
        if self.tag_file.exists():
            return None  # a cache (whatever else someone put in it since)
        others, more = [], False
        try:
            with os.scandir(self.root) as entries:
                for count, entry in enumerate(entries):
                    if count >= _LOOKED_AT:
                        more = True
                        break
                    if not self._is_own(entry.name):
                        others.append(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else ""))
        except OSError:
            return None
        if not others:
            return None
        others.sort()
        shown = ", ".join(others[:3]) + (" and more" if more or len(others) > 3 else "")
        return (
            f"holds files that are not a cachefeed cache ({shown}): the daemon needs a directory of its own: "
            "choose an empty or new cache.dir, or empty this one"
        )

    def _is_own(self, name: str) -> bool:
        """A name the cache's layout uses (any of them: a cache being made, or one whose segments/ was removed), a
        hidden name, or one a filesystem keeps at its mount point (``lost+found``, quota files)."""
        return (
            name in _OWN_NAMES
            or name.startswith(".")
            or (name.startswith("catalog-") and name.endswith(".cfcat"))
            or (name.startswith("pass-") and name.endswith(".cfpass"))
        )

    def _mode_of(self, directory: Path, dir_mode: int) -> int:
        """snapshots/ is where trainers write: if the group may read the cache, it may pin too.

        Group write lets trainers of the cache's group create snapshots; setgid keeps their files in that group;
        the sticky bit stops one trainer from deleting another's pins (the daemon owns the directory and sweeps).
        """
        if directory == self.snapshots and dir_mode & 0o050 == 0o050:
            return dir_mode | 0o070 | stat.S_ISGID | stat.S_ISVTX
        return dir_mode

    def check(self) -> None:
        """Raise NoSuchCacheError unless ``root`` is an existing cachefeed cache."""
        try:
            info = os.lstat(self.root)
        except FileNotFoundError:
            raise NoSuchCacheError(
                f"no cache at {self.root}: start the daemon (cachefeed daemon --config FILE) or check the path"
            ) from None
        except NotADirectoryError:  # a path below a file (data.npy/cache)
            raise NoSuchCacheError(f"no cache at {self.root}: {self.refusal()}") from None
        if not stat.S_ISDIR(info.st_mode):
            raise NoSuchCacheError(f"{self.root} is not a directory")
        if not (self.tag_file.is_file() and self.segments.is_dir()):
            raise NoSuchCacheError(f"{self.root} is not a cachefeed cache (no CACHEDIR.TAG or segments/)")

    def list_segments(self) -> list[tuple[str, os.stat_result]]:
        """Published segments as (name, lstat), oldest first. Foreign entries are skipped, never followed."""
        return list_regular(self.segments, SEGMENT_NAME)


def list_regular(directory: Path, pattern: re.Pattern[str]) -> list[tuple[str, os.stat_result]]:
    """Regular files in ``directory`` whose name matches ``pattern``, sorted by name, with their lstat."""
    found: list[tuple[str, os.stat_result]] = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if not pattern.match(entry.name):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed while we listed
                if stat.S_ISREG(info.st_mode):
                    found.append((entry.name, info))
    except FileNotFoundError:
        return []
    found.sort(key=lambda item: item[0])
    return found


def allocated_bytes(info: os.stat_result) -> int:
    """Bytes a file really occupies (st_blocks is in 512-byte units on Linux)."""
    return int(info.st_blocks) * 512


def metadata_bytes(layout: CacheLayout) -> int:
    """Allocated bytes of everything in the cache that is not segment data, each inode once.

    That is the root, ``segments/``, ``tmp/`` and ``snapshots/`` directories themselves (on ext4 a directory keeps
    the blocks it grew to), every snapshot's directory, MANIFEST, lock file and marks, receipts, the read ledger,
    ``status.json``, the lock and the tag. Segment files (``segments/*.seg``, ``tmp/*.tmp`` and the snapshots'
    links to them) are the budget's data terms and are skipped by name, without a ``stat``.
    """
    total = 0
    seen: set[int] = set()

    def charge(path: str) -> None:
        nonlocal total
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return  # removed while we looked
        if info.st_ino not in seen:
            seen.add(info.st_ino)
            total += allocated_bytes(info)

    def walk(directory: str, data: re.Pattern[str] | None, depth: int) -> None:
        charge(directory)
        try:
            with os.scandir(directory) as entries:
                listed = [(e.path, e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        except (FileNotFoundError, NotADirectoryError):
            return
        for path, name, is_dir in listed:
            if data is not None and data.match(name):
                continue
            if is_dir and depth > 0:
                walk(path, SEGMENT_NAME, depth - 1)  # a snapshot's directory: links to segments, and its files
            else:
                charge(path)

    charge(str(layout.root))
    for name in os.listdir(layout.root):
        path = os.path.join(layout.root, name)
        if path == str(layout.segments):
            walk(path, SEGMENT_NAME, 0)
        elif path == str(layout.tmp):
            walk(path, _TMP_NAME, 0)
        elif path == str(layout.snapshots):
            walk(path, None, 1)
        else:
            charge(path)
    return total


def _not_a_directory(info: os.stat_result) -> str:
    """Why a path (its lstat ``info``) cannot be a cache directory, and what to do: a symbolic link is not followed
    (the cache's paths are opened with ``O_NOFOLLOW``: a link swapped in a shared place would move the writes),
    anything else is in the way."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link, which cachefeed does not follow: name the directory it points to"
    what = "a file" if stat.S_ISREG(info.st_mode) else "not a directory"
    return f"is {what}: move it away or choose another cache.dir"
