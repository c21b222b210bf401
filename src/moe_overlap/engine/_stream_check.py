"""The stream-order checker: happens-before between CPU streams, checked for every tensor.

On CPU the schedule's streams run one after another, so a missing wait never shows in a
result. The checker gives the CPU streams and events the ordering a GPU gives them and
checks every tensor access against it:

- each :class:`~moe_overlap.streams.CpuStream` keeps a vector clock; every operator
  (seen through a ``TorchDispatchMode``) is one tick of the current stream; an event
  records its stream's clock, a wait (``wait_event`` / ``wait_stream``) joins it into the
  waiting stream's, a host synchronization into every stream's;
- the current stream is what ``use_stream`` / ``stream_context`` make it (the default
  compute stream outside them), and backward operators run on the stream the backward
  is called on (the library calls each node's backward on the node's stream, where its
  forward ran, which is where CUDA runs them);
- every storage remembers its last write and each stream's last read. A read not ordered
  after the last write on another stream, or a write not ordered after another stream's
  last write or reads, raises :class:`StreamOrderError`;
- memory follows the CUDA caching allocator: a storage belongs to the stream that made
  it, and once released (its last reference gone, or ``resize_(0)`` by the free-input
  policy) that stream may reuse it at once. Releasing a storage that another stream used
  without that use being ordered before the owner's current position (a wait) or
  declared with ``record_stream`` (:func:`~moe_overlap.engine.core._streams.record_tensor_on`)
  raises :class:`StreamOrderError`: the reuse could overwrite it while the other stream
  still reads it, or the other stream's write could land in the new tensor.

Errors name both accesses (operator, schedule node, stream) and the tensor (shape,
dtype, the node that made it). Turn it on with :func:`stream_order_check` (a context
manager) or ``MOE_OVERLAP_STREAM_CHECK=1`` (the whole process); it costs one Python call
per operator, so it is for tests and debugging. CUDA streams are not modelled: on a GPU
use repeated runs under deterministic algorithms (``benchmarks/stress_exact.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.multiprocessing.reductions import StorageWeakRef as _StorageWeakRef

from moe_overlap.errors import StreamError

from ._torch_private import TorchDispatchMode, op_schema, storage_cdata
from .contracts import Contract, method
from .core._stream_observer import CpuStreamObserver
from .core._stream_observer import observers as _OBSERVERS
from .core._streams import cpu_default_stream

__all__ = [
    "CPU_STREAM_OBSERVER",
    "STREAM_CHECK_ENV",
    "StreamOrderChecker",
    "StreamOrderError",
    "active_checker",
    "start_from_env",
    "stream_order_check",
]

STREAM_CHECK_ENV = "MOE_OVERLAP_STREAM_CHECK"


class StreamOrderError(StreamError):
    """Two accesses to one tensor on different streams are not ordered by an event."""


Clock = dict[int, int]


def _expired(storage: torch.UntypedStorage) -> Callable[[], bool]:
    """Whether ``storage`` has been freed since (a weak reference to it; torch's class is
    unannotated, so only its bound ``expired`` is kept, typed)."""
    ref: Any = _StorageWeakRef(storage)  # type: ignore[no-untyped-call]
    expired: Callable[[], bool] = ref.expired
    return expired


@dataclass(slots=True)
class _Access:
    stream: int
    seq: int
    op: str
    where: str


@dataclass(slots=True)
class _Record:
    expired: Callable[[], bool]
    owner: int
    made_by: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    write: _Access | None = None
    reads: dict[int, _Access] = field(default_factory=lambda: {})
    used: dict[int, _Access] = field(default_factory=lambda: {})
    recorded: set[int] = field(default_factory=lambda: set())
    released: bool = False


class _Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: unannotated
    def __init__(self, checker: StreamOrderChecker) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # pyright: ignore[reportUnknownMemberType]
        self.checker = checker

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.checker.on_op(func, args, kwargs, out)
        return out


class StreamOrderChecker:
    """The happens-before model of CPU streams (see the module docstring)."""

    def __init__(self) -> None:
        self._names: dict[int, str] = {}
        self._keep: dict[int, object] = {}  # streams stay alive: their ids name them
        self._clocks: dict[int, Clock] = {}
        self._host: Clock = {}  # what the host has waited for: before anything it queues later
        self._current: object | None = None
        self._stack: list[object] = []
        self._labels: list[str] = []
        self._records: dict[int, _Record] = {}
        self._watch: dict[int, _Record] = {}  # used on another stream than the owner
        self._ops = 0
        self.checked_ops = 0
        """Operators seen (a test can tell the checker saw the run)."""
        self.cross_stream_storages = 0
        """Storages used on more than one stream (a test can tell streams interleaved)."""

    # -- streams and events ------------------------------------------------------------

    def _sid(self, stream: object) -> int:
        sid = id(stream)
        if sid not in self._clocks:
            self._keep[sid] = stream
            self._clocks[sid] = {**self._host, sid: 0}  # after what the host waited for
            self._names[sid] = repr(stream)
        return sid

    def set_default(self, stream: object) -> None:
        """The stream current outside every ``use_stream`` (the default compute stream)."""
        self._sid(stream)
        self._current = stream

    def current(self) -> object:
        assert self._current is not None
        return self._current

    def enter(self, stream: object) -> None:
        self._stack.append(self.current())
        self._sid(stream)
        self._current = stream

    def exit(self) -> None:
        self._current = self._stack.pop()

    def push_label(self, label: str) -> None:
        self._labels.append(label)

    def pop_label(self) -> None:
        self._labels.pop()

    def snapshot(self, stream: object) -> Clock:
        """The clock an event recorded on ``stream`` now carries."""
        return dict(self._clocks[self._sid(stream)])

    def join(self, stream: object, clock: Clock | None) -> None:
        """``stream`` waits for ``clock`` (an event's, or another stream's)."""
        if clock is None:
            return  # an event never recorded: CUDA's wait is a no-op too
        self._poll()
        mine = self._clocks[self._sid(stream)]
        for sid, seq in clock.items():
            if mine.get(sid, 0) < seq:
                mine[sid] = seq

    def join_stream(self, stream: object, other: object) -> None:
        self.join(stream, self.snapshot(other))

    def host_sync(self, clock: Clock | None = None) -> None:
        """The host waited for ``clock`` (``None``: for every stream): whatever it queues
        later, on any stream, comes after."""
        if clock is None:
            clock = {}
            for c in self._clocks.values():
                for sid, seq in c.items():
                    clock[sid] = max(clock.get(sid, 0), seq)
        for sid, seq in clock.items():
            if self._host.get(sid, 0) < seq:
                self._host[sid] = seq
        for stream in list(self._keep.values()):
            self.join(stream, clock)

    # -- tensors -----------------------------------------------------------------------

    def record_stream(self, tensor: torch.Tensor, stream: object) -> None:
        """``tensor.record_stream(stream)``: its release waits for ``stream``'s work."""
        rec = self._record_of(tensor, create=False)
        if rec is not None:
            rec.recorded.add(self._sid(stream))

    def release(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage is released now (``resize_(0)``)."""
        rec = self._record_of(tensor, create=False)
        if rec is not None:
            self._check_release(rec, "released (resize_(0), the free-input policy)")
            rec.released = True

    def on_op(
        self, func: Any, args: Sequence[object], kwargs: Mapping[str, object], out: object
    ) -> None:
        self.checked_ops += 1
        stream = self.current()
        sid = self._sid(stream)
        clock = self._clocks[sid]
        clock[sid] += 1
        seq = clock[sid]
        op = str(func)
        if func.is_view or func in _NO_DATA:
            return  # a new view or metadata of its input: no element is read or written
        where = self._labels[-1] if self._labels else "code outside the schedule's nodes"
        schema = op_schema(func)
        inputs: set[int] = set()
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            alias = arg.alias_info
            write = alias is not None and alias.is_write
            for t in _tensors(value):
                key = _key(t)
                if key is None:
                    continue
                inputs.add(key)
                self._access(t, key, sid, seq, op, where, write=write)
        for t in _tensors(out):
            key = _key(t)
            if key is None or key in inputs:
                continue  # a view of an input, or an in-place op's self: counted above
            self._access(t, key, sid, seq, op, where, write=True)
        self._ops += 1
        if self._ops % 4096 == 0:
            self._prune()

    def _record_of(self, t: torch.Tensor, *, create: bool) -> _Record | None:
        key = _key(t)
        if key is None:
            return None
        rec = self._records.get(key)
        if rec is not None and rec.expired():
            self._retire(key, rec)
            rec = None
        if rec is None and create:
            stream = self.current()
            rec = _Record(
                expired=_expired(t.untyped_storage()),
                owner=self._sid(stream),
                made_by=self._labels[-1] if self._labels else "code outside the schedule's nodes",
                shape=tuple(t.shape),
                dtype=t.dtype,
            )
            self._records[key] = rec
        return rec

    def _access(
        self, t: torch.Tensor, key: int, sid: int, seq: int, op: str, where: str, *, write: bool
    ) -> None:
        rec = self._record_of(t, create=True)
        assert rec is not None
        if rec.released:  # resized back after the free-input policy released it
            rec.released = False
            rec.owner, rec.write, rec.reads, rec.used = sid, None, {}, {}
        clock = self._clocks[sid]
        me = _Access(sid, seq, op, where)
        last = rec.write
        if last is not None and last.stream != sid and clock.get(last.stream, 0) < last.seq:
            kind = "writes" if write else "reads"
            self._fail(rec, last, me, f"{kind} it after a write on another stream")
        if write:
            for other in rec.reads.values():
                if other.stream != sid and clock.get(other.stream, 0) < other.seq:
                    self._fail(rec, other, me, "writes it while another stream may still read it")
            rec.write = me
            rec.reads = {}
        else:
            rec.reads[sid] = me
        rec.used[sid] = me
        if sid != rec.owner and key not in self._watch:
            self._watch[key] = rec
            self.cross_stream_storages += 1

    def _retire(self, key: int, rec: _Record) -> None:
        """A storage whose last reference went: it was released to its owner stream."""
        del self._records[key]
        self._watch.pop(key, None)
        if not rec.released:
            self._check_release(rec, "released (its last reference dropped)")

    def _check_release(self, rec: _Record, how: str) -> None:
        owner = self._clocks[rec.owner]
        for sid, access in rec.used.items():
            if sid == rec.owner or sid in rec.recorded:
                continue
            if owner.get(sid, 0) < access.seq:
                self._fail_release(rec, access, how)

    def _poll(self) -> None:
        """Check the releases of storages used across streams (before any clock moves)."""
        for key, rec in list(self._watch.items()):
            if rec.expired():
                self._retire(key, rec)

    def _prune(self) -> None:
        for key, rec in list(self._records.items()):
            if rec.expired():
                self._retire(key, rec)

    def finish(self) -> None:
        """Check what was released since the last wait (end of the checked region)."""
        self._poll()

    # -- errors ------------------------------------------------------------------------

    def _tensor(self, rec: _Record) -> str:
        dtype = str(rec.dtype).removeprefix("torch.")
        return f"a tensor of shape {list(rec.shape)} ({dtype}) made by {rec.made_by}"

    def _fail(self, rec: _Record, before: _Access, after: _Access, what: str) -> None:
        raise StreamOrderError(
            f"stream order: {self._names[after.stream]} {what}: {self._tensor(rec)} was "
            f"accessed by {before.op} in {before.where} on {self._names[before.stream]}, "
            f"then by {after.op} in {after.where} on {self._names[after.stream]}, with no "
            "event ordering the second after the first; expected a wait (wait_event / "
            "wait_stream, or use_stream's microbatch event) between them"
        )

    def _fail_release(self, rec: _Record, access: _Access, how: str) -> None:
        raise StreamOrderError(
            f"stream order: {self._tensor(rec)} belongs to {self._names[rec.owner]} and was "
            f"{how} while {self._names[access.stream]} may still use it (last by "
            f"{access.op} in {access.where}): the owner stream may reuse the memory at once; "
            f"expected record_stream (record_tensor_on) for {self._names[access.stream]}, or "
            "the owner stream to wait for that use before the release"
        )


_aten = torch.ops.aten
_NO_DATA: frozenset[object] = frozenset(
    {
        _aten.detach.default,
        _aten.alias.default,
        _aten.lift_fresh.default,
        _aten.sym_size.int,
        _aten.sym_stride.int,
        _aten.sym_numel.default,
        _aten.sym_storage_offset.default,
        _aten.is_same_size.default,
    }
)
"""Operators that read no element (``is_view`` covers the views)."""


def _key(t: torch.Tensor) -> int | None:
    if t.device.type != "cpu" or t.is_sparse:
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if storage.nbytes() == 0:
        return None
    return storage_cdata(storage)


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in cast("Sequence[object]", value):
            if isinstance(v, torch.Tensor):
                yield v


_ACTIVE: list[StreamOrderChecker] = []
"""The active checkers, the one in force last; each is also attached to the CPU stream
model's hook (:mod:`.core._stream_observer`) while active."""

CPU_STREAM_OBSERVER: Contract[CpuStreamObserver] = Contract(
    CpuStreamObserver,
    "a CpuStreamObserver (the stream-order checker)",
    method("current"),
    method("enter"),
    method("exit"),
    method("snapshot"),
    method("join"),
    method("join_stream"),
    method("host_sync"),
    method("record_stream"),
    method("release"),
)
"""Its rule table (the checker is the one observer the library attaches)."""


_ON_ACTIVATE: list[Callable[[], Callable[[], None]]] = []
"""Called when a first checker becomes active; each returns its undo. The checks module
(:mod:`._attached_checks`) registers attaching the checker's guard (node labels) here."""


def _activate(checker: StreamOrderChecker) -> Callable[[], None]:
    """Make ``checker`` the one in force (the first attaches the guards); returns the undo."""
    _ACTIVE.append(checker)
    _OBSERVERS.append(checker)
    undos = [on() for on in _ON_ACTIVATE] if len(_ACTIVE) == 1 else []

    def undo() -> None:
        _ACTIVE.remove(checker)
        _OBSERVERS.remove(checker)
        for u in undos:
            u()

    return undo


def active_checker() -> StreamOrderChecker | None:
    """The checker in force, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def stream_order_check() -> Generator[StreamOrderChecker]:
    """Check every tensor access on CPU streams inside the block (see the module)."""
    checker = StreamOrderChecker()
    checker.set_default(cpu_default_stream())
    undo = _activate(checker)
    try:
        with _Mode(checker):
            yield checker
            checker.finish()
    finally:
        undo()


def env_enabled() -> bool:
    """Whether ``MOE_OVERLAP_STREAM_CHECK`` asks for the checker."""
    return os.environ.get(STREAM_CHECK_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


_PROCESS: list[object] = []


def start_from_env() -> None:
    """``MOE_OVERLAP_STREAM_CHECK=1``: check the whole process (from the engine's import on,
    on the importing thread; subprocesses inherit the variable)."""
    if _PROCESS or not env_enabled():
        return
    checker = StreamOrderChecker()
    checker.set_default(cpu_default_stream())
    mode = _Mode(checker)
    mode.__enter__()  # type: ignore[no-untyped-call]  # torch: unannotated
    _activate(checker)
    _PROCESS.append(mode)
