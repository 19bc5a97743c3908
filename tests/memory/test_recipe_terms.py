"""Terms of recipes outside the HF Trainer, checked against hand-derived numbers: a cross-entropy
over chunks of the logits (torchtune's CEWithChunkedOutputLoss), the optimizer stepped inside
backward (torchtune's optimizer_in_bwd), and paged optimizer states that yield the device (on it
as far as the allocator leaves room, migrated over the host link past it)."""

from __future__ import annotations

import pytest

from planner.catalog import resolve_model
from planner.config import Method, TrainConfig
from planner.gpus import get_gpu
from planner.memory import estimate_memory
from planner.memory.activations import (
    log_softmax_bytes,
    logits_backward_transient,
    logits_forward_transient,
    loss_chunk_tokens,
)
from planner.memory.dtypes import mode_of
from planner.memory.overhead import outside_allocator, paged_on_host
from planner.memory.parameters import largest_gradient_elements, trained
from planner.memory.shapes import dims_of
from planner.memory.states import static_terms
from planner.optim import Optimizer
from planner.results import MemoryEstimate
from planner.search import SearchSpace, paged_host, screen
from planner.throughput import ThroughputMemo, estimate_throughput, step_breakdown
from planner.units import GiB

LLAMA3_VOCAB = 128256


def test_a_chunked_loss_upcasts_one_piece_at_a_time():
    """Llama-3.1-8B, 2 x 2048 tokens, bf16, 8 chunks along the sequence: 2 x 256 = 512 tokens a
    piece. Forward: the whole bf16 logits (4096 x 128256 x 2) and one piece's fp32 upcast (512 x
    128256 x 4); backward: nll_loss's and log_softmax's fp32 gradients of one piece (2 x 512 x
    128256 x 4). One chunk is the whole logits, as ForCausalLMLoss computes them."""
    model = resolve_model("meta-llama/Llama-3.1-8B")
    config = TrainConfig(method="full", precision="bf16", micro_batch=2, seq_len=2048)
    dims, mode = dims_of(model, config), mode_of(config)
    assert dims.v == LLAMA3_VOCAB and loss_chunk_tokens(dims, 8) == 512 and loss_chunk_tokens(dims) == 4096
    assert logits_forward_transient(dims, mode, config, chunks=8) == 4096 * LLAMA3_VOCAB * 2 + 512 * LLAMA3_VOCAB * 4
    assert logits_backward_transient(dims, mode, config, chunks=8) == 2 * 512 * LLAMA3_VOCAB * 4
    assert logits_forward_transient(dims, mode, config) == 4096 * LLAMA3_VOCAB * (2 + 4)
    assert logits_backward_transient(dims, mode, config) == 2 * 4096 * LLAMA3_VOCAB * 4


def test_uneven_chunks_are_sized_by_the_longest_piece():
    # tensor_split of 10 tokens into 8 pieces: two of 2 tokens, six of 1; 3 sequences a micro-batch
    model = resolve_model("meta-llama/Llama-3.1-8B")
    dims = dims_of(model, TrainConfig(method="full", precision="bf16", micro_batch=3, seq_len=10))
    assert loss_chunk_tokens(dims, 8) == 3 * 2 and loss_chunk_tokens(dims, 10) == 3 and loss_chunk_tokens(dims, 3) == 3 * 4


def test_the_optimizer_in_backward_holds_the_largest_gradient_only():
    """Untied Llama-3.1-8B: the embedding and the head are 128256 x 4096, the largest tensors
    (the MLP's are 14336 x 4096); LoRA r8 on q_proj and v_proj: lora_A of q and v is 8 x 4096,
    lora_B of q 4096 x 8 and of v 1024 x 8."""
    model = resolve_model("meta-llama/Llama-3.1-8B")
    assert largest_gradient_elements(trained(model, TrainConfig(method="full"))) == LLAMA3_VOCAB * 4096
    lora = TrainConfig(method="lora", lora_r=8, lora_targets="q_proj,v_proj")
    assert largest_gradient_elements(trained(model, lora)) == 8 * 4096


def test_a_paged_plan_needs_the_largest_tensor_states_on_the_device():
    """bitsandbytes prefetches one parameter's paged states, updates it and synchronises before the
    next (bitsandbytes/optim/optimizer.py ``step``): the process total holds that tensor's states,
    the rest stay in unified memory outside it. gpt2's largest tensor is wte, 50257 x 768 =
    38,597,376 elements = 150,771 blocks of 256 exactly: two uint8 moments and two fp32 absmax per
    block, 2 x (38,597,376 + 4 x 150,771) = 78,400,920 bytes. On an A100-80GB the device has room
    for all of them: none stay on the host."""
    model, gpu = resolve_model("gpt2"), get_gpu("a100-80gb")
    config = TrainConfig(method="full", optimizer="paged_adamw_8bit", micro_batch=2, seq_len=256)
    terms = static_terms(model, config, gpu.kernels)
    assert terms.paged > 2 * model.params_total and terms.paged_step == 78_400_920
    whole = estimate_memory(model=model, config=config, gpu=gpu)
    assert whole.process_total_bytes == whole.peak_reserved_bytes + outside_allocator(gpu, 1) + 78_400_920
    assert (whole.paged_bytes, whole.paged_host_bytes) == (terms.paged, 0)
    assert MemoryEstimate.from_dict(whole.to_dict()) == whole
    # without CUDA, bitsandbytes makes ordinary tensors (optimizer.py ``get_state_buffer``: "Paged
    # optimizers are not supported on CPU"): in the live bytes, nothing paged
    cpu = get_gpu("cpu")
    assert static_terms(model, config, cpu.kernels).paged == 0
    assert "paged_bytes" not in estimate_memory(model=model, config=config, gpu=cpu).to_dict()


