"""T5 (encoder-decoder): catalog, parameters, LoRA targets, activations by hand, FLOPs, the CLI,
and (slow) real CPU runs against the model."""

from __future__ import annotations

import statistics

import pytest

from planner.catalog import resolve_model, spec_from_config
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.memory import estimate_memory, lora_params
from planner.memory.saved import activation_breakdown
from planner.throughput import flops_per_token

#: a tiny T5 v1.0 with heads * d_kv (32) != d_model (64), dropout on, as the worker trains it
TINY = {"model_type": "t5", "d_model": 64, "num_layers": 2, "num_heads": 4, "d_kv": 8, "d_ff": 96,
        "vocab_size": 512, "dropout_rate": 0.1, "decoder_start_token_id": 0}


def tiny(**changes):
    return spec_from_config(TINY | changes, model_id="tiny-t5", source="test")


def test_t5_large_by_hand():
    spec = resolve_model("t5-large")
    # shared embedding 32128 x 1024 (tied to lm_head: transformers 5.23 always ties T5's head)
    shared = 32128 * 1024  # 32_899_072
    enc_block = 4 * 1024 * 1024 + 2 * 1024 * 4096 + 2 * 1024  # q,k,v,o + wi,wo + 2 norms = 12_584_960
    dec_block = enc_block + 4 * 1024 * 1024 + 1024  # + EncDecAttention q,k,v,o and its norm = 16_780_288
    rel_bias = 2 * 32 * 16  # one [buckets, heads] table per stack
    final_norms = 2 * 1024
    assert shared + 24 * enc_block + 24 * dec_block + rel_bias + final_norms == 737_668_096
    assert spec.params_total == 737_668_096
    assert (spec.num_layers, spec.decoder_layers, spec.is_encoder_decoder) == (24, 24, True)
    assert spec.summary()["layers"] == 48


def test_lora_targets_cover_both_stacks_and_cross_attention():
    spec = resolve_model("t5-large")
    r = 16
    # all-linear: encoder block q,k,v,o (4 x r(1024+1024)) + wi, wo (2 x r(1024+4096)) = 294_912;
    # a decoder block adds the cross-attention's q,k,v,o (131_072)
    enc, dec = 4 * r * 2048 + 2 * r * 5120, 4 * r * 2048 + 4 * r * 2048 + 2 * r * 5120
    config = TrainConfig(method="lora", lora_r=r, lora_targets=("all-linear",))
    assert lora_params(spec, config) == 24 * enc + 24 * dec == 17_301_504
    # q,v only: two per self-attention, two more per cross-attention
    qv = TrainConfig(method="lora", lora_r=r, lora_targets=("q", "v"))
    assert lora_params(spec, qv) == 24 * 2 * r * 2048 + 24 * 4 * r * 2048
    assert spec.linear_names() == ("q", "k", "v", "o", "wi", "wo")
    assert tiny(feed_forward_proj="gated-gelu").linear_names() == ("q", "k", "v", "o", "wi_0", "wi_1", "wo")


def test_lora_count_matches_peft():
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    for ff in ("relu", "gated-gelu"):
        config = TINY | {"feed_forward_proj": ff}
        with torch.device("meta"):
            model = AutoModelForSeq2SeqLM.from_config(AutoConfig.for_model(**config))
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear", task_type="SEQ_2_SEQ_LM"))
        trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
        cfg = TrainConfig(method="lora", lora_r=4, lora_targets=("all-linear",))
        assert lora_params(spec_from_config(config, model_id="t", source="t"), cfg) == trainable


