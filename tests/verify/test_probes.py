"""Memory probes: the CPU probe (c10's allocator count and the dispatch count) on hand-made
allocations, against torch's MemTracker and against each other on real runs, the measured curve,
and the CUDA probe with torch.cuda's functions replaced by fakes (no GPU here)."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from planner.config import TrainConfig  # noqa: E402
from workers.probes import (  # noqa: E402
    DATED_FREE,
    CpuProbe,
    CudaProbe,
    MemoryProbe,
    allocator_ledger,
    cuda_step_curve,
    make_probe,
    step_curve,
    thin,
)

MiB = 1024**2
TINY = dict(
    model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128,
)


def test_both_probes_satisfy_the_protocol():
    assert isinstance(CpuProbe(), MemoryProbe)
    assert isinstance(CudaProbe(), MemoryProbe)
    assert isinstance(make_probe(device="cpu"), CpuProbe)
    assert isinstance(make_probe(device="cuda:0"), CudaProbe)
    with pytest.raises(ValueError, match="cpu or cuda"):
        make_probe(device="tpu")


def test_a_storage_is_counted_once_however_many_views_and_freed_on_del():
    probe = CpuProbe()
    probe.start()
    try:
        base = probe.live_bytes
        t = torch.empty(MiB // 4, dtype=torch.float32)  # 262144 x 4 B = 1 MiB
        assert probe.live_bytes - base == MiB
        view = t[: MiB // 8].view(torch.int32)  # a view: same storage, nothing new
        t2 = t.reshape(512, 512)
        assert probe.live_bytes - base == MiB
        del t
        gc.collect()
        assert probe.live_bytes - base == MiB  # the views keep the storage alive
        del view, t2
        gc.collect()
        assert probe.live_bytes == base
        assert probe.peak_allocated_bytes - base == MiB
    finally:
        probe.stop()


def test_reset_peak_restarts_at_the_live_bytes_and_breakdown_sums_to_peak():
    probe = CpuProbe()
    probe.start()
    try:
        a = torch.zeros(2 * MiB, dtype=torch.uint8)
        b = torch.zeros(3 * MiB, dtype=torch.uint8)
        del b
        gc.collect()
        probe.reset_peak()
        assert probe.peak_dispatch_bytes == probe.live_bytes
        probe.track([a], category="parameters")
        c = torch.zeros(MiB, dtype=torch.uint8)
        # peak = a (2 MiB, parameters) + c (1 MiB, other) over what was live before a
        assert probe.peak_breakdown["parameters"] == 2 * MiB
        assert sum(probe.peak_breakdown.values()) == probe.peak_dispatch_bytes
        assert probe.run_peak_bytes >= 5 * MiB  # a + b before the reset
        del a, c
    finally:
        probe.stop()


def test_allocator_count_on_a_hand_derived_sequence_with_its_curve_and_phases():
    """1 MiB live at the reset; then +2 MiB (3 MiB), -1 MiB (2 MiB), +0.5 MiB (2.5 MiB),
    -2 MiB (0.5 MiB): the step's peak is 3 MiB, in the phase it was reached in."""
    probe = CpuProbe()
    probe.start()
    try:
        a = torch.empty(MiB, dtype=torch.uint8)
        probe.phase = "forward"
        probe.reset_peak()
        b = torch.empty(2 * MiB, dtype=torch.uint8)
        del a
        probe.phase = "backward"
        c = torch.empty(MiB // 2, dtype=torch.uint8)
        del b
    finally:
        probe.stop()
    assert probe.reference == "allocator"
    assert probe.peak_allocated_bytes == 3 * MiB
    assert probe.peak_dispatch_bytes == 3 * MiB  # nothing here escapes the dispatcher
    assert probe.peak_phase == "forward"
    assert [bytes_ for _, bytes_ in probe.memory_events] == [MiB, 3 * MiB, 2 * MiB, 5 * MiB // 2, MiB // 2]
    times = [t for t, _ in probe.memory_events]
    assert times[0] == 0.0 and times == sorted(times)
    assert [name for _, name in probe.memory_phases] == ["forward", "backward"]
    assert probe.memory_phases[1][0] > times[2]  # the phase changed after b's allocation and a's free
    del c


def test_allocator_count_sees_what_a_kernel_allocates_below_the_dispatcher():
    """A custom op whose kernel makes and drops a 4 MiB temporary: the dispatcher sees only its
    1 KiB output (the blind spot of a dispatch count, like bitsandbytes' CPU 8-bit step); the
    allocator sees the temporary, live together with the output."""
    lib = torch.library.Library("planner_probe_test", "FRAGMENT")
    lib.define("scratch(Tensor x) -> Tensor")

    def scratch(x):
        tmp = torch.empty(4 * MiB, dtype=torch.uint8)
        out = torch.empty(1024, dtype=torch.uint8)
        del tmp
        return out

    lib.impl("scratch", scratch, "CPU")
    x = torch.zeros(8, dtype=torch.uint8)
    probe = CpuProbe()
    probe.start()
    try:
        probe.reset_peak()
        out = torch.ops.planner_probe_test.scratch(x)
    finally:
        probe.stop()
    assert probe.peak_dispatch_bytes == 1024
    assert probe.peak_allocated_bytes == 4 * MiB + 1024
    del out


def test_offloaded_blocks_are_left_out_of_the_allocator_peak_until_freed():
    probe = CpuProbe()
    probe.start()
    try:
        host = torch.empty(3 * MiB, dtype=torch.uint8)  # stands for host memory on a GPU machine
        probe.track([host], category="offloaded")
        probe.reset_peak()
        a = torch.empty(MiB, dtype=torch.uint8)
        del host  # freeing it frees nothing the device held
        b = torch.empty(MiB, dtype=torch.uint8)
    finally:
        probe.stop()
    assert probe.peak_allocated_bytes == 2 * MiB == probe.peak_dispatch_bytes
    assert [bytes_ for _, bytes_ in probe.memory_events] == [0, MiB, MiB, 2 * MiB]
    del a, b


def test_a_second_probe_in_the_same_process_counts_from_its_own_start():
    """c10's running total keeps blocks of an earlier profile that were freed after it stopped
    (CPUAllocator.cpp: the size table is only updated while memory profiling is on); the probe
    counts from the total at its own start."""
    first = CpuProbe()
    first.start()
    kept = torch.empty(2 * MiB, dtype=torch.uint8)
    first.stop()
    del kept  # freed while nothing profiles: still in c10's total
    probe = CpuProbe()
    probe.start()
    try:
        probe.reset_peak()
        a = torch.empty(MiB, dtype=torch.uint8)
    finally:
        probe.stop()
    assert probe.peak_allocated_bytes == MiB
    del a


def test_a_free_on_a_thread_the_profiler_does_not_follow_is_not_reported_by_c10():
    """The reason for the ledger: c10 reports a free only on a thread with the profiler's state
    (CPUAllocator.cpp ProfiledCPUMemoryReporter::Delete checks memoryProfilingEnabled(), a
    thread-local), and then keeps the block in its running total."""
    import threading

    probe = CpuProbe()
    probe.start()
    try:
        probe.reset_peak()
        held = [torch.empty(MiB, dtype=torch.uint8)]
        worker = threading.Thread(target=held.clear)  # the last reference dies on another thread
        worker.start()
        worker.join()
        after = torch.empty(1024, dtype=torch.uint8)
    finally:
        probe.stop()
    # c10's total still holds the MiB (the drift); the ledger frees it when the dispatch count saw
    # its storage die on the worker thread, before the 1024 B (it held it until its address was
    # reused before)
    assert [size for _, _, size, _ in probe._stream.events] == [MiB, -MiB, 1024]
    assert probe._stream.made_by[1] == DATED_FREE
    assert probe._stream.events[-1][1] == 1024 and probe.allocator_drift_bytes == MiB
    del after


def test_the_ledger_frees_a_block_whose_address_is_allocated_again():
    """Hand-made c10 events (time, total_allocated, size, address, made by): block A (100 B at
    0xA) is freed unseen on another thread, so c10's total keeps it; a later allocation at 0xA
    (60 B) proves it was freed first."""
    raw = [
        (1, 100, 100, 0xA, "a"),
        (2, 150, 50, 0xB, "b"),
        (4, 210, 60, 0xA, "a again"),  # c10: 150 + 60 (A's 100 never subtracted)
        (5, 160, -50, 0xB, "b freed"),
    ]
    events, made_by, drift = allocator_ledger(raw)
    assert events == [(1, 100, 100, 0xA), (2, 150, 50, 0xB), (4, 50, -100, 0xA), (4, 110, 60, 0xA), (5, 60, -50, 0xB)]
    assert made_by[2].startswith("(freed on a thread")
    assert drift == 100  # c10 ends at 160, the ledger at 60: A's 100
    # a free of a block the ledger never saw allocated (from before the profile) changes nothing
    assert allocator_ledger([(1, 10, 10, 0x1, ""), (2, -20, -30, 0xF, "")])[0] == [(1, 10, 10, 0x1)]


def test_the_ledger_frees_a_collectives_own_block_when_its_gloo_run_ends():
    """Hand-made events: a reduce-scatter's flat copy C (100 B at 0xC, made inside the c10d op)
    whose work gloo's worker thread dropped last (c10 never reports the free), then a 300 B block
    D; gloo ran the collective from t=3 to t=5. C is freed at 5, so D's allocation at 6 finds
    100 B live, not 200. A copy whose free was reported (E) and a block made outside a collective
    (F, freed unseen) keep the ledger's other rules."""
    raw = [
        (1, 100, 100, 0xC, "aten::empty_strided < aten::clone < c10d::_reduce_scatter_base_"),
        (2, 150, 50, 0xE, "aten::clone < c10d::_reduce_scatter_base_"),
        (4, 100, -50, 0xE, ""),
        (6, 400, 300, 0xD, "aten::empty"),
        (7, 420, 20, 0xF, "aten::empty"),
        (9, 430, 10, 0xF, "aten::empty"),  # F's free went unreported: the address reuse frees it
    ]
    events, made_by, drift = allocator_ledger(raw, [(3, 5)])
    assert [(t, live, size) for t, live, size, _ in events] == [
        (1, 100, 100), (2, 150, 50), (4, 100, -50), (5, 0, -100), (6, 300, 300), (7, 320, 20), (8 + 1, 300, -20),
        (9, 310, 10)]
    assert made_by[3] == DATED_FREE and made_by[6].startswith("(freed on a thread")
    assert drift == 430 - 310
    # without the gloo runs C stays live (the ledger's rule before: it has no address reuse to go by)
    assert max(live for _, live, _, _ in allocator_ledger(raw)[0]) == 420
    # F is a gradient gloo's thread let go of last: the dispatch count saw its storage die at 8
    events, made_by, _ = allocator_ledger(raw, [(3, 5)], [(8, 0xF), (3, 0xD)])  # D's is before it was made
    assert [(t, live, size) for t, live, size, _ in events][-3:] == [(7, 320, 20), (8, 300, -20), (9, 310, 10)]
    assert made_by[-2] == DATED_FREE


def test_step_curve_leaves_out_excluded_blocks_until_they_are_freed():
    # 300 B live at the start, 100 of them excluded (at 0x1); +50, the excluded block freed, +20
    curve = step_curve(
        changes=[(10, 350, 50, 0x2), (20, 250, -100, 0x1), (30, 270, 20, 0x3)],
        start_total=300, step_start_ns=0, excluded={0x1: 100}, phase_marks=[(25, "optimizer")], first_phase="backward",
    )
    assert [b for _, b in curve.events] == [200, 250, 250, 270]
    assert curve.peak_bytes == 270 and curve.peak_phase == "optimizer" and curve.peak_ns == 30


def test_without_the_allocator_the_probe_reports_the_dispatch_count():
    probe = CpuProbe(allocator=False)
    probe.start()
    try:
        probe.reset_peak()
        a = torch.empty(MiB, dtype=torch.uint8)
    finally:
        probe.stop()
    assert probe.reference == "dispatch" and probe.memory_events is None
    assert probe.peak_allocated_bytes == MiB
    del a


def test_thin_keeps_the_peak_the_ends_and_the_order():
    points = [[i / 1000, (i * 7919) % 1000] for i in range(10_000)] + [[10.0, 5_000]] + [[10.5, 3]]
    thinned = thin(points, 400)
    assert len(thinned) <= 402
    assert thinned[0] == points[0] and thinned[-1] == points[-1]
    assert max(v for _, v in thinned) == 5_000
    assert [t for t, _ in thinned] == sorted(t for t, _ in thinned)
    assert thin(points[:10], 400) == points[:10]


def test_storage_resize_outside_dispatch_is_counted():
    probe = CpuProbe()
    probe.start()
    try:
        t = torch.empty(1024, dtype=torch.uint8)
        base = probe.live_bytes
        t.untyped_storage().resize_(0)  # what DeepSpeed ZeRO-3 does to release a parameter
        assert probe.live_bytes == base - 1024
        t.untyped_storage().resize_(4096)
        assert probe.live_bytes == base + 3072
    finally:
        probe.stop()
    before = torch.UntypedStorage.resize_
    p2 = CpuProbe()
    p2.start()
    p2.stop()
    assert torch.UntypedStorage.resize_ is before


def test_limit_raises_torch_out_of_memory_when_live_bytes_exceed_it():
    probe = CpuProbe(limit_bytes=4 * MiB)
    probe.start()
    try:
        keep = torch.zeros(3 * MiB, dtype=torch.uint8)
        with pytest.raises(torch.OutOfMemoryError, match="memory limit"):
            torch.zeros(2 * MiB, dtype=torch.uint8)
        del keep
    finally:
        probe.stop()


def test_cpu_probe_agrees_with_torch_memtracker_on_a_training_run():
    """Two AdamW steps of a tiny llama with MemTracker entered first (outer) and our probe inside,
    so that both see every op from the model's construction on. MemTracker refuses repeated
    module calls unless its module stats are reset between iterations (mem_tracker.py
    _pre_fw_hook), so the loop is written here rather than taken from run_in_process."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    tracker, probe = MemTracker(), CpuProbe()
    with tracker:
        probe.start()
        try:
            cfg = AutoConfig.for_model(**TINY)
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            ids = torch.randint(0, 1000, (2, 32))
            for _ in range(2):
                tracker.reset_mod_stats()
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            probe.stop()
    mt_peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    ours = probe.run_peak_bytes
    # Same rule (each untyped storage once, op outputs, weakref frees, resize_ wrapped) and the
    # same update points (after every dispatched op): the peaks are equal to the byte (torch
    # 2.13: 3,806,876 B). A difference would come from storages made between the two entries
    # (none here) or ones MemTracker tags via hooks but that are not op outputs (none on CPU).
    assert mt_peak == ours, (mt_peak, ours)
    # sanity: at least weights (4 B), grads (4 B) and Adam's two moments (8 B) per parameter
    n = sum(p.numel() for p in model.parameters())
    assert ours >= 16 * n


# ---- CUDA probe with fakes -----------------------------------------------------------------
class FakeCuda:
    """torch.cuda's allocator statistics for one imaginary 24 GiB device."""

    total = 24 * 1024**3

    def __init__(self):
        self.allocated_peak = 0
        self.reserved_peak = 0
        self.reserved = 0
        self.context = 500 * MiB  # held outside the allocator (CUDA context, cuBLAS workspace)
        self.calls = []
        self.allocated = 0
        self.trace = []  # the caching allocator's trace entries (torch/cuda/memory.py TraceEntry)

    def install(self, monkeypatch):
        c = torch.cuda
        monkeypatch.setattr(c, "init", lambda: self.calls.append("init"))
        monkeypatch.setattr(c, "synchronize", lambda device=None: None)
        monkeypatch.setattr(c, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(c, "max_memory_allocated", lambda device=None: self.allocated_peak)
        monkeypatch.setattr(c, "max_memory_reserved", lambda device=None: self.reserved_peak)
        monkeypatch.setattr(c, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(c, "mem_get_info", lambda device=None: (self.total - self.context - self.reserved, self.total))
        monkeypatch.setattr(
            c, "set_per_process_memory_fraction", lambda f, device=None: self.calls.append(("fraction", f))
        )
        monkeypatch.setattr(c, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(c, "current_device", lambda: 0)
        monkeypatch.setattr(c.memory, "_record_memory_history", self.record_history)
        monkeypatch.setattr(c.memory, "_snapshot", lambda device=None: {"segments": [], "device_traces": [self.trace]})

    def record_history(self, enabled="all", **kwargs):
        self.calls.append(("history", enabled, kwargs.get("context", "all"), kwargs.get("clear_history")))
        if kwargs.get("clear_history"):
            self.trace = []

    def reset(self, device=None):
        self.calls.append("reset")
        self.allocated_peak = 0
        self.reserved_peak = self.reserved


def test_cuda_probe_reports_the_allocator_peaks_and_process_total(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    probe = CudaProbe(device="cuda:0", limit_bytes=12 * 1024**3)
    probe.start()
    assert ("fraction", 0.5) in fake.calls  # 12 GiB of 24 GiB
    fake.reserved = 2 * 1024**3  # warm-up steps reserved 2 GiB
    fake.allocated_peak, fake.reserved_peak = 3 * 1024**3, 3 * 1024**3
    probe.reset_peak()
    assert "reset" in fake.calls[-2:] and fake.allocated_peak == 0
    fake.allocated_peak, fake.reserved_peak = 5 * 1024**3, 6 * 1024**3  # the measured step
    probe.stop()
    assert probe.peak_allocated_bytes == 5 * 1024**3
    assert probe.peak_reserved_bytes == 6 * 1024**3
    # total - free - reserved at reset = context 500 MiB; process total = 6 GiB + 500 MiB
    assert probe.process_total_bytes == 6 * 1024**3 + 500 * MiB
    assert probe.device_total_bytes == 24 * 1024**3


def test_cuda_probe_without_a_run_reports_nothing():
    probe = CudaProbe()
    assert probe.peak_allocated_bytes is None and probe.process_total_bytes is None


def test_cuda_probe_curve_from_the_allocator_trace(monkeypatch):
    """1 GiB allocated at the reset; the trace: alloc 512 MiB, a segment (reserved, not allocated),
    alloc 256 MiB, free_requested of the first (not yet free: the allocated statistic moves at
    free_completed), free_completed of it -> 1, 1.5, 1.75, 1.25 GiB; the peak 1.75 GiB falls in
    the backward phase, entered before the second allocation."""
    import time

    fake = FakeCuda()
    fake.install(monkeypatch)
    probe = CudaProbe(device="cuda:0")
    probe.start()
    fake.allocated = 1024 * MiB
    probe.phase = "forward"
    probe.reset_peak()
    assert ("history", "all", None, True) in fake.calls  # no stacks: the trace alone
    t0 = time.time_ns() // 1000
    probe.phase = "backward"
    fake.trace += [
        {"action": "alloc", "addr": 1, "size": 512 * MiB, "stream": 0, "time_us": t0 + 1000},
        {"action": "segment_alloc", "addr": 0, "size": 20 * MiB, "stream": 0, "time_us": t0 + 1500},
        {"action": "alloc", "addr": 2, "size": 256 * MiB, "stream": 0, "time_us": t0 + 2000},
        {"action": "free_requested", "addr": 1, "size": 512 * MiB, "stream": 0, "time_us": t0 + 3000},
        {"action": "free_completed", "addr": 1, "size": 512 * MiB, "stream": 0, "time_us": t0 + 3500},
    ]
    fake.allocated_peak = 1792 * MiB
    probe.stop()
    assert fake.calls[-1][:2] == ("history", None)  # recording switched off again
    assert [b for _, b in probe.memory_events] == [1024 * MiB, 1536 * MiB, 1792 * MiB, 1280 * MiB]
    assert max(b for _, b in probe.memory_events) == probe.peak_allocated_bytes
    times = [t for t, _ in probe.memory_events]
    assert times[0] == 0.0 and times == sorted(times) and times[-1] < 60
    assert [name for _, name in probe.memory_phases] == ["forward", "backward"]
    assert probe.peak_phase == "backward"


def test_cuda_step_curve_without_times_keeps_the_order():
    curve = cuda_step_curve(
        [{"action": "alloc", "addr": 1, "size": 100}, {"action": "free_completed", "addr": 1, "size": 100}],
        step_start_ns=5, start_bytes=10,
    )
    assert curve.events == [[0.0, 10], [0.0, 110], [0.0, 10]] and curve.peak_bytes == 110


def test_on_a_run_where_nothing_escapes_the_dispatcher_the_two_counts_agree_to_the_byte():
    """Full fp32 AdamW and SGD on a tiny llama (sdpa): every allocation of the measured step is an
    op's output, so c10's count and the dispatch count are equal; the curve ends where it starts
    (steady state) and peaks at the reported peak."""
    from workers import run_in_process

    for optimizer in ("adamw", "sgd"):
        config = TrainConfig(micro_batch=2, seq_len=32, precision="fp32", optimizer=optimizer)
        m, d = run_in_process(model_config=TINY, config=config)
        assert d["peak_reference"] == "allocator"
        assert m.peak_allocated_bytes == d["peak_dispatch_bytes"], (optimizer, m.peak_allocated_bytes, d)
        events = d["memory_events"]
        assert max(b for _, b in events) == m.peak_allocated_bytes
        assert events[0][1] == events[-1][1]  # the step frees what it allocated
        assert [name for _, name in d["memory_phases"]][:3] == ["forward", "backward", "optimizer"]


@pytest.mark.parametrize(("precision", "per_element"), [("fp32", 20), ("bf16", 24)])
def test_the_allocator_sees_bitsandbytes_cpu_8bit_step(precision, per_element):
    """bitsandbytes' CPU 8-bit AdamW step (backends/cpu/ops.py _optimizer_update_8bit_blockwise_cpu)
    makes, for the tensor it updates, fp32 copies of both states (4n + 4n), the gradient times
    gnorm_scale (4n) and, for 16-bit parameters, p.float() (4n), then denom = sqrt(state2) /
    correction (4n + 4n together): 20n (fp32) or 24n (bf16) bytes over what was live as the
    optimizer phase began, for the largest tensor (the tiny llama's 1000 x 64 embedding and head,
    n = 64,000), plus 0-dim scalar wrappers of a few bytes. The dispatch count sees none of it."""
    from workers import run_in_process

    config = TrainConfig(micro_batch=2, seq_len=32, precision=precision, optimizer="adamw_8bit")
    m, d = run_in_process(model_config=TINY, config=config)
    events, phases = d["memory_events"], d["memory_phases"]
    t_opt = next(t for t, name in phases if name == "optimizer")
    at_start = [b for t, b in events if t <= t_opt][-1]
    extra = max(b for t, b in events if t > t_opt) - at_start
    assert per_element * 64_000 <= extra <= per_element * 64_000 + 64, extra
    assert m.peak_allocated_bytes == at_start + extra and d["peak_phase"] == "optimizer"
    assert d["peak_dispatch_bytes"] < m.peak_allocated_bytes
