"""The worker pool: reader processes that live as long as the factory and feed every epoch, batch by batch.

Why not a DataLoader per epoch (what the factory used before): the training thread of an eager model holds the GIL
most of the time, and every piece of per-batch Python on its process is paid by the accelerator. A DataLoader
worker returns each batch as freshly allocated shared memory whose file descriptor the training process fetches
from the worker over a socket (``multiprocessing.resource_sharer``: a connection, an HMAC handshake, ``recvmsg``,
``mmap``), about 1.5 ms per batch on 2 cores, and a DataLoader per epoch forks its workers again every epoch. Here
the workers start once, collate into shared memory the training process mapped once (``arena.py``), and a batch
costs the training thread one small ``recv`` and a few tensor views (``benchmarks/feed.py`` has the figures).

NOTE [ Feed protocol ]
----------------------
Processes: the *training process* (its training thread reads batches, its build thread opens passes, its teardown
thread forgets epochs) and ``num_workers`` *workers*, started on the first pass with the DataLoader's start method
(fork, forkserver or spawn). Per worker: one task pipe (training process -> worker), one result pipe (worker ->
training process), one arena (``arena.py``). Messages are pickled tuples; each pipe is FIFO.

* ``("epoch", key, dataset)``: a ``SnapshotDataset`` (its index only: readers are opened lazily, in the worker),
  sent before the first batch of ``key`` that the worker gets;
* ``("batch", key, indices, freed)``: read ``indices`` (int64, as bytes) of dataset ``key``, collate them into a
  region of the arena, reply. ``freed`` lists ``(offset, nbytes)`` regions the training process no longer uses
  (every tensor over them is gone; with ``pin_memory``, and the GPU past every copy from them: NOTE [ Pinned
  arenas ] in ``pinning.py``); only then may the worker reuse them;
* ``("forget", key, ticket, freed)``: close dataset ``key``'s segment readers, then store ``ticket`` in the arena's
  ack word. ``forget`` waits for that word before the epoch's pin is dropped, so a released snapshot's segments
  are unmapped by every worker before the daemon may delete them (its space is really free when it says so);
* ``("extend", key, names, counts)``: dataset ``key`` (an epoch over a growing snapshot) gained these segments
  (``SnapshotDataset.extend``); sent to the workers that hold ``key`` before any batch that reads them (a worker
  that learns ``key`` later gets the dataset with them). NOTE [ Growing snapshots ] in ``growing.py``;
* ``("grow", end)``: regions may now be cut up to ``end`` of the arena, in a new span (``arena.py``). Sent to every
  worker once a batch did not fit a worker's arena ``prefetch_factor + 2`` times (its size came with its
  ``inline`` reply); with ``pin_memory``, after the new span was registered, so no batch lands in it unpinned;
* ``None``: exit.

Replies, one per batch and in the order of that worker's tasks: ``("region", offset, nbytes, skeleton id, leaves,
skeleton or None)``: the batch lies in that region of the arena; its layout (``collate.py``) travels split into a
*skeleton* (the structure, the tensors' dtypes, shapes and offsets: the same for every full batch) and its *leaves*
(the values without tensors, such as the samples' keys). A worker numbers the skeletons it sends and sends each
one once, with the first batch that has it; the training process compiles it then (``worker.learn``, for every
reply, read or dropped) and builds later batches from the id alone. ``("inline", batch, need, end)`` (the arena
was full: the batch itself, pickled, the bytes it needed and the arena's end then), ``("empty",)`` (every record
corrupt) or ``("error", ExceptionWrapper)``.

Order: batches are dealt round robin, at most ``prefetch_factor`` outstanding per worker, and read back in the order
they were sent, so every pass yields its batches in its sampler's order (as a DataLoader with ``in_order=True``).
Passes are queued: the next epoch's pass, opened by the build thread while the current epoch runs, is dealt as soon
as the current one has dealt all its batches, so the workers never idle at an epoch boundary. Results of a pass
that was abandoned (a later pass began, or the epoch was released) are dropped when they arrive.

Scheduling: workers run under ``SCHED_BATCH`` (``cachefeed/_sched.py``, with the figures). Every task the training
thread sends wakes a worker; under the default policy a woken worker may preempt the thread that woke it, inside
its ``write``, when the worker lands on its core.

Death: a worker exits on ``None``, when the training process is gone (``multiprocessing.parent_process()``: its
parent with fork, not the fork server's; checked every 0.5 s while idle) or
when a pipe breaks. A thread of each worker reads its task pipe as fast as tasks come, so the training process
never blocks on a send (a pipe holds 64 KiB; an epoch's index for thousands of segments is more). The training
thread waits on the result pipe *and* the worker's sentinel, so a worker that dies raises ``RuntimeError`` naming
its pid and exit code instead of hanging. The pass being read when a death is found raises (again on every later
``next``); the next pass read (the next epoch) starts a new worker in its place first, on the training thread, and
every other pass that had batches dealt to the dead worker (the next epoch's, queued before this one ended) is
dealt again from its first unread batch, so it is read whole. Arenas are memfds: nothing is left on any
filesystem, whoever is killed.

Why one long module: it is both sides of one protocol (NOTE [ Feed protocol ]): the training process's pool and
the worker's loop must agree message for message, so they are read together.
"""

