"""Memory probes: one interface, a CPU and a CUDA implementation.

A probe is started before the model is built, its peak is reset right before the measured
optimizer step, and it is stopped after that step (see ``workers.train`` for the convention).

The CPU reference is c10's CPU allocator itself. With ``torch.profiler`` (kineto) running with
``profile_memory=True``, every allocation and free of the default CPU allocator is reported with
the allocator's running total: c10/core/CPUAllocator.cpp ``ProfiledCPUMemoryReporter::New`` /
``Delete`` keep ``allocated_`` (bytes allocated while memory profiling is on and not yet freed)
and pass it to ``reportMemoryUsageToProfiler`` as ``total_allocated``; the event tree of
``kineto_results.experimental_event_tree()`` carries it on each ``_EventType.Allocation`` event
(``_ExtraFields_Allocation.total_allocated`` / ``alloc_size`` / ``ptr``, the fields
torch/profiler/_memory_profiler.py reads). That count includes what kernels allocate below the
dispatcher (bitsandbytes' CPU 8-bit optimizer step, workspaces inside C++ ops). Frees of blocks
allocated before the profiler started are not reported (CPUAllocator.cpp: "Memory block of
unknown size was allocated before the profiling started"), so the count is "bytes allocated
since ``start()`` and still live", the dispatch count's convention too. The profiler runs from
``start()`` to ``stop()``; ``reset_peak()`` and each phase change drop a zero-length
``record_function`` marker (same clock as the allocation events), and ``stop()`` reads the peak
and the curve of the measured step off the event stream (``AllocatorStream``). Memory reporting is
per thread (``memoryProfilingEnabled()`` reads the thread-local profiler state, which autograd's
engine propagates to its threads): allocations on threads torch did not start (gloo's) escape it.

Beside it, ``CpuProbe`` counts live tensor *storage* bytes with a ``TorchDispatchMode``, the way torch's
``torch.distributed._tools.mem_tracker.MemTracker`` does (torch 2.13, mem_tracker.py
``_track`` / ``_WeakRefInfo.create_winfo`` / ``_delete_callback``): every op output's untyped
storages are looked up in a ``WeakIdKeyDictionary``; a storage seen for the first time is added
with ``nbytes()`` and a ``weakref`` whose callback subtracts it again when the storage is
garbage-collected. Views share their base's storage object, so a storage is counted once however
many tensors look at it. ``UntypedStorage.resize_`` is not a dispatched op, so (like MemTracker)
it is wrapped while the probe runs; DeepSpeed ZeRO-3 frees and re-gathers parameters that way.
Tensors made outside dispatch (safetensors loading, C++ extensions) are registered with
``track()`` (MemTracker's ``track_external``); the runner sweeps parameters, gradients and
optimizer states through it before the measured step. This dispatch count attributes bytes to
categories (parameters, gradients, optimizer states, ...) and enforces ``limit_bytes`` op by op;
the allocator's count is the measured peak.

``CudaProbe`` reads the caching allocator's own statistics, and its trace of the measured step
(``torch.cuda.memory._record_memory_history`` / ``_snapshot``) for the curve. All torch imports are inside methods:
importing this module does not load torch.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Container, Iterable, Mapping, Protocol, runtime_checkable

#: categories ``CpuProbe`` attributes live bytes to (anything not retagged stays ``other``)
CATEGORIES = ("parameters", "gradients", "optimizer_states", "other", "offloaded")

#: category of storages that stand for host memory (DeepSpeed's CPU-offloaded optimizer): on a GPU
#: they are not in the device allocator, so the CPU probe keeps them out of the peak too
OFFLOADED = "offloaded"


@runtime_checkable
class MemoryProbe(Protocol):
    """What the training loop needs from a memory probe."""

    def start(self) -> None:
        """Begin counting (CPU: enter the dispatch mode; CUDA: reset the allocator's peak)."""

    def reset_peak(self) -> None:
        """Forget the peak so far: the peak restarts at the bytes live now."""

    def stop(self) -> None:
        """Stop counting; the peak properties keep their values."""

    @property
    def peak_allocated_bytes(self) -> int | None: ...

    @property
    def peak_reserved_bytes(self) -> int | None: ...

    @property
    def process_total_bytes(self) -> int | None: ...


class ProbeMemoryLimitError(RuntimeError):
    """Live tracked bytes went over the probe's limit: the CPU stand-in for a CUDA OOM."""


def _raise_oom(message: str) -> None:
    """Raise torch's own OutOfMemoryError so the run classifies it exactly like a CUDA OOM."""
    import torch

    oom = getattr(torch, "OutOfMemoryError", None)
    if oom is not None:
        try:
            raise oom(message)
        except TypeError:  # pragma: no cover - a torch whose OOM type cannot be built from Python
            pass
    raise ProbeMemoryLimitError(message)


#: at most this many points in a measured curve (``memory_events``); longer streams are thinned
#: keeping each bin's lowest and highest point, so the peak is always kept
MAX_CURVE_POINTS = 4000

#: prefix of the profiler markers the probe drops (``record_function`` names)
_MARK = "planner::"


class StepCurve:
    """The measured step read off an allocator's event stream (CPU or CUDA).

    ``peak_bytes``: the most bytes live at any event of the step (or at its start);
    ``events``: ``[seconds since the step started, bytes live]``, starting with ``[0.0, start]``;
    ``phases``: ``[seconds since the step started, phase]`` of each phase change in the step;
    ``peak_phase``: the phase the peak fell in.
    """

    __slots__ = ("peak_bytes", "peak_ns", "events", "phases", "peak_phase")

    def __init__(self, *, peak_bytes: int, peak_ns: int, events: list[list], phases: list[list], peak_phase: str) -> None:
        self.peak_bytes = peak_bytes
        self.peak_ns = peak_ns
        """When the peak was first reached (the event clock; the step's start if never exceeded)."""
        self.events = events
        self.phases = phases
        self.peak_phase = peak_phase


def step_curve(
    *,
    changes: Iterable[tuple[int, int, int, int]],
    start_total: int,
    step_start_ns: int,
    phase_marks: Iterable[tuple[int, str]] = (),
    first_phase: str = "",
    excluded: Mapping[int, int] | None = None,
) -> StepCurve:
    """Live bytes over one step from the allocator's ``(time_ns, running total, signed size,
    address)`` events in the step, in order; ``start_total`` is the running total when the step
    started.

    ``excluded`` maps the addresses of blocks live at the start that do not count (the CPU
    stand-ins for host memory, ``offloaded``) to their sizes: they are left out of every point,
    until they are freed.
    """
    excluded = dict(excluded or {})
    left_out = sum(excluded.values())
    peak = start_total - left_out
    peak_ns = step_start_ns
    events: list[list] = [[0.0, peak]]
    for t_ns, total, size, ptr in changes:
        if size < 0 and excluded.get(ptr) == -size:
            left_out -= excluded.pop(ptr)
        live = total - left_out
        events.append([(t_ns - step_start_ns) / 1e9, live])
        if live > peak:
            peak, peak_ns = live, t_ns
    marks = sorted(phase_marks)
    peak_phase = first_phase
    for t_ns, name in marks:
        if t_ns <= peak_ns:
            peak_phase = name
    phases = [[0.0, first_phase]] + [[(t - step_start_ns) / 1e9, name] for t, name in marks]
    return StepCurve(
        peak_bytes=peak, peak_ns=peak_ns, events=thin(events, MAX_CURVE_POINTS), phases=phases, peak_phase=peak_phase
    )


def thin(points: list[list], max_points: int) -> list[list]:
    """At most about ``max_points`` of ``points`` (in order): the first, the last, and the lowest and
    highest point of each of ``max_points // 2`` equal runs (so the peak survives)."""
    if len(points) <= max_points:
        return points
    bins = max(1, max_points // 2)
    size = -(-len(points) // bins)
    keep = {0, len(points) - 1}
    for lo in range(0, len(points), size):
        run = range(lo, min(lo + size, len(points)))
        keep.add(min(run, key=lambda i: points[i][1]))
        keep.add(max(run, key=lambda i: points[i][1]))
    return [points[i] for i in sorted(keep)]


#: made-by of a free c10 did not report, which the ledger dates (``_unreported_frees``)
DATED_FREE = "(freed on another thread, dated)"


def _unreported_frees(raw: list[tuple[int, int, int, int, str]], gloo_runs: list[tuple[int, int]],
                      dated: Mapping[int, list[int]]) -> list[tuple[int, None, int, int, str]]:
    """Frees c10 did not report (they happened on gloo's worker threads, which the profiler does not
    follow), dated: a block allocated at an address whose next event is an allocation again (or
    nothing) was freed unseen in between. When the dispatch count saw a storage at that address die
    on another thread (``dated``: address -> times, ``CpuProbe``'s weakref callbacks, which run on
    the thread that drops the last reference) in between, that is when; else, for a block a
    collective made for itself (allocated inside a ``c10d::`` op: gloo's flat copy of a
    reduce-scatter's input, ProcessGroupGloo ``_reduce_scatter_base``), which nothing but the
    collective's work holds and which the work drops as soon as gloo has run it, the end of the
    first gloo run (a ``gloo:`` range) that starts after it was made. Else it stays until its
    address comes back (``allocator_ledger``)."""
    following: list[int | None] = [None] * len(raw)  # the index of the next event at the same address
    seen: dict[int, int] = {}
    for i in range(len(raw) - 1, -1, -1):
        following[i] = seen.get(raw[i][3])
        seen[raw[i][3]] = i
    out = []
    for i, (t, _, size, ptr, ops) in enumerate(raw):
        if size <= 0 or (ptr not in dated and "c10d::" not in ops):
            continue
        j = following[i]
        if j is not None and raw[j][2] == -size:
            continue  # its free was reported
        reuse = raw[j][0] if j is not None else float("inf")
        when = next((d for d in sorted(dated.get(ptr, ())) if t < d < reuse), None)
        if when is None and "c10d::" in ops:
            when = next((e for s, e in gloo_runs if s >= t), None)
        if when is not None and when < reuse:
            out.append((when, None, -size, ptr, DATED_FREE))
    return out


def allocator_ledger(
    raw: Iterable[tuple[int, int, int, int, str]], gloo_runs: Iterable[tuple[int, int]] = (),
    dated_frees: Iterable[tuple[int, int]] = (),
) -> tuple[list[tuple[int, int, int, int]], list[str], int]:
    """c10's ``(time_ns, total_allocated, signed size, address, made by)`` events in order, as a
    ledger of live blocks by address: ``(events (time_ns, bytes live, signed size, address), made
    by per event, drift)``. An allocation at an address still live means that block's free was not
    reported (it happened on a thread the profiler does not follow): a free of it is inserted
    first. A free that went unreported is dated where the dispatch count saw the storage die
    (``dated_frees``: (time, address) of frees on other threads) or, for a block a collective made
    for itself, when the gloo run after it ends (``gloo_runs``: (start, end) of gloo's runs;
    ``_unreported_frees``). A free of
    a block the ledger does not hold (allocated before the profile) is skipped, as c10 skips it.
    ``drift``: c10's final total minus the ledger's (blocks c10 still counts)."""
    raw = list(raw)
    runs = sorted(gloo_runs)
    dated: dict[int, list[int]] = {}
    for when, ptr in dated_frees:
        dated.setdefault(ptr, []).append(when)
    if runs or dated:
        raw = sorted(raw + _unreported_frees(raw, runs, dated), key=lambda a: a[0])  # stable: c10's order kept
    live: dict[int, int] = {}
    events, made_by, total = [], [], 0
    first = last = None
    for t, c10_total, size, ptr, ops in raw:
        if c10_total is not None:
            if first is None:
                first = c10_total - size  # c10's total when the profiler started
            last = c10_total
        if size > 0 and ptr in live:
            total -= live[ptr]
            events.append((t, total, -live.pop(ptr), ptr))
            made_by.append("(freed on a thread the profiler does not follow)")
        elif size < 0 and live.get(ptr) != -size:
            continue
        total += size
        if size > 0:
            live[ptr] = size
        else:
            del live[ptr]
        events.append((t, total, size, ptr))
        made_by.append(ops)
    return events, made_by, (last - first - total) if first is not None else 0


class AllocatorStream:
    """c10's CPU allocator events, recorded by the kineto profiler with ``profile_memory=True``.

    ``start()`` / ``stop()`` run the profiler; ``mark(name)`` drops a zero-length
    ``record_function`` range named ``planner::<name>`` whose start time is on the allocation
    events' clock. After ``stop()``: ``events`` lists ``(time_ns, bytes live, signed size,
    address)`` of every CPU allocation (size > 0) and free (size < 0) in time order, ``made_by``
    the ops each happened in, and ``marks`` the ``(time_ns, name)`` markers.

    Bytes live is a ledger of the reported blocks by address rather than c10's ``total_allocated``
    itself: c10 reports (and subtracts) a free only on a thread the profiler follows
    (``memoryProfilingEnabled()`` is thread-local), so a block freed on another thread (gloo's
    workers drop DeepSpeed's gathered parameters) stays in ``allocated_`` for good, and the
    running total drifts up run by run. The ledger frees such a block when its address is
    allocated again; ``drift_bytes`` is how far c10's total ended above the ledger. Where every
    free is reported the two are equal.
    """

    def __init__(self) -> None:
        self._prof: Any = None
        self.events: list[tuple[int, int, int, int]] = []
        self.made_by: list[str] = []
        """Per event: the ops it happened in, innermost first (``aten::empty < my::op``)."""
        self.marks: list[tuple[int, str]] = []
        self.drift_bytes = 0

    def start(self) -> None:
        from torch.autograd.profiler import profile

        # use_kineto: the event tree (with the allocation fields) exists only in kineto results;
        # no shapes, stacks or flops: the cheapest profile that reports memory
        self._prof = profile(use_cpu=True, use_kineto=True, profile_memory=True)
        self._prof.__enter__()

    def mark(self, name: str) -> None:
        if self._prof is None:
            return
        from torch.autograd.profiler import record_function

        with record_function(_MARK + name):
            pass

    def stop(self, dated_frees: Iterable[tuple[int, int]] = ()) -> None:
        """``dated_frees``: (time_ns, address) of storages seen dying on other threads (``allocator_ledger``)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self._read(prof.kineto_results.experimental_event_tree(), list(dated_frees))

    def _read(self, roots: list, dated_frees: list[tuple[int, int]] = ()) -> None:
        from torch._C._profiler import _EventType

        raw, marks, gloo_runs = [], [], []
        stack = [(event, ()) for event in roots]
        while stack:
            event, ops = stack.pop()
            kind, fields = event.typed
            if kind == _EventType.Allocation and fields.device.type == "cpu":
                raw.append((event.start_time_ns, fields.total_allocated, fields.alloc_size, fields.ptr, " < ".join(ops)))
            elif kind == _EventType.TorchOp and event.name.startswith(_MARK):
                marks.append((event.start_time_ns, event.name[len(_MARK):]))
            elif kind == _EventType.TorchOp and event.name.startswith("gloo:"):
                gloo_runs.append((event.start_time_ns, event.end_time_ns))
            # the dispatch probe's own mode shows up as an op around every op: not a maker
            own = kind != _EventType.TorchOp or event.name == "PythonDispatchMode"
            stack.extend((child, ops if own else (event.name,) + ops[:2]) for child in event.children)
        # c10's running total orders the events of one thread exactly; time orders threads
        raw.sort(key=lambda a: (a[0], a[1]))
        self.marks = sorted(marks)
        self.events, self.made_by, self.drift_bytes = allocator_ledger(raw, gloo_runs, dated_frees)

    def step_start_ns(self, step_mark: str) -> int | None:
        return max((t for t, name in self.marks if name == step_mark), default=None)

    def live_between(self, start_ns: int | None, end_ns: int) -> dict[int, tuple[int, str]]:
        """address -> (size, ops it was made in) of the blocks allocated in [start_ns, end_ns]
        (from the beginning when None) and live at end_ns."""
        live: dict[int, tuple[int, str]] = {}
        for (t, _, size, ptr), made_by in zip(self.events, self.made_by):
            if t > end_ns:
                break
            if start_ns is not None and t < start_ns:
                continue
            if size > 0:
                live[ptr] = (size, made_by)
            else:
                live.pop(ptr, None)
        return live

    def curve(
        self, *, step_mark: str, excluded: Mapping[int, int] | None = None, known: Container[int] | None = None,
    ) -> tuple[StepCurve, dict[int, tuple[int, str]]] | None:
        """The step that starts at the last ``step_mark`` marker (to the end of the stream), as live
        bytes allocated since ``start()``, and the blocks left out of it; None without a marker.

        Left out: the blocks of ``excluded`` (addresses of host-memory stand-ins), and, given
        ``known`` (the addresses of the storages another count knows live at the step's start),
        the blocks live at the start that it does not know: blocks whose free the profiler
        missed (see the class docstring), or blocks made below the dispatcher that outlive a step.
        """
        t0 = self.step_start_ns(step_mark)
        if t0 is None:
            return None
        live = self.live_between(None, t0 - 1)
        left_out = {ptr: live[ptr] for ptr in (excluded or {}) if ptr in live}
        if known is not None:
            left_out.update({ptr: block for ptr, block in live.items() if ptr not in known})
        phases = [(t, name.removeprefix("phase:")) for t, name in self.marks if name.startswith("phase:")]
        curve = step_curve(
            changes=[event for event in self.events if event[0] >= t0],
            start_total=sum(size for size, _ in live.values()),
            step_start_ns=t0,
            phase_marks=[(t, name) for t, name in phases if t > t0],
            first_phase=next((name for t, name in reversed(phases) if t <= t0), ""),
            excluded={ptr: size for ptr, (size, _) in left_out.items()},
        )
        return curve, left_out


def _grouped(blocks: Iterable[tuple[int, str]]) -> list[tuple[int, int, str]]:
    """(bytes, count, made by) of ``(size, made by)`` blocks grouped by maker, largest first."""
    groups: dict[str, list[int]] = {}
    for size, made_by in blocks:
        group = groups.setdefault(made_by, [0, 0])
        group[0] += size
        group[1] += 1
    return sorted(((n, c, by) for by, (n, c) in groups.items()), reverse=True)


class _StorageInfo:
    __slots__ = ("nbytes", "category", "made_by", "ptr")

    def __init__(self, nbytes: int, category: str, made_by: str = "", ptr: int = 0) -> None:
        self.nbytes = nbytes
        self.category = category
        self.made_by = made_by
        self.ptr = ptr

#: With ``trace``, the live storages are listed again whenever the peak has grown by this much
#: since the last listing, so the listing is within this many bytes of the peak.
TRACE_RESOLUTION = 64 * 1024


class _StepCurveViews:
    """The measured step's curve as both probes expose it (``_curve``: a ``StepCurve`` once the
    probe has stopped, else None)."""

    _curve: "StepCurve | None" = None

    @property
    def memory_events(self) -> list[list] | None:
        """``[seconds since the measured step started, bytes allocated]`` over that step, from the
        allocator (c10's events on the CPU, the CUDA allocator's trace on a GPU)."""
        return self._curve.events if self._curve is not None else None

    @property
    def memory_phases(self) -> list[list] | None:
        """``[seconds since the measured step started, phase]`` of each phase change in it."""
        return self._curve.phases if self._curve is not None else None


class CpuProbe(_StepCurveViews):
    """Peak of the bytes c10's CPU allocator holds (``AllocatorStream``), and beside it the peak of
    live tensor-storage bytes seen through the dispatcher, by category.

    ``peak_allocated_bytes`` is the allocator's peak of the measured step once the probe is
    stopped (the dispatch count's while it runs, or with ``allocator=False``, or when another
    profiler is already running); ``peak_dispatch_bytes`` and ``peak_breakdown`` are the dispatch
    count's. Storages tagged ``offloaded`` (with ``track(..., category="offloaded")``) are counted but
    kept out of the peak and the limit: they are the host side of a GPU run.

    ``limit_bytes``: when the live bytes after an op exceed it, the op's caller gets a
    ``torch.OutOfMemoryError`` (deterministic, unlike RLIMIT_AS, which also counts the
    interpreter, libraries and allocator slack). The op has already run, so the limit is
    enforced at op granularity: at most one op's output past the limit is ever allocated.
    """

    def __init__(self, *, limit_bytes: int | None = None, trace: bool = False, allocator: bool = True) -> None:
        if limit_bytes is not None and limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be > 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._stream = AllocatorStream() if allocator else None
        self._excluded: dict[int, int] = {}
        self._dispatch_ptrs: set[int] = set()
        self._foreign_frees: list[tuple[int, int]] = []
        self._left_out: list[tuple[int, str]] = []
        self._curve: StepCurve | None = None
        self.trace = trace
        """Remember which op (and which library line) made each storage, and list the live ones
        near the peak (``peak_storages``): a debugging aid, many times slower."""
        self._making = ""
        self._traced: list[tuple[int, str, str]] = []
        self._traced_at = 0
        self.live_bytes = 0
        """Bytes of the storages alive now."""
        self.run_peak_bytes = 0
        """Peak since ``start()`` (not reset by ``reset_peak``)."""
        self._peak = 0
        self._live_by_cat = dict.fromkeys(CATEGORIES, 0)
        self.peak_breakdown: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        """Live bytes per category at the (reset) peak; all but ``offloaded`` sum to the peak."""
        self._phase = ""
        self.peak_dispatch_phase = ""
        """The phase the dispatch count peaked in."""
        self._infos: Any = None  # WeakIdKeyDictionary storage -> (_StorageInfo, weakref)
        self._mode: Any = None
        self._orig_resize: Any = None
        self._lock = threading.RLock()  # re-entrant: a GC'd storage's callback may run inside

    # ---- protocol ----------------------------------------------------------------------
    def start(self) -> None:
        import torch
        from torch.utils.weak import WeakIdKeyDictionary

        assert self._mode is None, "CpuProbe.start() called twice"
        if self._stream is not None:
            from torch._C._autograd import _profiler_enabled

            if _profiler_enabled():  # kineto runs one profile at a time
                import warnings

                warnings.warn("a profiler is already running: the CPU probe counts through the dispatcher only")
                self._stream = None
            else:
                self._stream.start()  # before the mode, so that the mode's own ops are not first
        self._infos = WeakIdKeyDictionary()
        self._mode = _make_mode(self)
        self._orig_resize = torch.UntypedStorage.resize_
        probe, orig = self, self._orig_resize

        def resize_(st, size):  # same wrapper as MemTracker._track_resize
            result = orig(st, size)
            probe._on_resize(st)
            return result

        torch.UntypedStorage.resize_ = resize_
        self._mode.__enter__()

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self.live_bytes - self._live_by_cat[OFFLOADED]
            self.peak_breakdown = dict(self._live_by_cat)
            self.peak_dispatch_phase = self._phase
            if self.trace:
                self._list_live()
            # blocks standing for host memory: left out of the allocator's count too
            storages = [(st.data_ptr(), info) for st, (info, _) in list(self._infos.items())]
            self._excluded = {ptr: info.nbytes for ptr, info in storages if info.category == OFFLOADED}
            self._dispatch_ptrs = {ptr for ptr, info in storages if info.nbytes}
        if self._stream is not None:
            self._stream.mark("step")

    @property
    def phase(self) -> str:
        """Set by the runner (forward, backward, optimizer); the phase of each peak."""
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        if name != self._phase and self._stream is not None:
            self._stream.mark("phase:" + name)
        self._phase = name

    def _list_live(self) -> None:
        self._traced = [(info.nbytes, info.category, info.made_by) for info, _ in list(self._infos.values())]
        self._traced_at = self._peak

    def peak_storages(self) -> list[tuple[int, int, str, str]]:
        """With ``trace``: (bytes, count, category, made by) of the storages live at the
        (reset) peak, within TRACE_RESOLUTION of it, largest first."""
        assert self.trace, "CpuProbe(trace=True) lists the storages at the peak"
        groups: dict[tuple[str, str], list[int]] = {}
        for nbytes, category, made_by in self._traced:
            group = groups.setdefault((category, made_by), [0, 0])
            group[0] += nbytes
            group[1] += 1
        return sorted(((n, c, cat, by) for (cat, by), (n, c) in groups.items()), reverse=True)

    def stop(self) -> None:
        import torch

        if self._mode is None:
            return
        self._mode.__exit__(None, None, None)
        torch.UntypedStorage.resize_ = self._orig_resize
        self._mode = None
        if self._stream is not None:
            self._stream.stop(self._foreign_frees)
            found = self._stream.curve(step_mark="step", excluded=self._excluded, known=self._dispatch_ptrs)
            if found is not None:
                self._curve, left_out = found
                self._left_out = [block for ptr, block in left_out.items() if ptr not in self._excluded]

    @property
    def reference(self) -> str:
        """What ``peak_allocated_bytes`` counts: ``allocator`` or ``dispatch``."""
        return "allocator" if self._curve is not None else "dispatch"

    @property
    def peak_allocated_bytes(self) -> int:
        return self._curve.peak_bytes if self._curve is not None else self._peak

    @property
    def peak_dispatch_bytes(self) -> int:
        """Peak of live storage bytes seen through the dispatcher (``peak_breakdown`` sums to it)."""
        return self._peak

    @property
    def peak_phase(self) -> str:
        return self._curve.peak_phase if self._curve is not None else self.peak_dispatch_phase

    @property
    def allocator_drift_bytes(self) -> int:
        """How far c10's running total ended above the probe's ledger of its events (blocks freed
        on threads the profiler does not follow; ``AllocatorStream``)."""
        return self._stream.drift_bytes if self._stream is not None else 0

    def untracked_at_step_start(self) -> list[tuple[int, int, str]]:
        """(bytes, count, ops) of the blocks the allocator's events left live as the measured step
        began that are no live storage of the dispatch count, grouped by the ops that made them:
        left out of the step's count (blocks freed on a thread the profiler does not follow, so
        their free was never reported, or made below the dispatcher and kept across steps)."""
        return _grouped(self._left_out)

    def peak_allocations(self) -> list[tuple[int, int, str]]:
        """(bytes, count, ops) of the blocks the measured step allocated that were live at the
        allocator's peak, grouped by the ops that made them, largest first: the allocator's view
        of what a step adds (it names kernels the dispatch count cannot see into)."""
        if self._curve is None:
            return []
        return _grouped(self._stream.live_between(self._stream.step_start_ns("step"), self._curve.peak_ns).values())

    @property
    def peak_reserved_bytes(self) -> None:
        return None  # no caching allocator to speak of on the CPU

    @property
    def process_total_bytes(self) -> None:
        return None

    # ---- counting ----------------------------------------------------------------------
    def track(self, tensors: Iterable[Any], *, category: str | None = None) -> None:
        """Count tensors made outside the mode and/or (re)tag their storages with ``category``."""
        import torch

        assert category is None or category in CATEGORIES, category
        for t in tensors:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._add_tensor(t, category or "other", retag=category is not None)
        self._update_peak()

    def _add_tensor(self, t: Any, category: str, *, retag: bool = False) -> None:
        from torch.distributed._tools.common_utils import get_untyped_storages

        for st in get_untyped_storages(t):
            found = self._infos.get(st)
            if found is not None:
                info = found[0]
                if retag and info.category != category:
                    with self._lock:
                        self._live_by_cat[info.category] -= info.nbytes
                        self._live_by_cat[category] += info.nbytes
                        info.category = category
                elif st.nbytes() != info.nbytes:  # resized outside our wrapper
                    self._on_resize(st)
                continue
            if st.device.type == "meta":
                continue
            import weakref

            info = _StorageInfo(st.nbytes(), category, self._making, st.data_ptr())
            ref = weakref.ref(st, lambda _ref, info=info: self._on_free(info))
            self._infos[st] = (info, ref)
            with self._lock:
                self.live_bytes += info.nbytes
                self._live_by_cat[category] += info.nbytes

    def _on_free(self, info: _StorageInfo) -> None:
        # weakref callbacks may run on any thread that drops the last reference: on another than
        # this one (gloo's workers) c10 reports no free, so the allocator's ledger is told when
        with self._lock:
            self.live_bytes -= info.nbytes
            self._live_by_cat[info.category] -= info.nbytes
            if threading.current_thread() is not threading.main_thread():
                self._foreign_frees.append((time.time_ns(), info.ptr))

    def _on_resize(self, st: Any) -> None:
        found = self._infos.get(st) if self._infos is not None else None
        if found is None:
            return
        info = found[0]
        new = st.nbytes()
        with self._lock:
            delta = new - info.nbytes
            info.nbytes = new
            self.live_bytes += delta
            self._live_by_cat[info.category] += delta
        self._update_peak()

    def _update_peak(self) -> None:
        with self._lock:
            live = self.live_bytes - self._live_by_cat[OFFLOADED]
            if live > self.run_peak_bytes:
                self.run_peak_bytes = live
            if live > self._peak:
                self._peak = live
                self.peak_breakdown = dict(self._live_by_cat)
                self.peak_dispatch_phase = self._phase
                if self.trace and live - self._traced_at > TRACE_RESOLUTION:
                    self._list_live()
        if self.limit_bytes is not None and live > self.limit_bytes:
            _raise_oom(
                f"CPU probe: {live} live tensor bytes (offloaded ones excluded) exceed the memory limit of "
                f"{self.limit_bytes} bytes"
            )


def _made_by(func: Any, out: Any) -> str:
    """``op (shape) dtype @ file:line`` of the innermost library frame outside torch."""
    import traceback

    import torch

    first = out[0] if isinstance(out, (tuple, list)) and out else out
    shape = f" {tuple(first.shape)} {str(first.dtype).removeprefix('torch.')}" if isinstance(first, torch.Tensor) else ""
    # the innermost frame of installed library code (transformers, peft, deepspeed, torch.nn and
    # torch.optim) that is not torch's own dispatch machinery
    frames = [
        f for f in traceback.extract_stack()[:-3]
        if "site-packages" in f.filename and "/torch/utils/" not in f.filename and "/torch/_" not in f.filename
    ]
    where = f" @ {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else ""
    return f"{func.__name__}{shape}{where}"


def _make_mode(probe: CpuProbe):
    """The dispatch mode, defined here so that importing this module does not import torch."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map_only

    class _CountingMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if probe.trace:
                probe._making = _made_by(func, out)
            tree_map_only(torch.Tensor, lambda t: probe._add_tensor(t, "other"), out)
            probe._update_peak()
            return out

    return _CountingMode()


class CudaProbe(_StepCurveViews):
    """The CUDA caching allocator's peak statistics for one device.

    process total = peak reserved + what the process held outside the allocator at ``start()``
    (device total - free - reserved: the CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers),
    i.e. what nvidia-smi would show at the peak, assuming those outside bytes do not change
    during the run (the context is created before ``start()``; cuBLAS workspaces are made on the
    first matmul, so they are counted only when the run warmed up before the measured step,
    which it does: the measured step is the last of several).
    """

    def __init__(self, *, device: str = "cuda", limit_bytes: int | None = None, trace_history: bool = True) -> None:
        self.device = device
        self.limit_bytes = limit_bytes
        self.trace_history = trace_history
        """Record the allocator's trace of the measured step (``memory_events``)."""
        self._outside_bytes = 0
        self._peak_alloc: int | None = None
        self._peak_reserved: int | None = None
        self._total: int | None = None
        self._running = False
        self._phase = ""
        self._step_start: tuple[int, int, str] | None = None  # (unix ns, bytes allocated, phase) at reset_peak
        self._marks: list[tuple[int, str]] = []
        self._curve: StepCurve | None = None

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        if name != self._phase and self._step_start is not None:
            self._marks.append((time.time_ns(), name))
        self._phase = name

    @property
    def peak_phase(self) -> str:
        return self._curve.peak_phase if self._curve is not None else ""

    def start(self) -> None:
        import torch

        dev = torch.device(self.device)
        torch.cuda.init()
        if self.limit_bytes is not None:
            _, total = torch.cuda.mem_get_info(dev)
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.limit_bytes / total), dev)
        torch.cuda.reset_peak_memory_stats(dev)
        self._running = True

    def reset_peak(self) -> None:
        import torch

        dev = torch.device(self.device)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        free, total = torch.cuda.mem_get_info(dev)
        self._outside_bytes = max(0, total - free - torch.cuda.memory_reserved(dev))
        self._total = total
        if self.trace_history:
            # every alloc / free of the step, without stacks (context=None): torch/cuda/memory.py
            # _record_memory_history; the trace is read back by _snapshot() in stop()
            torch.cuda.memory._record_memory_history(enabled="all", context=None, device=dev, clear_history=True)
            self._step_start = (time.time_ns(), int(torch.cuda.memory_allocated(dev)), self._phase)
            self._marks = []

    def stop(self) -> None:
        import torch

        if not self._running:
            return
        dev = torch.device(self.device)
        torch.cuda.synchronize(dev)
        self._peak_alloc = int(torch.cuda.max_memory_allocated(dev))
        self._peak_reserved = int(torch.cuda.max_memory_reserved(dev))
        self._running = False
        if self._step_start is not None:
            snapshot = torch.cuda.memory._snapshot(dev)
            torch.cuda.memory._record_memory_history(enabled=None, device=dev)
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            traces = snapshot.get("device_traces") or []
            self._curve = cuda_step_curve(
                traces[index] if index < len(traces) else [],
                step_start_ns=self._step_start[0], start_bytes=self._step_start[1], first_phase=self._step_start[2],
                phase_marks=self._marks,
            )
            self._step_start = None

    @property
    def peak_allocated_bytes(self) -> int | None:
        return self._peak_alloc

    @property
    def peak_reserved_bytes(self) -> int | None:
        return self._peak_reserved

    @property
    def process_total_bytes(self) -> int | None:
        if self._peak_reserved is None:
            return None
        return self._peak_reserved + self._outside_bytes

    @property
    def device_total_bytes(self) -> int | None:
        return self._total