def test_tiny_t5_activations_by_hand():
    """fp32, full fine-tuning, SDPA on the CPU (dropout 0.1: the math path), b=2, s=24 (target =
    source), e = 48 tokens, h=64, inner = heads*d_kv = 32, d_ff=96, vocab 512, scores
    b*a*s*s = 4608. Every tensor below was seen with saved_tensors_hooks on this model (total
    1_426_564 = this - 384 (the labels are the input_ids' storage) + 4 (the loss scalar))."""
    e, h, inner, i, v, scores = 48, 64, 32, 96, 512, 2 * 4 * 24 * 24
    norm = e * h * 4 + e * 4 + e * h * 4  # T5LayerNorm: fp32 input, rsqrt, normalised = 24_768
    core = 3 * e * inner * 4 + 3 * scores * 4  # math path: q, k^T, v in fp32; softmax, mask, dropped = 73_728
    enc_block = (
        2 * norm  # before attention and before the MLP
        + e * h * 4  # q/k/v's shared input
        + core
        + e * inner * 4  # o's input: the contiguous (b, s, heads*d_kv) copy
        + e * h * 4  # wi's input
        + e * i * 4  # relu's output
        + 2 * e * i * 4  # the MLP's dropout: mask and wo's input
        + 2 * e * h * 4  # dropout masks on both sub-layer outputs
    )
    assert enc_block == 233_856
    cross = norm + e * h * 4 + core + e * inner * 4 + e * h * 4  # norm, q's input, core, o's input, dropout mask
    dec_block = enc_block + 24 * 24 + cross  # + SDPA's bool causal condition [1, 1, s, s]
    buckets = 24 * 24 * 8  # int64 bucket ids, first block of each stack
    embeddings = e * 8 + e * h * 4  # token ids, embedding dropout mask (per stack)
    encoder_end = norm + e * h * 4 + e * h * 4  # final norm, final dropout mask, the output k/v read
    head = norm + e * h * 4 + e * h * 4 + e * v * 4 + e * 8  # final norm, dropout, lm_head input, log_softmax, labels
    total = 2 * enc_block + 2 * dec_block + 2 * buckets + 2 * embeddings + encoder_end + head
    assert total == 1_426_944
    config = TrainConfig(method="full", precision="fp32", micro_batch=2, seq_len=24, attention="sdpa")
    breakdown = activation_breakdown(tiny(), config, is_cpu=True)
    assert sum(breakdown.values()) == total
    assert breakdown["activations/position/buckets"] == 2 * buckets
    assert breakdown["activations/encoder_output"] == e * h * 4
    assert breakdown["activations/attention/causal_mask"] == 2 * 24 * 24


def test_flops_count_both_stacks_and_cross_attention():
    spec = tiny()
    config = TrainConfig(method="full", precision="fp32", micro_batch=1, seq_len=24)
    f = flops_per_token(model=spec, config=config)
    enc = 4 * 64 * 32 + 2 * 64 * 96  # q,k,v,o + wi,wo weights
    dec = enc + 4 * 64 * 32  # + cross-attention projections
    assert f.linear == 6 * (2 * enc + 2 * dec + 512 * 64)
    # 4*s*heads*d_kv per attention: 2 encoder self, 2 decoder self, 2 cross; x3 with backward
    assert f.attention == 3 * 4 * 6 * 24 * 4 * 8


def test_timeline_runs_encoder_then_decoder_blocks():
    from planner.memory.timeline import step_timeline

    config = TrainConfig(method="full", precision="fp32", micro_batch=2, seq_len=24)
    timeline = step_timeline(model=tiny(), config=config, kernels=get_gpu("cpu").kernels)
    forward = [ev.where for ev in timeline.events if ev.where.startswith("forward block")]
    backward = [ev.where for ev in timeline.events if ev.where.startswith("backward block")]
    assert list(dict.fromkeys(forward)) == [f"forward block {k}" for k in (1, 2, 3, 4)]
    assert list(dict.fromkeys(backward)) == [f"backward block {k}" for k in (4, 3, 2, 1)]
    # everything saved in forward is freed by the end of the step
    assert timeline.curve()[-1] == sum(
        ev.nbytes if ev.op == "alloc" else -ev.nbytes for ev in timeline.events if ev.where == "model states")


def test_estimate_t5_large_lora_on_a10g_answers(cli):
    result = cli("estimate", "--model", "t5-large", "--gpu", "a10g", "--method", "lora", "--json")
    assert result.code == 0, result.err
    import json

    data = json.loads(result.out)
    assert data["model"]["params"] == 737_668_096
    assert data["fits"] is True
    assert data["memory"]["breakdown"]["activations/cross_attention/core"] > 0


def test_suggest_t5_large_plans(cli):
    result = cli("suggest", "--model", "t5-large", "--gpu", "a10g", "--target-batch", "8", "--seq-len", "512",
                 "--top-k", "3", "--json")
    assert result.code == 0, result.err
    import json

    plans = json.loads(result.out)["plans"]
    assert 1 <= len(plans) <= 3


# ---- real CPU runs (slow) ------------------------------------------------------------------------