from __future__ import annotations

import gc
import itertools
import mmap
import multiprocessing
import os
import pickle
import queue
import random
import select
import sysconfig
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data._utils import worker as torch_worker

from cachefeed._errors import SnapshotError
from cachefeed._logs import get_logger
from cachefeed._sched import yield_to_training
from cachefeed._trainer.arena import ACK_WORD, HEADER_BYTES, Allocator, Arena, grown_end
from cachefeed._trainer.collate import ROW_COPY_BYTES, Builder, RowCollator, collate_into, compile_skeleton, split
from cachefeed._trainer.dataset import SnapshotDataset, as_tensors
from cachefeed._trainer.growing import GrowingEpoch
from cachefeed._trainer.pinning import PinnedArenas
from cachefeed._units import format_bytes

__all__ = ["ARENA_BYTES", "EmptyBatch", "Pass", "WorkerPool"]

log = get_logger(__name__)

ARENA_BYTES = 256 << 20  # per worker at start, sparse: memory is used only as far as batches reach (see arena.py)
_RESERVE_SHARE = 4  # the workers' arenas may grow to this fraction of the machine's memory together
_IDLE_CHECK_S = 0.5  # a waiting worker checks this often that its parent is alive
_FORGET_TIMEOUT_S = 10.0
_PICKLE = pickle.HIGHEST_PROTOCOL


class EmptyBatch:
    """A batch whose every record was corrupt; the epoch iterator drops it."""

    __slots__ = ()


# -- the worker process ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _WorkerSpec:
    """What a worker is started with, besides its pipes and arena."""

    index: int
    num_workers: int
    collate: Callable[[list[Any]], Any] | None
    worker_init_fn: Callable[[int], None] | None
    seed: int
    parent: int
    arena_end: int  # regions are cut below this until a ``grow``


# NOTE [ A worker's collector skips what it inherited ]
# A forked worker holds every object of the training process (torch and its modules, the user's model and data:
# hundreds of thousands of objects), on pages it shares with that process until one of them writes to a page.
# The cyclic collector's full collection writes to every object it tracks (its reference count copy), so a
# worker's first one walks all of them and copies every page they are on. That collection comes when the
# worker's own allocations reach its threshold, whenever that is: with 670,692 objects in the training
# process, 143 ms of CPU and 17,427 pages copied (``python -m benchmarks.worker_collection``, which measures it in
# the worker; 0.3 ms and 3 pages once frozen). In a cold 4 KiB epoch of ``benchmarks.run_all`` both workers did so
# at once, and the training loop waited for its next batch meanwhile (traced). So a worker freezes
# (``gc.freeze``) what exists when it starts: the collector leaves those objects alone for the worker's life,
# and collects what the worker allocates as usual. A full collection still empties the interpreter's free lists
# (tuples, lists, dicts, floats kept for reuse), whose inherited entries it frees: a cost bounded by their caps,
# far below the walk. The trade: garbage that was already in the training process at the fork is never finalized
# in the worker (it is never used there either, and stays shared). A worker started by forkserver or spawn
# freezes only its own start. On a free-threaded Python, freezing marks every object, which would copy every page
# at the worker's start: there the worker does not freeze. The daemon freezes its start in the supervisor, before
# it forks samplers (NOTE [ A daemon's start without the cyclic GC ] in ``_cli/daemon.py``); a forked sampler
# collects once and then freezes, because it closes the descriptors it inherited right after
# (``sampler.serve_forked``). A worker closes none of them, so it freezes without collecting.


