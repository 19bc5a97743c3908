"""Accuracy of the memory model against real CPU training runs.

Each configuration is trained for 3 optimizer steps by ``workers.measure`` (a fresh process, the
CPU probe: the peak of the bytes c10's CPU allocator holds during the last step, from
``torch.profiler``'s memory events, with the peak of live tensor storages seen through the
dispatcher beside it; one more step, without the probe, gives the step time) and predicted by
``planner.memory.estimate_memory`` for the ``cpu`` device. Prints a table (predicted, measured,
error %), the median and maximum absolute error, and writes ``bench/results/accuracy-cpu.md``
(the table) and ``bench/results/accuracy-cpu.json`` (plus both breakdowns per row: the
measured bytes per category at the peak and the model's terms).

    python bench/accuracy.py [--quick] [--filter TEXT] [--jobs 1|2] [--deadline-min M] [--resume] [--render]
                             [--repredict] [--merge-partial]

Each finished row is appended to ``results/accuracy-<device>.rows.jsonl`` as it comes in;
``--resume`` takes the rows already there instead of measuring them again, and ``--deadline-min``
starts no new measurement after M minutes (the rows left are listed as not measured).
``--merge-partial`` puts the measured rows of the last ``--filter``/``--quick`` run
(``accuracy-<device>-partial.json``) into the full table (a re-measured row in its place, new rows
at the end), re-predicts every row with the current model, and rewrites the table's .json and .md.

On a GPU machine run the same configurations with ``--device cuda`` (the CUDA probe:
``torch.cuda.max_memory_allocated`` of the last step); results go to ``accuracy-cuda.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from planner.config import TrainConfig  # noqa: E402
from planner.units import format_bytes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

# Small models of real architectures (hidden 256-768, 2-6 layers, vocab 8k-64k); keys as in the
# architectures' config.json files under /work/shared/model-configs.
ARCHS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", hidden_size=384, intermediate_size=1024, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, vocab_size=32000, max_position_embeddings=1024,
                  tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=32000, max_position_embeddings=1024,
                    sliding_window=4096, tie_word_embeddings=False),
    "gpt2": dict(model_type="gpt2", n_embd=384, n_layer=4, n_head=6, vocab_size=50257, n_positions=1024),
    "bert": dict(model_type="bert", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 intermediate_size=1024, vocab_size=30522, max_position_embeddings=512),
    "gemma": dict(model_type="gemma", hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=128, vocab_size=32000,
                  max_position_embeddings=1024),
    "phi3": dict(model_type="phi3", hidden_size=384, intermediate_size=1024, num_hidden_layers=3,
                 num_attention_heads=6, num_key_value_heads=6, vocab_size=32064, max_position_embeddings=1024,
                 tie_word_embeddings=False),
    # small vocabularies and long sequences: the logits no longer dominate, so the backward of the
    # last block (planner/memory/step.py first_block_backward) is the peak
    "llama-v2k": dict(model_type="llama", hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=2048, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, tie_word_embeddings=False),
    # mixture of experts (planner/memory/moe.py): grouped_mm experts in the weights' dtype, the
    # router's fp32 softmax and int64 indices; small vocabularies so the experts' activations matter
    "mixtral": dict(model_type="mixtral", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, vocab_size=8192, max_position_embeddings=1024,
                    num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False),
    "qwen3-moe": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                      vocab_size=8192, max_position_embeddings=1024, num_experts=16, num_experts_per_tok=4,
                      norm_topk_prob=True, tie_word_embeddings=False),
}
# the 2025-26 families (issue 23): dense and MoE blocks in one model, shared experts
ARCHS |= {
    # Qwen1.5-MoE-style: a shared expert and its sigmoid gate beside the routed experts; block 0 dense
    "qwen2-moe": dict(model_type="qwen2_moe", hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
                      shared_expert_intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=8192, max_position_embeddings=1024, num_experts=16,
                      num_experts_per_tok=4, mlp_only_layers=[0], tie_word_embeddings=False),
    # Qwen3-MoE with decoder_sparse_step 2 and mlp_only_layers [2]: dense, MoE, dense, MoE
    "qwen3-moe-mixed": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                            vocab_size=8192, max_position_embeddings=1024, num_experts=16, num_experts_per_tok=4,
                            norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[2],
                            tie_word_embeddings=False),
}

_BASE = dict(micro_batch=2, seq_len=256, precision="bf16-mixed", optimizer="adamw")
#: the multi-rank rows: 2 ranks over gloo, 128 tokens (what tests/sharding/test_fsdp2.py runs)
_RANK_BASE = dict(gpus=2, seq_len=128)

#: (architecture, changes to _BASE); the first row of each architecture is the --quick set
CASES: list[tuple[str, dict[str, Any]]] = [
    *[(arch, {}) for arch in ARCHS],  # full bf16-mixed AdamW on every architecture
    ("llama", dict(precision="fp32")),
    ("gpt2", dict(precision="fp32")),
    ("bert", dict(precision="fp32")),
    ("qwen2", dict(precision="fp16-mixed")),
    ("mistral", dict(precision="bf16")),
    ("gemma", dict(precision="bf16")),
    ("llama", dict(method="lora")),
    ("qwen2", dict(method="lora")),
    ("gpt2", dict(method="lora")),
    ("bert", dict(method="lora")),
    ("phi3", dict(method="lora")),
    ("mistral", dict(method="lora", precision="fp32", lora_targets=("q_proj", "v_proj"))),
    ("llama", dict(method="qlora")),
    ("qwen2", dict(method="qlora")),
    ("gemma", dict(method="qlora", grad_ckpt=True)),
    ("llama", dict(grad_ckpt=True)),
    ("phi3", dict(grad_ckpt=True)),
    ("gpt2", dict(method="lora", grad_ckpt=True)),
    ("qwen2", dict(optimizer="sgd")),
    ("llama", dict(optimizer="adafactor")),
    ("gpt2", dict(optimizer="adafactor")),
    ("mistral", dict(optimizer="adamw_8bit")),
    ("phi3", dict(optimizer="adamw_8bit")),
    ("llama", dict(method="lora", optimizer="paged_adamw_8bit")),
    ("llama", dict(attention="eager")),
    ("gemma", dict(attention="eager")),
    ("bert", dict(attention="eager")),
    ("qwen2", dict(grad_accum=2)),
    ("llama", dict(micro_batch=4, seq_len=128, grad_ckpt=True, precision="fp32")),
    ("llama", dict(zero=1)),
    ("mistral", dict(zero=2)),
    ("qwen2", dict(zero=3)),
    ("gpt2", dict(zero=2, offload="optimizer")),
    # small activations, so the end of backward and the start of ZeRO's step are the peaks:
    # gpt2's tied embedding gets two partial gradients; ZeRO flattens the gradients to fp32
    ("gpt2", dict(precision="fp32", optimizer="adamw_8bit", micro_batch=1, seq_len=64)),
    ("gpt2", dict(zero=1, optimizer="adamw_8bit", micro_batch=1, seq_len=64)),
    # 8-bit optimizers with checkpointing: small activations, so bitsandbytes' CPU step (its
    # fp32 temporaries, below the dispatcher) is the peak; pure bf16 adds an fp32 copy of p
    ("llama", dict(optimizer="adamw_8bit", grad_ckpt=True)),
    ("mistral", dict(optimizer="adamw_8bit", grad_ckpt=True, precision="bf16")),
    # ZeRO-3 on models whose input embedding is tied to the output head (gpt2 and gemma tie it)
    ("gpt2", dict(zero=3)),
    ("gemma", dict(zero=3)),
    # the settings recipes use (planner/config.py): PEFT's lora_dropout (bf16 autocast, fp32, QLoRA,
    # adapters on q/v only so the first block keeps no mask for them), a hand-written loop that keeps
    # the outputs, a fused linear cross-entropy, padding to the longest, a KV cache in training
    ("llama", dict(method="lora", lora_dropout=0.1)),
    ("llama", dict(method="lora", precision="fp32", lora_dropout=0.05)),
    ("qwen2", dict(method="qlora", lora_dropout=0.1)),
    ("mistral", dict(method="lora", lora_dropout=0.1, lora_targets=("q_proj", "v_proj"))),
    ("llama", dict(loop="manual")),
    ("gpt2", dict(method="lora", loop="manual")),
    ("llama", dict(method="lora", fused_ce=True)),
    ("qwen2", dict(method="qlora", fused_ce=True, loop="manual")),
    ("llama", dict(packing=False)),
    ("llama", dict(loop="manual", use_cache=True)),
    ("gpt2", dict(use_cache=True)),
    ("llama", dict(method="lora", precision="fp32", use_cache=True)),
    # the backward of the last checkpointed block as the peak (small vocabulary, 1024 tokens): the
    # block recomputed while every checkpoint is held, its MLP's gradients on top (QLoRA's fp32
    # residual stream and projection outputs); full fine-tuning keeps its peak at the end of
    # backward (the moment stays below it)
    ("llama-v2k", dict(method="qlora", grad_ckpt=True, seq_len=1024)),
    ("llama-v2k", dict(grad_ckpt=True, seq_len=1024)),
    # LoRA with fp32 adapters on 16-bit activations, checkpointed: the peak is the end of the last
    # block's recompute (planner/memory/step.py first_block_recompute), before its backward frees
    # anything: bf16-mixed inside down_proj's adapter (peft's fp32 cast of the product alive
    # beside lora_A's bf16 cast of it), pure bf16 inside up_proj's adapter sum (fp32 lora_B output
    # + bf16 base output, promoted on the CPU); without checkpointing the loss is the peak
    ("llama-v2k", dict(method="lora", grad_ckpt=True, seq_len=1024)),
    ("llama-v2k", dict(method="lora", grad_ckpt=True, seq_len=1024, precision="bf16")),
    ("llama-v2k", dict(method="lora", seq_len=1024)),
    ("llama-v2k", dict(method="lora", seq_len=1024, precision="bf16")),
    # mixture of experts: precisions, LoRA (peft converts all-linear to the expert stacks and the
    # router: ParamWrapper's merged weights), LoRA on the attention only, QLoRA (bitsandbytes leaves
    # the 3D expert stacks unquantised, peft upcasts them to fp32), checkpointing
    ("mixtral", dict(precision="fp32")),
    ("mixtral", dict(precision="bf16")),
    ("mixtral", dict(method="lora")),
    ("mixtral", dict(method="lora", precision="bf16", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))),
    ("mixtral", dict(method="qlora")),
    ("mixtral", dict(grad_ckpt=True)),
    ("qwen3-moe", dict(precision="bf16")),
    ("qwen3-moe", dict(method="lora")),
    ("qwen3-moe", dict(grad_ckpt=True)),
    ("qwen3-moe", dict(method="qlora", grad_ckpt=True)),
    ("mixtral", dict(method="lora", grad_ckpt=True)),
    ("qwen3-moe", dict(method="lora", grad_ckpt=True, precision="bf16", lora_targets=("q_proj", "v_proj"))),
    # 2 ranks over gloo (workers/ranks.py), each measuring its own peak; the row's is the worst
    # rank's: FSDP2 full and LoRA, with and without checkpointing, and ZeRO-2/3, on a llama small
    # enough for a 2-rank row to take about a minute (_RANK_BASE; CPUOffloadPolicy is not rowed:
    # on a CPU device its copies to the device are no-ops, see ROW_NOTES)
    *[("llama-8k", _RANK_BASE | changes) for changes in (
        dict(sharding="fsdp2"),
        dict(sharding="fsdp2", method="lora"),
        dict(sharding="fsdp2", grad_ckpt=True),
        dict(sharding="fsdp2", method="lora", grad_ckpt=True),
        dict(zero=2),
        dict(zero=3),
        dict(zero=2, method="lora"),
        dict(zero=3, method="lora"),
    )],
]

# the multi-rank rows' model (after the every-architecture rows): 2 decoder layers, vocabulary 8000, untied head (tests/sharding/test_fsdp2.py's TINY_LLAMA): a 2-rank
# row takes about a minute on the 2-core machine; its root unit (4.1 M parameters) is most of the model,
# as Llama-3's embeddings and head are a large part of an 8B
ARCHS["llama-8k"] = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=8000, max_position_embeddings=512,
                         rms_norm_eps=1e-5, tie_word_embeddings=False)

# the 2025-26 families (issue 23; their full bf16-mixed rows are among the every-architecture ones): mixed
# dense/MoE blocks and shared experts (LoRA all-linear: peft has no
# conversion for qwen2_moe, so it wraps the shared expert's nn.Linear modules; qwen3_moe's converts to the
# expert stacks and leaves the dense blocks' MLPs alone)
ARCHS["gpt-oss"] = dict(  # after the every-architecture rows: transformers has no SDPA path for gpt-oss
    model_type="gpt_oss", hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=4, head_dim=32, vocab_size=8192, max_position_embeddings=1024, num_local_experts=16,
    num_experts_per_tok=4, sliding_window=128, tie_word_embeddings=False)
CASES += [
    ("qwen2-moe", dict(method="lora")),
    ("qwen2-moe", dict(grad_ckpt=True, precision="bf16")),
    ("qwen3-moe-mixed", dict(method="lora")),
    # gpt-oss (a sliding then a full-attention layer): eager attention with sinks, top-k-then-softmax router,
    # clamped SwiGLU experts with biases; LoRA all-linear is the attention only (peft converts no gpt_oss config)
    ("gpt-oss", dict(attention="eager")),
    ("gpt-oss", dict(attention="eager", method="lora")),
    ("gpt-oss", dict(attention="eager", precision="bf16", grad_ckpt=True)),
]

# DeepSeek-V3 shrunk (issue 23): multi-head latent attention (q and kv low-rank, 48 + 16 qk dims a head
# against 32 v dims: SDPA runs its math path on the CPU), a dense block then an MoE block with the
# group-limited sigmoid router (2 of 4 groups) and a shared expert
ARCHS["deepseek-v3"] = dict(
    model_type="deepseek_v3", hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=8, vocab_size=8192, max_position_embeddings=1024, n_routed_experts=16,
    num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, q_lora_rank=96,
    kv_lora_rank=64, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=32, tie_word_embeddings=False)
CASES += [
    ("deepseek-v3", dict()),
    ("deepseek-v3", dict(method="lora")),
    ("deepseek-v3", dict(precision="bf16", grad_ckpt=True)),
]

# Gemma 4 shrunk (issue 23): sliding layers of head dim 64 and 2 kv heads, the last a full-attention layer of
# head dim 128 with 1 kv head and no v_proj (attention_k_eq_v), q/k/v norms, logits soft-capped; the sequence
# (256) is longer than the window (128), so SDPA gets the sliding layers' mask and repeats their k and v
ARCHS["gemma4"] = dict(
    model_type="gemma4_text", hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1, attention_k_eq_v=True,
    vocab_size=8192, max_position_embeddings=1024, sliding_window=128, hidden_size_per_layer_input=0,
    num_kv_shared_layers=0, final_logit_softcapping=30.0, tie_word_embeddings=True)
CASES += [
    ("gemma4", dict()),
    ("gemma4", dict(method="lora")),
    ("gemma4", dict(method="qlora")),
    ("gemma4", dict(precision="bf16", grad_ckpt=True)),
]

# Gemma 4 26B-A4B's layout shrunk: the dense MLP beside 16 experts (top-4) in every layer, the router on the
# residual with its own norm and scales, the experts after their own norm (MoeRouting.parallel_experts)
ARCHS["gemma4-moe"] = ARCHS["gemma4"] | dict(num_hidden_layers=2, enable_moe_block=True, num_experts=16,
                                             top_k_experts=4, moe_intermediate_size=128)
CASES += [
    ("gemma4-moe", dict()),
    ("gemma4-moe", dict(method="lora")),
    ("gemma4-moe", dict(precision="bf16", grad_ckpt=True)),
]

# Qwen3.5 shrunk (issue 23): three Gated DeltaNet layers then a gated full-attention layer; the CPU runs
# transformers' torch fallbacks (causal conv, chunked delta rule in fp32, 64-token chunks: 4 at s = 256)
ARCHS["qwen3.5"] = dict(
    model_type="qwen3_5_text", hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=8192, max_position_embeddings=1024,
    tie_word_embeddings=False)
# Qwen3-Next shrunk: a Gated DeltaNet and a gated-attention layer, each with the MoE block (16 experts, top-4,
# renormalised) and the shared expert behind its sigmoid gate
ARCHS["qwen3-next"] = dict(
    model_type="qwen3_next", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=256,
    vocab_size=8192, max_position_embeddings=1024, tie_word_embeddings=False)
CASES += [
    ("qwen3.5", dict()),
    ("qwen3.5", dict(method="lora")),
    ("qwen3.5", dict(method="qlora")),
    ("qwen3.5", dict(precision="bf16", grad_ckpt=True)),
    ("qwen3-next", dict()),
    ("qwen3-next", dict(method="lora")),
    ("qwen3-next", dict(precision="bf16", grad_ckpt=True)),
]

# Nemotron-H shrunk (issue 23): the released pattern's kinds in its order (Mamba2, MoE, Mamba2, attention, MoE),
# one norm and one mixer a block; the Mamba2 layers run transformers' torch fallbacks on the CPU (causal conv,
# mamba2_chunk_scan over 64-token chunks: 4 at s = 256, the gated RMSNorm); relu2 experts (16, top-4) with the
# sigmoid group-limited router and a shared expert. LoRA names every linear but the Mamba2 out_proj, which peft
# refuses on nemotron_h (all-linear fails there)
ARCHS["nemotron-h"] = dict(
    model_type="nemotron_h", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=32, conv_kernel=4, chunk_size=64,
    n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, moe_shared_expert_intermediate_size=256,
    n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, hybrid_override_pattern="MEM*E",
    vocab_size=8192, max_position_embeddings=1024, tie_word_embeddings=False)
_NEMOTRON_LORA = ("in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
CASES += [
    ("nemotron-h", dict()),
    ("nemotron-h", dict(method="lora", lora_targets=_NEMOTRON_LORA)),
    ("nemotron-h", dict(method="qlora", lora_targets=_NEMOTRON_LORA)),
    ("nemotron-h", dict(precision="bf16", grad_ckpt=True)),
]

# Llama 4 Scout's layout shrunk (issue 23): every layer MoE (16 experts, top-1, a shared expert) whose experts
# run as a dense bmm over every token (T x E rows), the sigmoid router, the rotary layers' L2 q/k norm and chunked
# attention (128-token chunks: the mask is built at s = 256), the last layer NoPE. LoRA names every linear but the
# router (all-linear wraps Llama4Router and the forward fails); QLoRA leaves the expert stacks (bare parameters)
# unquantised, and their bmm casts them under autocast
ARCHS["llama4"] = dict(
    model_type="llama4_text", hidden_size=256, intermediate_size=256, intermediate_size_mlp=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=16, num_experts_per_tok=1,
    use_qk_norm=True, attention_chunk_size=128, vocab_size=8192, max_position_embeddings=1024,
    tie_word_embeddings=False)
_LLAMA4_LORA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CASES += [
    ("llama4", dict()),
    ("llama4", dict(method="lora", lora_targets=_LLAMA4_LORA)),
    ("llama4", dict(method="qlora", lora_targets=_LLAMA4_LORA)),
    ("llama4", dict(precision="bf16", grad_ckpt=True)),
]

# QLoRA without the k-bit upcast (fms-acceleration's accelerated-peft-bnb, torchtune, LLaMA-Factory):
# the non-4-bit parameters and the residual stream stay bf16 (planner/memory/dtypes.py _qlora_16bit)
CASES += [
    ("llama", dict(method="qlora", kbit_upcast=False)),
]

# evaluation during training (planner/memory/evaluation.py): the eval pass after the measured step,
# the model states without gradients; the eval forward at its loss as the peak (the logits of 8 x 256
# tokens), and generation's last step as the peak (a small vocabulary, 64 rows generating 192 tokens:
# the KV cache), full and LoRA (autocast's cached casts of the trained weights or of the adapters)
CASES += [
    ("llama", dict(eval_batch=8, generate_tokens=32)),
    ("llama", dict(method="lora", eval_batch=4, eval_seq_len=512, generate_tokens=64)),
    ("llama-v2k-gen", dict(micro_batch=1, seq_len=128, eval_batch=64, eval_seq_len=64, generate_tokens=192)),
    ("llama-v2k-gen", dict(method="lora", micro_batch=1, seq_len=128, eval_batch=64, eval_seq_len=64,
                           generate_tokens=192)),
]
# (llama-v2k under its own name: the llama-v2k rows' findings are about checkpointed LoRA)
ARCHS["llama-v2k-gen"] = ARCHS["llama-v2k"]

# long context (issue 25): one model at 512 to 4096 tokens, the error's trend with the length: LoRA with
# checkpointing (the logits path and the checkpoints grow with the tokens) and the fused linear
# cross-entropy (its chunk loop's per-token terms); the bench llama with room for the longest
ARCHS["llama-long"] = ARCHS["llama"] | dict(max_position_embeddings=4096)
CASES += [("llama-long", dict(micro_batch=1, seq_len=seq, method="lora", **changes))
          for changes in (dict(grad_ckpt=True), dict(fused_ce=True)) for seq in (512, 1024, 2048, 4096)]

#: the rows of the recipe settings (``--knobs`` measures only these)
KNOB_KEYS = ("lora_dropout", "loop", "fused_ce", "packing", "use_cache", "eval_batch")


def _cases(*, quick: bool, text: str | None, knobs: bool = False) -> list[tuple[str, TrainConfig]]:
    seen: set[str] = set()
    out = []
    for arch, changes in CASES:
        if knobs and not set(changes) & set(KNOB_KEYS):
            continue
        if quick and arch in seen:
            continue
        seen.add(arch)
        config = TrainConfig(**(_BASE | changes))
        if text and text.lower() not in f"{arch} {config.label()}".lower():
            continue
        out.append((arch, config))
    return out


#: rows measured before the CPU's bf16 matmul buffer was known to follow the CPU (2026-11-26) ran on
#: the AMX Xeon whose matmul holds it (``planner.gpus.bf16_matmul_fp32_buffer``)
BUFFER_OF_OLDER_ROWS = True


def _predict(arch: str, config: TrainConfig, *, mm_buffer: bool | None = None) -> tuple[int | None, dict[str, int], str]:
    """The CPU profile's prediction; ``mm_buffer``: as on the machine a row was measured on (None: this one)."""
    import dataclasses

    from planner.catalog import spec_from_config
    from planner.errors import PlannerError
    from planner.gpus import cpu_kernels, get_gpu
    from planner.memory import estimate_memory

    gpu = get_gpu("cpu")
    if mm_buffer is not None:
        gpu = dataclasses.replace(gpu, kernels=cpu_kernels(amx=mm_buffer))
    try:
        spec = spec_from_config(ARCHS[arch], model_id=f"bench/{arch}", source="bench")
        est = estimate_memory(model=spec, config=config, gpu=gpu)
    except PlannerError as exc:
        return None, {}, str(exc)
    return est.peak_allocated_bytes, dict(est.breakdown), est.peak_phase