#: a small T5 (the bench's rows): full fine-tuning and LoRA, fp32 and bf16 autocast, checkpointing
SMALL = {"model_type": "t5", "d_model": 128, "num_layers": 2, "num_heads": 4, "d_kv": 32, "d_ff": 256,
         "vocab_size": 1024, "dropout_rate": 0.1, "decoder_start_token_id": 0}
RUNS = [
    (dict(precision="fp32"), 0.5),
    (dict(precision="bf16-mixed"), 0.5),
    (dict(precision="bf16-mixed", method="lora", lora_r=16, lora_targets=("all-linear",)), 1),
    # MLP-only adapters: the first block of each stack keeps no self-attention (was +13.8%)
    (dict(precision="bf16-mixed", method="lora", lora_r=16, lora_targets=("wi", "wo")), 1),
    (dict(precision="bf16-mixed", feed_forward_proj="gated-gelu"), 0.5),
    (dict(precision="fp32", grad_ckpt=True), 10),
    (dict(precision="bf16-mixed", method="lora", lora_r=16, lora_targets=("all-linear",), grad_ckpt=True), 10),
]


@pytest.fixture(scope="module")
def measured_errors() -> list[tuple[str, float, float]]:
    pytest.importorskip("torch")
    from planner.results import RunOutcome
    from workers import run_in_process

    out = []
    for changes, bound in RUNS:
        changes = dict(changes)
        arch = SMALL | ({"feed_forward_proj": changes.pop("feed_forward_proj")} if "feed_forward_proj" in changes else {})
        config = TrainConfig(**(dict(micro_batch=2, seq_len=64) | changes))
        measurement, _ = run_in_process(model_config=arch, config=config)
        assert measurement.outcome is RunOutcome.OK, measurement.error
        spec = spec_from_config(arch, model_id="small-t5", source="test")
        predicted = estimate_memory(model=spec, config=config, gpu=get_gpu("cpu")).peak_allocated_bytes
        error = 100 * (predicted - measurement.peak_allocated_bytes) / measurement.peak_allocated_bytes
        out.append((config.label(), error, bound))
    return out


@pytest.mark.slow
def test_real_t5_runs_agree_with_the_model(measured_errors):
    off = [(label, round(err, 2)) for label, err, bound in measured_errors if abs(err) > bound]
    assert not off, measured_errors
    assert statistics.median(abs(err) for _, err, _ in measured_errors) <= 3, measured_errors


def test_lora_dropout_masks_of_the_first_blocks_by_hand():
    """LoRA dropout keeps its mask where the adapter's input needs a gradient. Targets wi,wo on
    the tiny T5, first blocks without checkpointing (this raised KeyError on the cross-attention
    linears): in the encoder, wi reads what only frozen layers made (no mask) and wo reads wi's
    adapted output (a mask); in the decoder, the cross-attention's k/v read the encoder output,
    which the encoder's adapters make need a gradient, so wi and wo both keep masks. bf16-mixed on
    the CPU: peft drops the input cast to the fp32 adapter's dtype, and the CPU's mask has the
    dropped tensor's dtype (4 bytes an element); the dropped copy is counted with the inputs
    (measured on a small T5 in real CPU runs: the peak dropout adds matched this model to the
    byte for q,v, wi,wo and all-linear targets)."""
    from planner.memory.activations import _lora_dropout
    from planner.memory.shapes import block_context

    config = TrainConfig(method="lora", precision="bf16-mixed", micro_batch=2, seq_len=16, lora_r=4,
                         lora_targets=("wi", "wo"), lora_dropout=0.1)
    kernels = get_gpu("cpu").kernels
    tokens, d_model, d_ff, mask = 2 * 16, 64, 96, 4
    assert kernels.dropout_mask_bytes(4) == mask
    spec = tiny()
    encoder = block_context(spec, config, kernels, first=True)
    decoder = block_context(spec.decoder_view, config, kernels, first=True)
    assert _lora_dropout(encoder) == tokens * d_ff * mask
    assert _lora_dropout(decoder) == tokens * (d_model + d_ff) * mask
    # a later block: every adapted input needs a gradient
    assert _lora_dropout(block_context(spec, config, kernels, first=False)) == tokens * (d_model + d_ff) * mask
    # and the whole step is estimated on a GPU profile too (QLoRA's dtype rule knows the kinds)
    for method in ("lora", "qlora"):
        estimate_memory(model=spec, config=config.replace(method=method, lora_targets=("all-linear",)), gpu=get_gpu("a10g"))