def _worker_main(spec: _WorkerSpec, tasks: Connection, results: Connection, arena: Arena) -> None:
    """A worker's life (NOTE above): seed as a DataLoader worker would, then serve tasks until told to stop."""
    if not sysconfig.get_config_var("Py_GIL_DISABLED"):
        gc.freeze()  # NOTE [ A worker's collector skips what it inherited ]
    index, num_workers, collate, seed, parent = spec.index, spec.num_workers, spec.collate, spec.seed, spec.parent
    worker_init_fn = spec.worker_init_fn
    direct = os.getppid() == parent  # forked or spawned by the trainer, not by a fork server
    torch.set_num_threads(1)
    yield_to_training()
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    datasets: dict[int, SnapshotDataset] = {}
    _set_worker_info(index, num_workers, seed, None)
    if worker_init_fn is not None:
        worker_init_fn(index)
    allocator = Allocator(HEADER_BYTES, spec.arena_end)
    skeletons: dict[Any, int] = {}  # the layouts' skeletons sent so far, by id (see the replies in the NOTE)
    need = [0]  # the size of the last region that did not fit

    def allocate(nbytes: int) -> tuple[int, Any]:
        offset = allocator.allocate(nbytes)
        if offset is None:
            need[0] = nbytes
            return -1, None
        return offset, arena.view(offset, nbytes)

    release = allocator.release

    inbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    threading.Thread(target=_drain_tasks, args=(tasks, inbox), name="cachefeed-tasks", daemon=True).start()
    try:
        while True:
            try:
                raw = inbox.get(timeout=_IDLE_CHECK_S)
            except queue.Empty:
                if _trainer_gone(parent, direct):
                    return
                continue
            message = None if raw is None else pickle.loads(raw)  # noqa: S301 (our own process's pipe)
            if message is None:
                return
            kind = message[0]
            if kind == "batch":
                _kind, key, raw, freed = message
                for offset, nbytes in freed:
                    allocator.release(offset, nbytes)
                indices = np.frombuffer(raw, dtype=np.int64)
                reply = _read_batch(
                    index, datasets[key], indices, collate, allocate, release=release, skeletons=skeletons
                )
                if reply[0] == "inline":
                    reply = (*reply, need[0], allocator.end)
                results.send_bytes(pickle.dumps(reply, protocol=_PICKLE))
            elif kind == "epoch":
                _kind, key, dataset = message
                datasets[key] = dataset
                _set_worker_info(index, num_workers, seed, dataset)
            elif kind == "extend":
                _kind, key, names, counts = message
                datasets[key].extend(names, counts)
            elif kind == "forget":
                _kind, key, ticket, freed = message
                for offset, nbytes in freed:
                    allocator.release(offset, nbytes)
                forgotten = datasets.pop(key, None)
                if forgotten is not None:
                    forgotten.close()
                arena.words[ACK_WORD] = ticket
            elif kind == "grow":
                allocator.grow(message[1])
    except (BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        return  # the training process is gone or stopping us


def _trainer_gone(parent: int, direct: bool) -> bool:
    """Whether the training process (pid ``parent``) died. A worker it started itself is orphaned then. Under
    forkserver the worker's parent is the fork server, which outlives the trainer: multiprocessing's sentinel of
    the process that asked for this one tells instead (for fork, the getppid test is kept: the sentinel's pipe is
    inherited by every process the trainer forks later, which would keep it open)."""
    if direct:
        return os.getppid() != parent
    starter = multiprocessing.parent_process()
    return starter is not None and not starter.is_alive()


def _drain_tasks(tasks: Connection, inbox: queue.SimpleQueue[bytes | None]) -> None:
    """A worker's task pipe, read as fast as it is written (a thread of the worker): the training process never
    blocks sending a task while the worker is busy, or blocked sending a large batch back (which would deadlock)."""
    try:
        while True:
            inbox.put(tasks.recv_bytes())
    except (EOFError, OSError):
        inbox.put(None)  # the training process closed the pipe or died: stop


def _set_worker_info(index: int, num_workers: int, seed: int, dataset: Any) -> None:
    """What ``torch.utils.data.get_worker_info()`` returns in a worker, as a DataLoader worker would see it."""
    torch_worker._worker_info = torch_worker.WorkerInfo(id=index, num_workers=num_workers, seed=seed, dataset=dataset)


def _read_batch(
    index: int,
    dataset: SnapshotDataset,
    indices: npt.NDArray[np.int64],
    collate: Callable[[list[Any]], Any] | None,
    allocate: Callable[[int], tuple[int, Any]],
    *,
    release: Callable[[int, int], None],
    skeletons: dict[Any, int],
) -> tuple[Any, ...]:
    try:
        offset, nbytes, layout = _collate_batch(dataset, indices, collate, allocate, release)
        if nbytes < 0:
            return ("empty",)
        if offset < 0:
            return ("inline", layout)
        leaves: list[Any] = []
        skeleton = split(layout, leaves)
        known = skeletons.get(skeleton)
        if known is not None:
            return ("region", offset, nbytes, known, leaves, None)
        skeletons[skeleton] = len(skeletons)
        return ("region", offset, nbytes, len(skeletons) - 1, leaves, skeleton)
    except Exception:
        return ("error", ExceptionWrapper(where=f"in cachefeed worker {index}"))  # type: ignore[no-untyped-call]


def _collate_batch(
    dataset: SnapshotDataset,
    indices: npt.NDArray[np.int64],
    collate: Callable[[list[Any]], Any] | None,
    allocate: Callable[[int], tuple[int, Any]],
    release: Callable[[int, int], None],
) -> tuple[int, int, Any]:
    """Read a batch and collate it into the arena: ``collate_into``'s ``(offset, nbytes, layout)``, with ``nbytes``
    -1 when every record was skipped. A batch of small samples (its first record under ``ROW_COPY_BYTES``), or one
    for the caller's collate function, is read whole, a segment at a time (``SnapshotDataset.read_items``). With
    default collation of larger samples each sample is copied as soon as it is read (``RowCollator``), unless the
    batch is not of the shape that helps; without a transform the reader's numpy arrays are copied as they are (no
    tensor per array), and turned into tensors only for the usual path."""
    arrays = collate is None and dataset.transform is None
    if collate is not None or not len(indices) or dataset.record_bytes(int(indices[0])) < ROW_COPY_BYTES:
        whole = dataset.read_items(indices, tensors=not arrays)  # type: ignore[arg-type]  # int64: see partition.py
        if not whole:
            return -1, -1, None
        collator = RowCollator.start(whole[0], len(whole), allocate, small=True) if arrays else None
        if collator is None:
            return collate_into(_tensors(whole, arrays), collate, allocate)
        for sample in whole[1:]:
            if not collator.add(sample):
                release(collator.offset, collator.nbytes)
                return collate_into(_tensors(whole, arrays), None, allocate)
        return collator.offset, collator.nbytes, collator.finish()
    samples = dataset.iter_items(indices, tensors=not arrays)  # type: ignore[arg-type]  # int64: see partition.py
    first = next(samples, None)
    if first is None:
        return -1, -1, None
    collator = RowCollator.start(first, len(indices), allocate) if collate is None else None
    if collator is None:
        return collate_into(_tensors([first, *samples], arrays), collate, allocate)
    read = [first]  # kept for the usual path, should a sample not fit the pattern
    for sample in samples:
        read.append(sample)
        if not collator.add(sample):
            release(collator.offset, collator.nbytes)
            return collate_into(_tensors([*read, *samples], arrays), None, allocate)
    return collator.offset, collator.nbytes, collator.finish()


def _tensors(samples: list[Any], arrays: bool) -> list[Any]:
    """``samples`` as the dataset hands them out (``as_tensors``) where they were read with their numpy arrays."""
    return [as_tensors(sample) for sample in samples] if arrays else samples


# -- the training process's side ---------------------------------------------------------------------------------


def _died(worker: _Worker) -> RuntimeError:
    """The error for a worker that is gone while the training thread waits for its batch."""
    worker.process.join(1.0)  # its pipe may close a moment before its exit status is known
    return RuntimeError(
        f"cachefeed worker {worker.index} (pid {worker.process.pid}) exited unexpectedly with exit code "
        f"{worker.process.exitcode}; its log lines above (if any) say why (a negative code is the signal that ended it)"
    )


class _Worker:
    """The training process's handle on one worker."""

    __slots__ = (
        "arena",
        "builders",
        "fenced",
        "freed",
        "index",
        "keys",
        "live",
        "outstanding",
        "poller",
        "process",
        "results",
        "tasks",
    )

    def __init__(self, index: int, process: Any, tasks: Connection, results: Connection, arena: Arena) -> None:
        self.index = index
        self.process = process
        self.tasks = tasks
        self.results = results
        self.arena = arena
        self.outstanding = 0
        self.keys: set[int] = set()  # datasets this worker was sent and not told to forget
        self.freed: deque[tuple[int, int]] = deque()  # regions to give back with the next message
        self.fenced: deque[tuple[Any, list[tuple[int, int]]]] = deque()  # pinned: freed regions behind a fence
        self.live: dict[int, weakref.ref[Any]] = {}  # regions handed out and still referenced, by id of their ref
        self.builders: dict[int, Builder] = {}  # the worker's skeletons by id, compiled
        self.poller = select.poll()  # made once: ``Connection.poll`` builds a selector on every call
        self.poller.register(results.fileno(), select.POLLIN)

    def hand_out(self, offset: int, nbytes: int) -> npt.NDArray[np.uint8]:
        """Region ``offset`` as an array; once nothing references it, it is given back with the next message."""
        region = self.arena.view(offset, nbytes)
        live, freed = self.live, self.freed

        def gone(ref: weakref.ref[Any]) -> None:
            live.pop(id(ref), None)
            freed.append((offset, nbytes))  # deque.append is atomic: this may run on any thread

        ref = weakref.ref(region, gone)
        live[id(ref)] = ref  # a ref must outlive its referent for its callback to run
        return region

    def learn(self, reply: tuple[Any, ...]) -> None:
        """Compile the skeleton a region reply introduces (every reply, read or dropped, passes here)."""
        if reply[0] == "region" and reply[5] is not None:
            self.builders[reply[3]] = compile_skeleton(reply[5])

    def take_freed(self) -> list[tuple[int, int]]:
        """The regions freed since the last call."""
        freed = []
        while True:  # popleft is atomic: a finalizer may append from another thread meanwhile
            try:
                freed.append(self.freed.popleft())
            except IndexError:
                return freed

    def drain_freed(self, pinned: PinnedArenas | None) -> list[tuple[int, int]]:
        """The regions the worker may reuse now: every freed one, or with pinning those whose fence has passed
        (NOTE [ Pinned arenas ] in ``pinning.py``; fences pass in the order they were recorded)."""
        if pinned is None:
            return self.take_freed()
        ready: list[tuple[int, int]] = []
        while self.fenced and pinned.passed(self.fenced[0][0]):
            ready += self.fenced.popleft()[1]
        return ready


class Pass:
    """One iteration over one epoch's batches, fed by the pool (an iterator of batches; see NOTE above)."""

    def __init__(
        self,
        pool: WorkerPool,
        order: int,
        key: int,
        dataset: SnapshotDataset,
        batches: list[Any],
        *,
        growing: GrowingEpoch | None = None,
    ) -> None:
        self._pool = pool
        self.growing = growing  # an epoch over a growing snapshot: ``batches`` is its list, appended as it grows
        self.order = order
        self.key = key
        self.dataset = dataset
        self.batches = batches
        self.sent = 0
        self.received = 0
        self.closed = False
        self.started = False  # the training thread has asked for a batch
        self.failed: RuntimeError | None = None  # a worker died while this pass was read: every ``next`` raises it

    def __iter__(self) -> Pass:
        return self

    def __next__(self) -> Any:
        return self._pool._next(self)

    def close(self) -> None:
        """Deal no more of this pass; batches already dealt are dropped when they arrive."""
        self.closed = True


class WorkerPool:
    """``num_workers`` reader processes shared by every epoch of a factory (NOTE [ Feed protocol ] above).

    Args:
        num_workers: worker processes (>= 1).
        collate_fn: the caller's collate function, or None for ``default_collate`` done in place.
        context: the multiprocessing start method or context (None: the default, as a DataLoader's).
        prefetch_factor: batches outstanding per worker.
        worker_init_fn: called with the worker id in each worker, once (workers persist across epochs).
        timeout_s: how long one batch may take before ``RuntimeError`` (0: no limit), as DataLoader's ``timeout``.
        seed: the workers' base seed (worker ``i`` seeds ``random``, torch and numpy with ``seed + i``).
        arena_bytes: each worker's shared memory at start (sparse). A batch that does not fit travels pickled
            instead; when it would not fit ``prefetch_factor + 2`` times, every worker's arena grows by room for
            that many such batches (``grow`` in NOTE [ Feed protocol ]), up to a quarter of the machine's memory
            for all workers together.
        pin_memory: with CUDA, register each arena as page-locked host memory (``cudaHostRegister``, span by
            span), so batches are pinned where the workers write them and copies to the GPU run asynchronously.
            This locks each arena's size in RAM. Without CUDA it changes nothing (NOTE [ Pinned arenas ]).
        pinned: the pinning to use instead of the one ``pin_memory`` makes (tests give one over a fake CUDA).
    """

    def __init__(
        self,
        num_workers: int,
        *,
        collate_fn: Callable[[list[Any]], Any] | None,
        context: Any = None,
        prefetch_factor: int = 2,
        worker_init_fn: Callable[[int], None] | None = None,
        timeout_s: float = 0.0,
        seed: int = 0,
        arena_bytes: int = ARENA_BYTES,
        pin_memory: bool = False,
        pinned: PinnedArenas | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if isinstance(context, str) or context is None:
            context = multiprocessing.get_context(context)
        self.num_workers = num_workers
        self.prefetch_factor = max(1, prefetch_factor)
        self._context = context
        self._collate = collate_fn
        self._worker_init_fn = worker_init_fn
        self._timeout_s = timeout_s
        self._seed = seed
        if arena_bytes <= HEADER_BYTES:
            raise ValueError(f"arena_bytes must be more than {HEADER_BYTES}, got {arena_bytes}")
        arena_bytes = -(-arena_bytes // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages: a grown span starts on one
        self._arena_end = arena_bytes  # every worker's arena is cut below this (it grows: ``_grow``)
        self._widest = arena_bytes - HEADER_BYTES  # the widest span every worker's arena has
        self._reserve = max(arena_bytes, _memory_bytes() // (_RESERVE_SHARE * num_workers))
        if pinned is None and pin_memory and torch.cuda.is_available():
            pinned = PinnedArenas()
        self._pinned = pinned
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._passes: deque[Pass] = deque()  # passes with batches not yet dealt, in order
        # Batches dealt and not yet read, in order, with the pass order they were dealt under (a pass that is read
        # again after a later one started is dealt anew under a new order; its older batches are then dropped).
        self._inflight: deque[tuple[Pass, int, _Worker]] = deque()
        self._orders = itertools.count()
        self._keys = itertools.count()
        self._tickets = itertools.count(1)
        self._next_worker = 0
        self._reading = -1  # the order of the latest pass the training thread read from
        self._closed = False
        self._told_inline = False

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers now, if not yet (a cold first epoch starts them while it waits for the cache)."""
        with self._lock:
            if not self._workers and not self._closed:
                self._start()

    def _start(self) -> None:
        """Start the workers (under the lock, on the first pass or ``start``)."""
        self._workers = [self._spawn(index) for index in range(self.num_workers)]
        log.debug("started %d cachefeed workers (%s)", self.num_workers, self._context.get_start_method())

    def _spawn(self, index: int) -> _Worker:
        """Start worker ``index`` with a new arena and new pipes (under the lock)."""
        arena = Arena(self._reserve)
        task_recv, task_send = self._context.Pipe(duplex=False)
        result_recv, result_send = self._context.Pipe(duplex=False)
        seed = self._seed + index
        spec = _WorkerSpec(
            index, self.num_workers, self._collate, self._worker_init_fn, seed, os.getpid(), self._arena_end
        )
        process = self._context.Process(
            target=_worker_main,
            args=(spec, task_recv, result_send, arena),
            name=f"cachefeed-worker-{index}",
            daemon=True,
        )
        process.start()
        task_recv.close()  # the worker's ends: closed here, so a dead worker's pipe reads as closed
        result_send.close()
        arena.close()  # the map stays; the descriptor is not needed once the worker has its own
        if self._pinned is not None:
            self._pinned.register(arena, 0, self._arena_end)
        return _Worker(index, process, task_send, result_recv, arena)

    def _replace_dead(self) -> None:
        """Start a new worker in place of each one that died (under the lock, on the training thread, when it
        starts reading a pass: only that thread waits on a worker's pipes, so closing them here is safe).

        What a dead worker still owed is taken out of the batches in flight. The pass the training thread was
        reading then fails for good (it raised when it met the death, or raises on its next ``next``); any other
        pass is dealt again from its first unread batch (its batches still due from live workers, dealt under its
        old order, are dropped when they arrive), so it loses nothing."""
        for index, worker in enumerate(self._workers):
            if worker.process.is_alive():
                continue
            log.warning(
                "cachefeed worker %d (pid %s) is gone (exit code %s): starting a new one",
                index,
                worker.process.pid,
                worker.process.exitcode,
            )
            owed = {id(entry[0]): entry[0] for entry in self._inflight if entry[2] is worker}
            self._inflight = deque(entry for entry in self._inflight if entry[2] is not worker)
            for owing in owed.values():
                if owing.closed or owing.failed is not None:
                    continue
                if owing.started and owing.order == self._reading:
                    owing.failed = _died(worker)
                    continue
                self._deal_anew(owing)
            worker.tasks.close()
            worker.results.close()
            if self._pinned is not None:
                self._pinned.unregister(worker.arena)
            self._workers[index] = self._spawn(index)

    def close(self) -> None:
        """Stop the workers (they finish their current batch). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers, self._workers = self._workers, []
            self._passes.clear()
            self._inflight.clear()
        for worker in workers:
            try:
                worker.tasks.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for worker in workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(1.0)
            worker.tasks.close()
            worker.results.close()
            if self._pinned is not None:
                self._pinned.unregister(worker.arena)

    # -- passes ------------------------------------------------------------------------------------------------------

    def new_key(self) -> int:
        """A key for one epoch's dataset (``open_pass`` and ``forget`` take it)."""
        return next(self._keys)

    def open_pass(
        self, key: int, dataset: SnapshotDataset, batches: Sequence[Any], growing: GrowingEpoch | None = None
    ) -> Pass:
        """Queue a pass over ``batches`` (index arrays into ``dataset``) and deal what the workers have room for.

        ``growing``: the epoch reads a growing snapshot; its batches are ``growing.batches`` (``batches`` is
        ignored), dealt as they appear, with the dataset's extensions forwarded first (NOTE [ Growing snapshots ])."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the cachefeed worker pool is closed")
            if not self._workers:
                self._start()
            if growing is not None:
                growing.take_deltas()  # a worker learns this key with the dataset as it is now, extensions included
            chosen = growing.batches if growing is not None else list(batches)
            new = Pass(self, next(self._orders), key, dataset, chosen, growing=growing)
            self._passes.append(new)
            self._deal()
        return new

    def forget(self, key: int) -> None:
        """Every worker closes dataset ``key``'s readers; returns once they have (or died, or 10 s passed)."""
        with self._lock:
            ticket = next(self._tickets)
            told = []
            for worker in self._workers:
                if key in worker.keys:
                    worker.keys.discard(key)
                    if self._send(worker, ("forget", key, ticket, worker.drain_freed(self._pinned))):
                        told.append(worker)
        deadline = time.monotonic() + _FORGET_TIMEOUT_S
        pause = 0.001
        for worker in told:
            while worker.arena.words[ACK_WORD] < ticket and worker.process.is_alive():
                if time.monotonic() > deadline:
                    log.warning(
                        "cachefeed worker %d did not close its readers within %ss", worker.index, _FORGET_TIMEOUT_S
                    )
                    return
                time.sleep(pause)  # a worker finishes the batches it holds first: a few ms, rarely more
                pause = min(2 * pause, 0.02)

    def _send(self, worker: _Worker, message: Any) -> bool:
        try:
            worker.tasks.send_bytes(pickle.dumps(message, protocol=_PICKLE))
        except OSError:
            return False  # a dead worker: the reader finds out from its sentinel
        return True

    def _deal_anew(self, again: Pass) -> None:
        """Queue ``again`` to be dealt from its first unread batch under a new order (under the lock): what is still
        in flight for it under its old order is dropped when it arrives."""
        again.order = next(self._orders)
        again.sent = again.received
        if again not in self._passes:
            self._passes.append(again)

    def _deal(self) -> None:
        """Deal queued batches round robin while the next worker has room (under the lock)."""
        passes = self._passes
        while passes:
            current = passes[0]
            if current.closed or current.order < self._reading or current.sent >= len(current.batches):
                growing = current.growing
                if not current.closed and current.order >= self._reading and growing and not growing.is_complete:
                    return  # more batches will come: nothing after this pass may be dealt before them
                passes.popleft()
                continue
            worker = self._workers[self._next_worker]
            if worker.outstanding >= self.prefetch_factor:
                return
            if current.key not in worker.keys:
                self._send(worker, ("epoch", current.key, current.dataset))  # may raise: an unpicklable dataset
                worker.keys.add(current.key)
            indices = np.ascontiguousarray(current.batches[current.sent], dtype=np.int64).tobytes()
            self._send(worker, ("batch", current.key, indices, worker.drain_freed(self._pinned)))
            current.sent += 1
            worker.outstanding += 1
            self._inflight.append((current, current.order, worker))
            self._next_worker = (self._next_worker + 1) % len(self._workers)

    # -- reading (the training thread) ---------------------------------------------------------------------------

    def _next(self, reading: Pass) -> Any:
        if reading.closed:
            raise SnapshotError("this pass over the epoch was closed (the factory moved on or closed)")
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the cachefeed worker pool is closed")
                if not reading.started:
                    self._replace_dead()
                    reading.started = True
                if reading.failed is not None:
                    raise reading.failed
                if reading.order < self._reading:  # a later pass was read meanwhile: deal the rest of this one anew
                    self._deal_anew(reading)
                self._reading = reading.order
                if self._pinned is not None:
                    self._pinned.register_pending()
                    self._fence_freed(self._pinned)
                growing = reading.growing
                if growing is not None and not growing.is_complete:
                    self._take_growth(reading, growing)
                self._deal()
                wait_for_growth = False
                if reading.received >= len(reading.batches):
                    if growing is None or growing.is_complete:
                        raise StopIteration
                    wait_for_growth = True
                elif not self._inflight:
                    raise StopIteration
                else:
                    owner, order, worker = self._inflight[0]
                    if order > reading.order:
                        raise StopIteration  # nothing of this pass is in flight (it was closed meanwhile)
            if growing is not None and wait_for_growth:
                growing.pause()  # every batch cut so far was read: the epoch waits for the daemon
                continue
            reply = self._receive(worker)
            with self._lock:
                self._inflight.popleft()
                worker.outstanding -= 1
                self._deal()
            if owner is not reading or order != reading.order:
                self._drop(worker, reply)  # an abandoned pass's batch
                continue
            reading.received += 1
            return self._unpack(worker, reply)

    def _take_growth(self, reading: Pass, growing: GrowingEpoch) -> None:
        """Cut the batches a growing epoch gained (``reading.batches`` is its list), after telling the workers that
        hold its dataset about the new segments (under the lock; NOTE [ Growing snapshots ])."""
        growing.poll()
        for names, counts in growing.take_deltas():
            for worker in self._workers:
                if reading.key in worker.keys:
                    self._send(worker, ("extend", reading.key, names, counts))

    def _fence_freed(self, pinned: PinnedArenas) -> None:
        """Put the regions freed since the last call behind one new fence (training thread, under the lock)."""
        freed = [(worker, regions) for worker in self._workers if (regions := worker.take_freed())]
        if freed:
            fence = pinned.fence()
            for worker, regions in freed:
                worker.fenced.append((fence, regions))

    def _receive(self, worker: _Worker) -> Any:
        conn = worker.results
        if not worker.poller.poll(0):
            started = time.monotonic()
            while True:
                limit = 1.0 if not self._timeout_s else min(1.0, self._timeout_s)
                ready = wait([conn, worker.process.sentinel], timeout=limit)
                if conn in ready or conn.poll():
                    break
                if worker.process.sentinel in ready:
                    raise _died(worker)
                if self._timeout_s and time.monotonic() - started > self._timeout_s:
                    raise RuntimeError(f"cachefeed worker {worker.index} timed out after {self._timeout_s}s")
        try:
            reply: tuple[Any, ...] = pickle.loads(conn.recv_bytes())  # noqa: S301 (our own worker's pipe)
        except EOFError:
            raise _died(worker) from None
        worker.learn(reply)
        return reply

    def _unpack(self, worker: _Worker, reply: tuple[Any, ...]) -> Any:
        kind = reply[0]
        pinned = self._pinned
        if kind == "region":
            _kind, offset, nbytes, skeleton, leaves, _new = reply
            batch = worker.builders[skeleton](worker.hand_out(offset, nbytes), iter(leaves))
            if pinned is not None and not pinned.covers(worker.arena, offset, nbytes):
                return pinned.pin(batch)  # the region goes back once ``batch`` is gone: nothing copies from it
            return batch
        if kind == "empty":
            return EmptyBatch()
        if kind == "inline":
            if not self._grow(reply[2], reply[3]) and not self._told_inline:
                self._told_inline = True
                log.warning(
                    "a batch did not fit the worker's %s of shared memory (batches kept by the caller, or "
                    "batches larger than a quarter of the memory allows): such batches travel through a pipe, "
                    "which is slower",
                    format_bytes(self._arena_end),
                )
            return reply[1] if pinned is None else pinned.pin(reply[1])
        reply[1].reraise()
        raise AssertionError("unreachable")

    def _grow(self, need: int, worker_end: int) -> bool:
        """Grow every worker's arena by room for ``prefetch_factor + 2`` batches of ``need`` bytes, unless the
        widest span already has it or the reserve does not (``grown_end``). True where the arenas grew now, or
        had grown since the worker placed this batch (``worker_end``: its arena's end then)."""
        with self._lock:
            if worker_end < self._arena_end:
                return True
            end = grown_end(self._arena_end, self._widest, need, self.prefetch_factor + 2, self._reserve)
            if end is None:
                return False
            log.info(
                "a batch of %s did not fit the workers' shared memory: each worker's grows to %s",
                format_bytes(need),
                format_bytes(end),
            )
            for worker in self._workers:
                if self._pinned is not None:
                    self._pinned.register(worker.arena, self._arena_end, end)  # before any batch can land there
                self._send(worker, ("grow", end))
            self._widest = max(self._widest, end - self._arena_end)
            self._arena_end = end
            return True

    def _drop(self, worker: _Worker, reply: tuple[Any, ...]) -> None:
        if reply[0] == "region":
            worker.freed.append((reply[1], reply[2]))


def _memory_bytes() -> int:
    """The machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