def test_paged_states_past_the_room_are_on_the_host_and_migrated_each_step():
    """paged_on_host: 10 GiB of paged states, 1 GiB of them the stepped tensor's (in the process
    total), a 24 GiB device whose process total is 20 GiB leaves 4 GiB for the rest: 10 - 1 - 4
    = 5 GiB on the host. The throughput model moves them in and out each step: 2 x 5 GiB =
    10,737,418,240 bytes over the RTX 4090's PCIe gen4 host link, 25 GB/s effective per direction
    (planner/gpus.py _PCIE), 0.4294967296 s in the offload part."""
    assert paged_on_host(10 * GiB, required=GiB, device=24 * GiB, total=20 * GiB) == 5 * GiB
    assert paged_on_host(10 * GiB, required=GiB, device=24 * GiB, total=10 * GiB) == 0
    assert paged_on_host(10 * GiB, required=GiB, device=24 * GiB, total=24 * GiB) == 9 * GiB
    model, gpu = resolve_model("gpt2"), get_gpu("rtx4090")
    config = TrainConfig(method="full", optimizer="paged_adamw_8bit", micro_batch=2, seq_len=256)
    base = step_breakdown(model=model, config=config, gpu=gpu)
    paging = step_breakdown(model=model, config=config, gpu=gpu, paged_host=5 * GiB)
    assert gpu.host_link_gbs == 25.0
    assert paging["offload"] - base["offload"] == pytest.approx(0.4294967296, rel=1e-12)
    assert {**paging, "offload": 0} == {**base, "offload": 0}
    memo = ThroughputMemo(model, gpu)
    assert memo.step_seconds(config, 5 * GiB) == sum(paging.values())
    speed = estimate_throughput(model=model, config=config, gpu=gpu, paged_host=5 * GiB)
    assert any("5.00 GiB on the host" in a for a in speed.assumptions)


def test_the_screen_and_the_full_estimate_agree_on_a_paged_plan_that_pages():
    """Llama-3.2-1B on a T4, full fine-tuning with paged 8-bit AdamW, 8 x 2048 tokens: every plan
    the search's screen keeps (its total holding the stepped tensor's paged states,
    reserve.peak_independent) fits the full estimate too (the allocator replayed on the usable
    memory, the same paged term), and at least one leaves paged states on the host, in both."""
    model, gpu = resolve_model("meta-llama/Llama-3.2-1B"), get_gpu("t4")
    space = SearchSpace(methods=(Method.FULL,), optimizers=(Optimizer.PAGED_ADAMW_8BIT,))
    screened = screen(model=model, gpu=gpu, target_batch=8, seq_len=2048, gpus=1, space=space)
    assert screened.fitting
    paging = 0
    for config, _, total, static in screened.fitting:
        whole = estimate_memory(model=model, config=config, gpu=gpu, budget=screened.usable)
        assert whole.process_total_bytes <= screened.usable, config
        outside = whole.process_total_bytes - whole.peak_reserved_bytes - outside_allocator(gpu, 1)
        assert static.terms.paged_step == outside
        if paged_host(static.terms, total, gpu):
            paging += 1
            assert whole.paged_host_bytes > 0
            assert any("stay on the host" in a for a in whole.assumptions)
    assert paging


def test_a_loss_without_upcast_keeps_its_log_probabilities_in_the_logits_dtype():
    """litgpt's chunked_cross_entropy runs F.cross_entropy on the bf16 pieces: phi-2 at 4 x 512
    tokens (vocabulary 51200) saves 2048 x 51200 bf16 log-probabilities and 2048 int64 labels,
    its forward holds the bf16 logits alone, and a 128-token piece's backward two bf16 gradients
    of 4 x 128 x 51200. With the upcast: fp32 log-probabilities."""
    model = resolve_model("microsoft/phi-2")
    config = TrainConfig(method="lora", precision="bf16", micro_batch=4, seq_len=512)
    dims, mode = dims_of(model, config), mode_of(config)
    assert dims.v == 51200 and mode.logits == 2
    assert log_softmax_bytes(dims, mode, upcast=False) == 2048 * (51200 * 2 + 8)
    assert log_softmax_bytes(dims, mode) == 2048 * (51200 * 4 + 8)
    assert logits_forward_transient(dims, mode, config, chunks=4, upcast=False) == 2048 * 51200 * 2
    assert logits_backward_transient(dims, mode, config, chunks=4, upcast=False) == 2 * 4 * 128 * 51200 * 2