def _repredicted(row: dict[str, Any]) -> dict[str, Any]:
    """A committed row with the current model's prediction and its errors against the same measurements."""
    predicted, breakdown, phase = _predict(row["arch"], TrainConfig.from_dict(row["config_dict"]),
                                           mm_buffer=row.get("bf16_matmul_fp32_buffer", BUFFER_OF_OLDER_ROWS))
    return row | {"predicted_bytes": predicted, "predicted_breakdown": breakdown, "predicted_phase": phase,
                  "error_pct": _error(predicted, row["measured_bytes"]),
                  "dispatch_error_pct": _error(predicted, row["dispatch_bytes"])}


def _measure(arch: str, config: TrainConfig, device: str) -> tuple[Any, dict[str, Any]]:
    """One process, or each of a sharded plan's ranks at once (``workers.ranks``): then the worst
    rank's measurement, with every rank's peak in its details."""
    from workers import measure_with_details

    if config.gpus == 1:
        return measure_with_details(model_config=ARCHS[arch], config=config, device=device, timeout_s=1200)
    from workers.ranks import measure_ranks

    ranks = measure_ranks(model_config=ARCHS[arch], config=config, device=device, timeout_s=2400)
    failed = [r for r in ranks if r[0].outcome != "ok"]
    measurement, details = failed[0] if failed else max(ranks, key=lambda r: r[0].peak_allocated_bytes)
    return measurement, details | {"rank_peaks": [m.peak_allocated_bytes for m, _ in ranks]}