def cuda_step_curve(
    trace: Iterable[Mapping[str, Any]], *, step_start_ns: int, start_bytes: int, first_phase: str = "",
    phase_marks: Iterable[tuple[int, str]] = (),
) -> StepCurve:
    """The step's curve from the CUDA caching allocator's trace entries (``_snapshot()
    ["device_traces"][i]``): ``alloc`` adds ``size``, ``free_completed`` takes it back (the
    allocated-bytes statistic moves at those two, c10/cuda/CUDACachingAllocator.cpp
    ``malloc`` / ``free_block``; ``free_requested`` waits for the block's streams); segment
    actions are reserved memory, not allocated. ``time_us`` is Unix time in microseconds."""
    total, changes = start_bytes, []
    for entry in trace:
        action = entry.get("action")
        if action not in ("alloc", "free_completed"):
            continue
        size = int(entry["size"]) if action == "alloc" else -int(entry["size"])
        total += size
        t_ns = int(entry["time_us"]) * 1000 if "time_us" in entry else step_start_ns
        changes.append((max(t_ns, step_start_ns), total, size, int(entry.get("addr", 0))))
    return step_curve(
        changes=changes, start_total=start_bytes, step_start_ns=step_start_ns, phase_marks=phase_marks,
        first_phase=first_phase,
    )


def make_probe(*, device: str, limit_bytes: int | None = None, trace: bool = False) -> CpuProbe | CudaProbe:
    """The probe for ``device`` (``cpu`` or ``cuda[:N]``); everything else in a run is the same.
    ``trace`` (CPU only) lists what is live at the peak."""
    if device == "cpu":
        return CpuProbe(limit_bytes=limit_bytes, trace=trace)
    if trace:
        raise ValueError("trace lists live storages with the CPU probe: use device='cpu'")
    if device.startswith("cuda"):
        return CudaProbe(device=device, limit_bytes=limit_bytes)
    raise ValueError(f"device must be cpu or cuda[:N], got {device!r}")


__all__ = [
    "CATEGORIES", "OFFLOADED", "AllocatorStream", "CpuProbe", "CudaProbe", "MemoryProbe", "ProbeMemoryLimitError",
    "StepCurve", "allocator_ledger", "cuda_step_curve", "make_probe", "step_curve",
]
