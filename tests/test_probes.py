"""Memory probes: the CPU probe on hand-made allocations and against torch's MemTracker, the CUDA
probe with torch.cuda's functions replaced by fakes (no GPU here)."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from planner.config import TrainConfig  # noqa: E402
from workers.probes import CpuProbe, CudaProbe, MemoryProbe, make_probe  # noqa: E402

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
        assert probe.peak_allocated_bytes == probe.live_bytes
        probe.track([a], category="parameters")
        c = torch.zeros(MiB, dtype=torch.uint8)
        # peak = a (2 MiB, parameters) + c (1 MiB, other) over what was live before a
        assert probe.peak_breakdown["parameters"] == 2 * MiB
        assert sum(probe.peak_breakdown.values()) == probe.peak_allocated_bytes
        assert probe.run_peak_bytes >= 5 * MiB  # a + b before the reset
        del a, c
    finally:
        probe.stop()


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
    assert fake.calls[-1] == "reset" and fake.allocated_peak == 0
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