def _row(arch: str, config: TrainConfig, device: str, deadline: float | None = None) -> dict[str, Any]:
    t0 = time.monotonic()
    if deadline is not None and t0 > deadline:
        return _not_measured(arch, config)
    measurement, details = _measure(arch, config, device)
    predicted, predicted_breakdown, predicted_phase = _predict(arch, config)
    measured = measurement.peak_allocated_bytes
    dispatch = details.get("peak_dispatch_bytes") if measurement.outcome == "ok" else None
    return {
        "arch": arch,
        "config": config.label(),
        "config_dict": config.to_dict(),
        "outcome": str(measurement.outcome),
        "error_text": measurement.error,
        "predicted_bytes": predicted,
        "measured_bytes": measured,
        "error_pct": _error(predicted, measured),
        "reference": details.get("peak_reference", ""),
        "dispatch_bytes": dispatch,
        "dispatch_error_pct": _error(predicted, dispatch),
        "dispatch_phase": details.get("peak_dispatch_phase", ""),
        "measured_breakdown": details.get("peak_breakdown", {}),
        "measured_phase": details.get("peak_phase", ""),
        "step_allocations_at_peak": details.get("peak_allocations", [])[:8],
        "left_out_at_step_start": details.get("untracked_at_step_start", [])[:8],
        "allocator_drift_bytes": details.get("allocator_drift_bytes"),
        "predicted_breakdown": predicted_breakdown,
        "predicted_phase": predicted_phase,
        "params_total": details.get("params_total"),
        "rank_peaks": details.get("rank_peaks"),
        "params_trainable": details.get("params_trainable"),
        "step_s": measurement.step_s,
        "wall_s": round(time.monotonic() - t0, 1),
        "library_versions": dict(measurement.library_versions),
        # the measuring CPU's (planner.host): whether its bf16 matmul holds an fp32 buffer, for --repredict
        "bf16_matmul_fp32_buffer": _this_cpu_buffer() if device == "cpu" else None,
    }


