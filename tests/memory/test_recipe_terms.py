"""Terms of recipes outside the HF Trainer, checked against hand-derived numbers: a cross-entropy
over chunks of the logits (torchtune's CEWithChunkedOutputLoss), the optimizer stepped inside
backward (torchtune's optimizer_in_bwd), and paged optimizer states that yield the device."""

from __future__ import annotations

from planner.catalog import resolve_model
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.memory import estimate_memory
from planner.memory.activations import (
    log_softmax_bytes,
    logits_backward_transient,
    logits_forward_transient,
    loss_chunk_tokens,
)
from planner.memory.dtypes import mode_of
from planner.memory.overhead import outside_allocator
from planner.memory.parameters import largest_gradient_elements, trained
from planner.memory.shapes import dims_of
from planner.memory.states import static_terms

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


def test_paged_states_are_counted_on_the_device_by_estimate_and_search_alike():
    """bitsandbytes' paged states live in unified memory and the driver may page them to the host
    when the device runs out, so a run does not fail on them, but its steps then move them over
    the host link, which the throughput model does not price. Until it does, estimate counts
    them on the device in full, as the search's screen does (reserve.peak_independent)."""

    model, gpu = resolve_model("gpt2"), get_gpu("a100-80gb")
    config = TrainConfig(method="full", optimizer="paged_adamw_8bit", micro_batch=2, seq_len=256)
    paged = static_terms(model, config, gpu.kernels).paged
    assert paged > 2 * model.params_total  # two 8-bit moments and their block scales
    whole = estimate_memory(model=model, config=config, gpu=gpu)
    assert whole.process_total_bytes == whole.peak_reserved_bytes + outside_allocator(gpu, 1) + paged


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