def _this_cpu_buffer() -> bool:
    from planner.gpus import get_gpu

    return get_gpu("cpu").kernels.mm_fp32_buffer


def _not_measured(arch: str, config: TrainConfig) -> dict[str, Any]:
    predicted, breakdown, phase = _predict(arch, config)
    return {
        "arch": arch, "config": config.label(), "config_dict": config.to_dict(), "outcome": "not measured",
        "error_text": "time box of this run", "predicted_bytes": predicted, "measured_bytes": None, "error_pct": None,
        "dispatch_bytes": None, "dispatch_error_pct": None, "measured_phase": "", "predicted_breakdown": breakdown,
        "predicted_phase": phase, "library_versions": {}, "wall_s": 0.0,
    }


def _priority(config: TrainConfig) -> int:
    """Rows measured first: those the findings by row rest on (8-bit optimizers, ZeRO-3)."""
    return 0 if config.zero == 3 or "8bit" in config.optimizer.value else 1


def _measure_all(cases: list[tuple[str, TrainConfig]], *, device: str, jobs: int, deadline: float | None,
                 progress: Path, resume: bool) -> list[dict[str, Any]]:
    """Rows in the order of ``cases``; each finished row appended to ``progress`` (JSON lines)."""
    done: dict[str, dict[str, Any]] = {}
    if resume and progress.exists():
        for line in progress.read_text().splitlines():
            row = json.loads(line)
            done[json.dumps(row["config_dict"], sort_keys=True) + row["arch"]] = row
    elif progress.exists():
        progress.unlink()
    keys = [json.dumps(config.to_dict(), sort_keys=True) + arch for arch, config in cases]
    order = sorted(range(len(cases)), key=lambda i: _priority(cases[i][1]))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {i: pool.submit(_row, *cases[i], device, deadline) for i in order if keys[i] not in done}
        for i in order:
            if keys[i] in done:
                continue
            row = futures[i].result()
            done[keys[i]] = row
            if row["outcome"] != "not measured":
                with progress.open("a") as out:
                    out.write(json.dumps(row, default=str) + "\n")
            err = "-" if row["error_pct"] is None else f"{row['error_pct']:+.2f} %"
            print(f"  {row['arch']:8} {row['config']:60} predicted {_fmt(row['predicted_bytes']):>10} "
                  f"measured {_fmt(row['measured_bytes']):>10} {err:>9}  ({row['outcome']}, {row['wall_s']} s)", flush=True)
    return [done[key] for key in keys]


def _error(predicted: int | None, measured: int | None) -> float | None:
    return None if predicted is None or not measured else 100.0 * (predicted - measured) / measured


def _fmt(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


#: What the remaining differences come from, found by listing what was live at each measured
#: peak: the storages by the op and call site that made them (dispatch count, ``peak_trace.py``)
#: and the blocks the step allocated by the ops they were allocated in (allocator count,
#: details["peak_allocations"]). Kept with the table so that a regenerated file still says it;
#: revise when the model or the libraries change.
CPU_NOTES = [
    "The reference is c10's CPU allocator: `torch.profiler` with `profile_memory=True` reports every "
    "allocation and free of the default CPU allocator with its running total (c10/core/CPUAllocator.cpp "
    "`ProfiledCPUMemoryReporter::New`/`Delete`, `total_allocated` of each `_EventType.Allocation` event), "
    "counted from the probe's start. The dispatch column is the previous reference (live tensor storages "
    "that pass through the dispatcher, attributed by category); where nothing is allocated below the "
    "dispatcher the two agree to the byte (tests/verify/test_probes.py).",
    "The rows left over 0.1% against the dispatch count: small tensors the model leaves out (rotary and "
    "norm intermediates of a few KiB per layer, the masked-LM head's bias gradients) and, for ZeRO-2 with "
    "offload, DeepSpeed's per-parameter bookkeeping.",
    "CPU-only behaviour the model follows on the cpu profile (and replaces with the CUDA behaviour on a GPU): "
    "SDPA with attention dropout (gpt2, bert) runs the math path in fp32 because the CPU flash kernel refuses "
    "dropout; dropout masks are in the dropped tensor's dtype (CUDA's fused kernel makes bool masks); CPU "
    "autocast leaves softmax in bf16 (CUDA autocast runs it in fp32); torch AdamW steps tensor by tensor "
    "(two temporaries of the largest parameter) instead of foreach.",
    "How each term was found: `python bench/peak_trace.py ARCH CHANGES` lists the storages alive at the "
    "measured peak by the op and library line that made them, and the blocks the step had allocated at the "
    "allocator's peak by the ops they were allocated in, beside the model's breakdown.",
]

#: Findings under the rows they explain: (arch, text in the config label or "^" + its beginning, finding).
ROW_NOTES: list[tuple[str, str, str]] = [
    ("qwen3-moe", "", "Mixture of experts: as the mixtral rows' note says (the same grouped_mm experts and LoRA "
                      "conversion; Qwen3MoeTopKRouter renormalises only with norm_topk_prob, set here, and casts "
                      "the routing weights back to the logits' dtype)."),
    ("mixtral", "", (
        "Mixture of experts (mixtral and qwen3-moe rows; planner/memory/moe.py): transformers 5.24 runs the experts "
        "with grouped_mm (modeling_utils.py:1894 default; integrations/moe.py:424-535), which casts its input to the "
        "weights' dtype (moe.py:379): under bf16-mixed the experts run in fp32 and no 16-bit copy of an expert stack "
        "is made. Per routed slot (S = tokens x top-k) a full fine-tuning keeps w*(2H + 4I) + 24 B of indices + the "
        "routing weight; the router keeps its input's cast, the fp32 softmax over the experts, the int64 top-k indices "
        "and the renormalisation's operands. With the model of before (the experts' activations in the projections' "
        "dtype, plus autocast copies of the stacks grouped_mm never makes, which partly cancelled) these rows read: "
        "full -0.05 ... -3.2 %, LoRA all-linear -17.2 % (mixtral) and -19.1 % (qwen3-moe), QLoRA -34.4 % and "
        "-23.9 %, LoRA on the attention -1.3 %. LoRA all-linear: peft 0.21 converts it "
        "for Mixtral and the Qwen2-MoE pattern to target_parameters (gate_up_proj at rank 2r, down_proj, gate.weight: "
        "utils/transformers_weight_conversion.py), whose ParamWrapper folds W + BA into a new weight by baddbmm "
        "(tuners/lora/layer.py:2319) that grouped_mm saves: a copy of every adapted expert stack per block "
        "(lora/expert_weights). QLoRA: bitsandbytes quantises nn.Linear only; the "
        "3D stacks stay unquantised and prepare_model_for_kbit_training upcasts them to fp32. The qwen3-moe ckpt "
        "row (+0.77 %): the model's backward_end holds the first block's whole recompute beside every gradient; the "
        "experts' saved tensors (most of an MoE block's) are freed before the first block's attention and the "
        "embedding get their gradients, so the measured peak is the optimizer step's.")),
    ("", "adamw_8bit", (
        "bitsandbytes' CPU 8-bit step allocates below the dispatcher (the custom op "
        "`bitsandbytes::optimizer_update_8bit_blockwise` runs a Python kernel the dispatch count cannot see "
        "into): bitsandbytes 0.50.2 backends/cpu/ops.py `_optimizer_update_8bit_blockwise_cpu`, per parameter "
        "tensor of n >= min_8bit_size (4096) elements, one tensor at a time: state1 and state2 dequantised to "
        "fp32 (l.498, l.502: 4n + 4n, `torch.empty_like(A, dtype=float32)` at l.99), `grad = g.float() * "
        "gnorm_scale` (l.504: 4n; `g.float()` of an fp32 gradient is the gradient itself), `p_fp32 = "
        "p.data.float()` (l.505: 4n for 16-bit parameters, nothing for fp32 ones), then `denom = "
        "(state2_fp32.sqrt() / correction2)` (l.514: sqrt 4n and the quotient 4n together) -> peak 20n bytes "
        "(fp32 parameters) or 24n (16-bit parameters) for the largest such tensor, plus 12 B of 0-dim scalar "
        "wrappers, on top of the weights, every gradient and the 8-bit states, during optimizer.step(). "
        "The requantisation (l.575-577: n uint8 + 4*ceil(n/256) absmax each, states and denom still live) "
        "stays below it (17n + n/64). Measured on a tiny llama (largest tensor 64,000): +1,280,012 B (fp32) "
        "and +1,536,012 B (pure bf16) over the bytes live as the optimizer phase began, exactly 20n + 12 "
        "and 24n + 12. With ZeRO-1/2 (no offload) the optimizer steps DeepSpeed's one flat fp32 partition "
        "(stage_1_and_2.py `single_partition_of_fp32_groups`), so n is the whole partition, trainable "
        "parameters / world size: 20 B per parameter (tiny gpt2, 685,568 parameters: measured -49.8 % "
        "against the allocator, +0.3 % against the dispatch count). On CUDA the kernel updates in place "
        "(no term). LoRA (paged_adamw_8bit row) steps only adapter tensors, the largest r x intermediate "
        "(16 x 1376 = 22,016 elements: 440,320 B), below its backward peak. The memory model counts this "
        "term (planner/memory/optimizers.py `AdamW8bit.step_transient`, the cpu KernelProfile's "
        "`bnb_8bit_step_whole_tensor`): these rows went from -18.1 ... -49.9 % to within 0.03 %; the "
        "dispatch count, which cannot see the term, is now the one the prediction exceeds.")),
    ("", "zero3", (
        "ZeRO-3 (qwen2 and gemma tie the embedding to the head, gpt2 too): no term is missing on the CPU. "
        "Against torch.profiler's raw running total (\"Total Allocated\") these rows read 0.2-5.2 % under, "
        "varying run to run: DeepSpeed 0.19.8 gathers a parameter larger than the all-gather bucket on its "
        "own into `param_buffer = torch.empty(ceil(numel / world) * world, dtype=bf16)` "
        "(runtime/zero/partition_parameters.py:1388; the async gloo all-gather at :1397 -> :123 "
        "`async_op=True`), releases it with `free_param` (:329 `param.data = torch.empty(0)`), and the last "
        "reference can die on gloo's worker thread, where c10 does not report the free "
        "(CPUAllocator.cpp `ProfiledCPUMemoryReporter::Delete`: `memoryProfilingEnabled()` is thread-local): "
        "c10's total keeps those bytes for good. Seen: the tied embedding's bf16 copy, vocab x hidden x 2 B "
        "(gpt2 50257 x 384 x 2 = 38,597,376 B; qwen2 32000 x 384 x 2 = 24,576,000 B), plus 1-6 MLP weights "
        "of hidden x intermediate x 2 B; the tied embedding is the largest parameter, so it is always "
        "gathered alone. The probe counts a ledger of the reported blocks by address (an allocation at an "
        "address still live proves the earlier free went unreported) and leaves out blocks live at the "
        "step's start that no live storage holds; with it these rows agree with the dispatch count to "
        "a few bytes. In the run of this table c10's total ended 25,362,432 B above the ledger for qwen2 "
        "(its embedding 24,576,000 + one MLP weight 786,432), 35,389,440 B for gemma (its embedding "
        "32000 x 512 x 2 = 32,768,000 + 2,621,440 of layer weights) and 0 B for gpt2.")),
    ("llama-v2k", "^lora r16 all-linear, bf16", (
        "LoRA with fp32 adapters on 16-bit activations, checkpointed (the llama-v2k rows with ckpt; before the "
        "model's `first_block_recompute` moment they read -10.9 % and -18.6 %): the peak is the end of the last "
        "block's recompute, before its backward frees anything (the recompute runs inside lora_B's MmBackward0 "
        "of down_proj, the first node that unpacks a saved tensor, and stops at the block's last saved tensor: "
        "torch utils/checkpoint.py `_StopRecomputationError`). bf16-mixed: inside down_proj's adapter, every saved "
        "tensor of the block alive beside the forward's locals that nothing saves: the MLP's fp32 input (RMSNorm "
        "output; gate/up save bf16 casts of it) 4,194,304 B, the bf16 product act(gate)*up 5,636,096, peft's fp32 "
        "copy of it (`_cast_input_dtype`, tuners_utils.py:2235; lora_A saves autocast's bf16 cast of that copy) "
        "11,272,192, the base down_proj's bf16 output 2,097,152; and the gradients held: the block output's fp32 "
        "4,194,304, its bf16 cast 2,097,152, grad*scaling 2,097,152. The 314,336 B left (-0.19 %) are a bf16 "
        "matmul's scratch inside lora_A's mm (296,576 B, allocated and freed within the op) and small rotary and "
        "norm tensors. Pure bf16: inside up_proj's `result + lora_B(lora_A(x)) * scaling` (lora/layer.py:1102), "
        "the bf16 base output, the fp32 scaled adapter output, their fp32 sum and the base output promoted to "
        "fp32 first (11,272,192 B: aten TensorIterator.cpp compute_types promotes a mixed-dtype input by a "
        "temporary copy on the CPU, below the dispatcher: the dispatch count misses it, hence +8.29 % against "
        "it). Without checkpointing both peak at the loss' backward as before (exact).")),
]

# the multi-rank rows (issue 24): 2 ranks over gloo
ROW_NOTES += [
    ("llama-8k", "fsdp2", (
        "FSDP2 on 2 ranks (planner/sharding/fsdp2.py; fully_shard on each decoder layer, then the root with torch's "
        "default, not resharded after forward, as accelerate leaves it): each rank keeps its fp32 shards, their "
        "gradients and AdamW's moments; the root (embeddings, lm_head, final norm) unsharded in bf16 from the first "
        "forward to the end of backward with one all-gather output beside it (the root's pre-backward prefetches the "
        "last layer as the loss' backward starts, 1,598,976 B with its adapters). Full fine-tuning peaks at the root's "
        "reduce-scatter: its fp32 input (16,385,024 B) and output shard, gloo's flat copy of the input "
        "(ProcessGroupGloo `_reduce_scatter_base`, 16,385,024 B, the CPU only) and lm_head's bf16 gradient; with or "
        "without checkpointing, since a layer's activations are small beside the root here. LoRA peaks at the loss' "
        "backward: FSDP2 gathers peft's fp32 adapters in bf16 (param_dtype), so no adapter keeps an fp32 copy of its "
        "input (the model counted one per adapter before: +3.6 %). Run to run the allocator read 84,148,608 B or "
        "81,246,592 B on a rank of the full row: the last layer's gloo copy (2,902,016 B) is held only by its "
        "collective's work, which the caller's thread or gloo's worker thread drops last, a race; c10 reports no "
        "free on gloo's thread, so the ledger kept the block until its address came back. The dispatch count, whose "
        "storage callbacks run on any thread, read 81,246,580 B every time. The probe now frees such a block when "
        "its gloo run ends (workers/probes.py `_work_frees`): 6 rank readings of 3 runs, all 81,246,592 B; the model "
        "counts the physical peak, without the last layer's copy. CPUOffloadPolicy is not rowed: where the device "
        "is the host its copies to and from the device are no-ops (fsdp/_fully_shard/_fsdp_param.py "
        "`sharded_param_data.to(self.device)`, the reduce-scatter output's `.to(\"cpu\")`, pin_memory off), so "
        "the run holds what the run without it holds (plus per-parameter bf16 casts at each gather: offload turns "
        "off the foreach copy-in, _fsdp_collectives.py `use_foreach_copy`), while the plan splits it into device "
        "and host bytes: the allocator's one number checks neither.")),
    ("llama-8k", "zero", (
        "ZeRO on 2 ranks: ZeRO-3 keeps every parameter gathered from its forward to its backward (it is used again "
        "within stage3_max_reuse_distance, 1e9 elements: partitioned_param_coordinator.py l.653-662), so the loss' "
        "backward runs with the whole bf16 model gathered, lm_head included (11,091,968 B; before this term the row "
        "read -4.74 %); with LoRA the frozen embedding and layer 0's frozen q/k/v run no backward and are released "
        "(7,013,376 B live). DeepSpeed casts LoRA's adapters to bf16 with the rest of the model "
        "(engine.py `_cast_module_mixed_precision`): no fp32 copy of an adapter's input (the model counted one: "
        "+9.2 % and +9.1 %), bf16 adapters whole under ZeRO-2 and partitioned under ZeRO-3 (but the 2,048-element "
        "k/v lora_B, under the persistence threshold of 10 x hidden); ZeRO-3's mem-efficient linear saves the frozen "
        "lm_head's input (131,072 B). ZeRO-2 full: before the probe dated frees on gloo's threads by the dispatch count, "
        "a rank read 81,760,040 or 78,016,296 B run to run (lm_head's bf16 gradient, 4,096,000 B, released by gloo's "
        "thread after its reduction, still counted at the step); since, 77,664,040 B on every rank of 3 runs. Left: "
        "ZeRO-2 allocates its reduce bucket (131,072 B) after the loss' backward (LoRA +0.31 %).")),
]

# the 2025-26 families (issue 23)
ROW_NOTES += [
    ("deepseek-v3", "", (
        "DeepSeek-V3 shrunk (a dense then an MoE block): multi-head latent attention (attention.latent_attention_terms: "
        "the q_a/kv_a RMSNorms, the q_b/kv_b inputs; q and k of nope + rope dims, v and the output of v dims, so "
        "the CPU's SDPA runs its fp32 math path: aten sdp_utils_cpp.cpp check_head_dim_size_cpp); the "
        "group-limited sigmoid router (moe._group_limited_bytes) and a shared expert without gate; checked layer by "
        "layer against autograd in tests/memory/test_mla.py. LoRA all-linear: peft converts deepseek_v3 configs, so it "
        "reaches the expert stacks and the router and leaves the dense and shared MLP modules alone.")),
]
ROW_NOTES += [
    ("qwen2-moe", "", (
        "Dense and MoE blocks in one model (qwen2-moe: block 0 dense by mlp_only_layers; qwen3-moe-mixed: "
        "decoder_sparse_step 2 and mlp_only_layers [2]): each kind of block has its own terms "
        "(ModelSpec.block_kinds, activations.layer_terms), each checked byte for byte against autograd's saved "
        "tensors in tests/memory/test_moe.py. Qwen2MoeSparseMoeBlock (modeling_qwen2_moe.py:332-351) adds a shared "
        "expert, a SwiGLU on the block's normed input whose output sigmoid(shared_expert_gate(x)) scales "
        "(moe/shared_*). peft has no v4-to-v5 conversion for qwen2_moe (transformers' "
        "_MODEL_TO_CONVERSION_PATTERN has no such key), so all-linear wraps the attention, the shared expert and "
        "its gate, not the expert stacks; for qwen3_moe it converts, so all-linear reaches the stacks and the "
        "router and leaves the dense blocks' gate/up/down_proj modules unwrapped.")),
    ("qwen3-moe-mixed", "", "Dense and MoE blocks in one model: as the qwen2-moe rows' note says."),
    ("gpt-oss", "", (
        "gpt-oss (a sliding then a full-attention layer; eager attention, its only path without kernels: "
        "GptOssPreTrainedModel._supports_sdpa = False): softmax over s + 1 columns (the sinks) in the "
        "parameters' dtype (the fp32 sinks promote the concatenated scores), the max's int64 indices; the router "
        "takes top-k of the logits and a softmax over the k (no softmax over every expert is saved); the experts' "
        "clamped SwiGLU (modeling_gpt_oss.py:85-91) keeps 6I per routed slot besides the down input, and the "
        "bias gathers one int64 index per slot. The sliding window is an additive mask in eager attention: a "
        "sliding and a full layer save the same bytes. LoRA all-linear is the attention only: peft converts no "
        "gpt_oss config. The MXFP4 checkpoint is not involved (random bf16/fp32 weights, as after "
        "Mxfp4Config(dequantize=True)). The ckpt row (-0.44 %) is not traced yet: its measured peak is inside "
        "backward, the model's at the loss' backward; the likely gap is the last block's backward through the "
        "clamped SwiGLU, whose gradients the model counts as the default gate's three intermediate tensors.")),
]
ROW_NOTES += [
    ("", "eval b", (
        "Evaluation during training (planner/memory/evaluation.py; workers/train.py runs the eval pass after the "
        "measured step, inside the probe): the model states without gradients (the HF Trainer's zero_grad comes "
        "before _maybe_log_save_evaluate) and autocast's cached bf16 casts of the weights that require a gradient "
        "(autocast_mode.cpp cached_cast: a leaf fp32 tensor that requires grad, no grad-mode test): every linear's "
        "and the head's in full fine-tuning (55,967,744 B, as the training forward saves them), the adapters' only "
        "under LoRA (56 casts, 1,183,744 B; a frozen weight's cast dies with its linear). The eval forward peaks at "
        "its loss: bf16 logits, their fp32 upcast and log_softmax's fp32 output together (131,072,000 + 262,144,000 "
        "+ 262,144,000 B at 8 x 256 tokens), the final norm's fp32 output and the int64 ids, padded labels and "
        "their shift. Generation peaks at its last step, inside the last layer's cache update: transformers 5.24's "
        "DynamicLayer keeps keys and values each in its own dtype (fp32 rope keys, bf16 values: 11 torch.cat "
        "tensors, the 8 cache layers, the last layer's old keys, the grown ids and mask), the previous step's fp32 "
        "next-token logits, and ~5 hidden-sized fp32 tensors of the step. Before the adapters-only casts the LoRA "
        "rows read +6.5 % and +13.0 %.")),
]
ROW_NOTES += [
    ("llama-long", "", (
        "Long context: one model (the bench llama, vocabulary 32000) at 512, 1024, 2048 and 4096 tokens, micro-batch 1, "
        "in that order; the error is flat in the length. LoRA checkpointed (the loss' backward is the peak: the logits "
        "path and the checkpoints grow with the tokens): -0.005, -0.003, -0.002, -0.001 %, the same 20,856 B left out "
        "at every length. The fused linear cross-entropy (workers/fused_ce.py, Liger's chunk loop in torch): -0.022, "
        "-0.024, -0.025, -0.026 %; before the CPU matmul's fp32 buffer (gpus.py KernelProfile.mm_fp32_buffer: a bf16 "
        "matmul on the CPU computes the chunk's logits into an fp32 buffer of their size, 2,048,128 B for 16 rows, "
        "allocated below the dispatcher, which the dispatch count misses) they read -0.71, -1.18, -1.78, -2.39 %: the "
        "chunk grows with the tokens (Liger's next_power_of_2(ceil(BT / ceil(V / H))) rows), so the missing term was "
        "per token.")),
]


def _row_notes(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for arch, text, note in ROW_NOTES:
        # text: a part of the config label, or with a leading "^" its beginning
        hit = (lambda c: c.startswith(text[1:])) if text.startswith("^") else (lambda c: text in c)
        numbers = [str(i) for i, r in enumerate(rows, 1) if arch in (r["arch"], "") and hit(r["config"])]
        if numbers:
            lines.append(f"- Row{'s' if len(numbers) > 1 else ''} {', '.join(numbers)}: {note}")
    return lines


def _markdown(rows: list[dict[str, Any]], *, device: str) -> str:
    errors = [abs(r["error_pct"]) for r in rows if r["error_pct"] is not None]
    versions = next((r["library_versions"] for r in rows if r["library_versions"]), {})
    lines = [
        f"# Memory model accuracy on {device}",
        "",
        "Generated by `python bench/accuracy.py`. Measured: the peak of the last of 3 optimizer steps "
        "(workers' probe; on the CPU the bytes c10's CPU allocator holds, with the dispatch count of live "
        "tensor storages beside it); predicted: `planner.memory.estimate_memory(..., "
        "gpu=get_gpu('cpu')).peak_allocated_bytes`. Error = (predicted - measured) / measured.",
        "",
        "Libraries: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())),
        "",
        "| # | arch | config | predicted | measured | error % | dispatch count | error % vs dispatch | measured peak phase |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for i, r in enumerate(rows, 1):
        measured = _fmt(r["measured_bytes"]) if r["outcome"] == "ok" else f"{r['outcome']}: {(r['error_text'] or '')[:60]}"
        predicted = _fmt(r["predicted_bytes"]) if r["predicted_bytes"] is not None else f"n/a: {r['predicted_phase'][:60]}"
        lines.append(
            f"| {i} | {r['arch']} | {r['config']} | {predicted} | {measured} | {_pct(r['error_pct'])} | "
            f"{_fmt(r.get('dispatch_bytes'))} | {_pct(r.get('dispatch_error_pct'))} | {r['measured_phase']} |"
        )
    lines.append("")
    if errors:
        lines.append(
            f"Compared: {len(errors)} of {len(rows)}; median |error| {statistics.median(errors):.3f} %, "
            f"max |error| {max(errors):.3f} %."
        )
    else:
        lines.append(f"Compared: 0 of {len(rows)}.")
    dispatch = [abs(r["dispatch_error_pct"]) for r in rows if r.get("dispatch_error_pct") is not None]
    if dispatch:
        lines.append(
            f"Against the dispatch count: median |error| {statistics.median(dispatch):.3f} %, max |error| {max(dispatch):.3f} %."
        )
    if device == "cpu":
        lines += _rank_section(rows)
        notes = _row_notes(rows)
        if notes:
            lines += ["", "## Findings by row", ""] + notes
        lines += ["", "## Where the remaining error comes from", ""] + [f"- {note}" for note in CPU_NOTES]
    return "\n".join(lines) + "\n"


def _rank_section(rows: list[dict[str, Any]]) -> list[str]:
    """The multi-rank rows again, each rank's peak beside the prediction for one rank and, for
    FSDP2, torch's ``FSDPMemTracker`` on the same configuration (``bench/fsdp2_tracker.py``)."""
    ranked = [(i, r) for i, r in enumerate(rows, 1) if r.get("rank_peaks") and len(r["rank_peaks"]) > 1]
    if not ranked:
        return []
    tracker_path = RESULTS / "accuracy-cpu-tracker.json"
    trackers = {(t["arch"], t["config"]): t for t in json.loads(tracker_path.read_text())} if tracker_path.exists() else {}
    lines = [
        "", "## Multi-rank rows: planner, c10's allocator and torch's FSDPMemTracker", "",
        "Each rank is a process of its own, the ranks joined over gloo (`workers/ranks.py`); predicted: one rank's "
        "peak; measured: each rank's peak by c10's allocator (the row above is the worst rank's); tracker: "
        "`torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`'s peak of the last step on each rank "
        "(`python bench/fsdp2_tracker.py`; it follows FSDP2 modules only).", "",
        "| # | arch | config | predicted | measured per rank | error % (worst rank) | tracker per rank | "
        "tracker vs measured % |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for i, r in ranked:
        tracked = [t["peak"] for t in trackers.get((r["arch"], r["config"]), {}).get("ranks", [])]
        if tracked and None not in tracked:
            worst = max(tracked)
            tracker, vs = " / ".join(f"{p:,}" for p in tracked), _pct(_error(worst, max(r["rank_peaks"])))
        else:
            tracker, vs = "-", "-"
        measured = " / ".join(f"{p:,}" for p in r["rank_peaks"] if p is not None)
        predicted = f"{r['predicted_bytes']:,}" if r["predicted_bytes"] is not None else "n/a"
        lines.append(f"| {i} | {r['arch']} | {r['config']} | {predicted} | {measured} | {_pct(r['error_pct'])} | "
                     f"{tracker} | {vs} |")
    errors = [abs(r["error_pct"]) for _, r in ranked if r["error_pct"] is not None]
    if errors:
        lines += ["", f"Multi-rank rows: {len(errors)}; median |error| {statistics.median(errors):.3f} %, "
                      f"max |error| {max(errors):.3f} %."]
    return lines


def _row_key(arch: str, config_dict: dict[str, Any]) -> str:
    """A row's configuration as today's TrainConfig writes it (rows stored before a field existed lack it)."""
    return json.dumps(TrainConfig.from_dict(config_dict).to_dict(), sort_keys=True) + arch


def _merge_partial(suffix: str, *, device: str) -> int:
    """The full table with the partial run's measured rows put in (replacing a row of the same
    configuration in its place, new rows after the table's in ``CASES`` order), all re-predicted."""
    full_path, partial_path = RESULTS / f"accuracy-{suffix}.json", RESULTS / f"accuracy-{suffix}-partial.json"
    if not partial_path.exists():
        print(f"no {partial_path.name}: run with --filter TEXT first", file=sys.stderr)
        return 2
    rows = {_row_key(r["arch"], r["config_dict"]): r for r in json.loads(full_path.read_text())}
    added = [r for r in json.loads(partial_path.read_text()) if r["outcome"] != "not measured"]
    new = {_row_key(r["arch"], r["config_dict"]): r for r in added}
    order = {_row_key(arch, TrainConfig(**(_BASE | changes)).to_dict()): i for i, (arch, changes) in enumerate(CASES)}
    # the table's rows keep their places (a re-measured one replaced in place); new ones follow in CASES order
    merged = [new.pop(key, row) for key, row in rows.items()]
    merged += sorted(new.values(), key=lambda r: order.get(_row_key(r["arch"], r["config_dict"]), len(order)))
    merged = [_repredicted(row) for row in merged]
    full_path.write_text(json.dumps(merged, indent=2, default=str) + "\n")
    (RESULTS / f"accuracy-{suffix}.md").write_text(_markdown(merged, device=device))
    print(f"merged {len(added)} rows into {full_path.name} ({len(merged)} rows) and rewrote the .md")
    return 0


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one configuration per architecture")
    parser.add_argument("--filter", dest="text", default=None, help="only configurations whose label contains TEXT")
    parser.add_argument("--knobs", action="store_true", help="only the rows of the recipe settings (lora_dropout, "
                        "loop, fused_ce, packing, use_cache, eval_batch)")
    parser.add_argument("--jobs", type=int, default=2, choices=(1, 2), help="measurement processes at once (max 2)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--deadline-min", type=float, default=None, help="start no measurement after M minutes")
    parser.add_argument("--resume", action="store_true", help="reuse the rows of an interrupted run")
    parser.add_argument("--render", action="store_true",
                        help="rewrite the .md from the committed .json (and the current notes) without measuring")
    parser.add_argument("--repredict", action="store_true",
                        help="predict every committed row again with the current model (the measurements stay "
                             "as measured), then rewrite the .json and the .md")
    parser.add_argument("--merge-partial", action="store_true",
                        help="put the measured rows of the last --filter/--quick run into the full table, "
                             "every row re-predicted with the current model")
    args = parser.parse_args(argv)
    if args.merge_partial:
        return _merge_partial("cpu" if args.device == "cpu" else "cuda", device=args.device)
    if args.render or args.repredict:
        # the committed table, or with --knobs the recipe settings' own
        suffix = ("cpu" if args.device == "cpu" else "cuda") + ("-knobs" if args.knobs else "")
        rows = json.loads((RESULTS / f"accuracy-{suffix}.json").read_text())
        if args.repredict:
            rows = [_repredicted(row) for row in rows]
            (RESULTS / f"accuracy-{suffix}.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
        (RESULTS / f"accuracy-{suffix}.md").write_text(_markdown(rows, device=args.device))
        print(f"wrote {RESULTS / f'accuracy-{suffix}.md'} from its .json")
        return 0
    cases = _cases(quick=args.quick, text=args.text, knobs=args.knobs)
    if not cases:
        print("no configuration matches --filter", file=sys.stderr)
        return 2
    print(f"measuring {len(cases)} configurations on {args.device}, {args.jobs} at a time ...", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "cpu" if args.device == "cpu" else "cuda"
    if args.knobs and not (args.quick or args.text):
        suffix += "-knobs"  # the recipe settings' rows, their own table
    elif args.quick or args.text or args.knobs:
        suffix += "-partial"  # never overwrite the committed full table with a subset
    deadline = time.monotonic() + 60 * args.deadline_min if args.deadline_min else None
    rows = _measure_all(cases, device=args.device, jobs=args.jobs, deadline=deadline,
                        progress=RESULTS / f"accuracy-{suffix}.rows.jsonl", resume=args.resume)
    text = _markdown(rows, device=args.device)
    print()
    print(text)
    (RESULTS / f"accuracy-{suffix}.md").write_text(text)
    (RESULTS / f"accuracy-{suffix}.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
    print(f"wrote {RESULTS / f'accuracy-{suffix}.md'} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
