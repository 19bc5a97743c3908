"""The real allocation sequence of fms-acceleration's Mistral-7B LoRA steps against the planner's drawing of it.

    python bench/fsdp1_real_sequence.py --site DIR [--site448 DIR] [--cache DIR] [--out FILE]

Issue 25: fms-acceleration's 2-GPU FSDP1 LoRA rows (nvidia-smi) stand 1.8-2.1 GiB a device beyond the
replay's reserve where its 1-GPU LoRA rows stand 0.6-1.1 GiB beyond (bench/results/accuracy-gpu-published.md).
This records the sequence of tensor storages a step makes and frees, op by op, as the run's libraries make it
(transformers 4.45.2 for the 2024 rows, 4.48.1 for the 2025 rows, peft 0.13.2: their wheels installed with
``pip install --no-deps --target DIR``, given as ``--site``/``--site448``), at the rows' full shapes (Mistral-7B,
32 layers, 4096 tokens, micro-batch 2-8, LoRA r16 on q, k, v, o in fp32 with the rows' dropout; under QLoRA the
decoder layers' linears are bitsandbytes 0.43's 4-bit calls, ``MatMul4Bit``: the weight dequantised for the
matmul and freed, again in backward, and the adapters gathered in 16 bits by FSDP1's MixedPrecision), and replays it through
``planner.memory.allocator`` on the default stream after the planner's own model states (the wrap prelude and
the resident shards), beside the planner's timeline of the same row.

How the sequence is recorded (``record``, run in a subprocess on the ``meta`` device: sizes and order without
compute): a ``TorchDispatchMode`` notes each op output's storage when first seen and its death (a weak reference
to the storage), the resident parameters excluded; CUDA's fused dropout (ATen Dropout.cpp
``is_fused_kernel_acceptable``: CUDA only; output and a bool mask) in place of the CPU's fp32 noise; flash-attn
2's memory for the rows' FlashAttention-2 (out and an fp32 softmax_lse saved; in backward an fp32 dq_accum and
softmax_d beside dq, dk, dv; the eight KV heads taken as they are, no ``repeat_kv``); the HF Trainer's
``compute_loss`` keeping only the loss. With ``retain``, each decoder layer's recomputed input (a leaf under the
reentrant checkpoint, holding its ``.grad``) is kept to the end of backward, as FSDP1's reshard-only hook keeps it
for a frozen unit (planner.sharding.fsdp1.retained_input_gradients); without it, the 1-GPU runs.

The replay of the real sequence is the default stream's only: FSDP1's gathered units (the unshard stream's own
pool) are left out of both sides of the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

GiB = 1024**3

#: (row, transformers, micro-batch, retain): the fms rows compared, the 2-GPU FSDP1 rows with the retained
#: layer inputs, the 1-GPU rows without
ROWS = (
    ("fms24-mistral-lora-g2-bs2-nvidia", "4.45", 2, True),
    ("fms24-mistral-lora-g2-bs4-nvidia", "4.45", 4, True),
    ("fms-mistral-lora-bs4-nvidia", "4.45", 4, False),
    ("fms-mistral-lora-bs8-nvidia", "4.45", 8, False),
    ("fms25-mistral-lora-g2-bs2-nvidia", "4.48", 2, True),
    ("fms25-mistral-lora-g2-bs4-nvidia", "4.48", 4, True),
    ("fms25-mistral-lora-g1-bs4-nvidia", "4.48", 4, False),
    ("fms25-mistral-lora-g1-bs8-nvidia", "4.48", 8, False),
    ("fms24-mistral-qlora-g2-bs2-nvidia", "4.45", 2, True),
    ("fms24-mistral-qlora-g2-bs4-nvidia", "4.45", 4, True),
    ("fms25-mistral-qlora-g2-bs2-nvidia", "4.48", 2, True),
    ("fms25-mistral-qlora-g2-bs4-nvidia", "4.48", 4, True),
)

#: what the subprocess runs (``record``): argv = site, batch, retain, dropout, qlora, out
_RECORDER = r'''
import json, sys, types, weakref
site, batch, retain, dropout = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", float(sys.argv[4])
qlora, out_path = sys.argv[5] == "1", sys.argv[6]
sys.path.insert(0, site)
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


class FlashAttention2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):  # (B, H, S, D) views, as the models hand them over
        B, H, S, D = q.shape
        out = torch.empty(B, S, H, D, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        B, H, S, D = q.shape
        dev, grad = q.device, grad.transpose(1, 2).contiguous()
        dq = torch.empty(B, S, H, D, dtype=q.dtype, device=dev)
        dk = torch.empty(B, S, k.shape[1], D, dtype=q.dtype, device=dev)
        dv = torch.empty(B, S, v.shape[1], D, dtype=q.dtype, device=dev)
        dq_accum = torch.empty(B, S, H, D, dtype=torch.float32, device=dev)
        softmax_d = torch.empty(B, H, S, dtype=torch.float32, device=dev)
        del dq_accum, softmax_d, grad
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.events, self.seen, self.n, self.tag = [], WeakIdKeyDictionary(), 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MATMULS:  # sizes only
            a, b = (args[1], args[2]) if func in (aten.addmm.default, aten.baddbmm.default) else args[:2]
            out = torch.empty((*a.shape[:-1], b.shape[-1]), dtype=a.dtype, device=a.device)
        else:
            out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.nbytes() and st not in self.seen:
                    i, nb, ev = self.n, st.nbytes(), self.events
                    self.n += 1
                    ev.append(["alloc", i, nb, self.tag])
                    self.seen[st] = weakref.ref(st, lambda _r, i=i, nb=nb, ev=ev, s=self: ev.append(["free", i, nb, s.tag]))
        return out


class MatMul4Bit(torch.autograd.Function):
    """bitsandbytes 0.43's 4-bit base call (autograd/_functions.py MatMul4Bit): the weight dequantised to the
    input's dtype for the matmul and freed, the input kept; in backward dequantised again for the input's
    gradient."""
    @staticmethod
    def forward(ctx, x, weight):
        w = torch.empty(weight.shape, dtype=x.dtype, device=x.device)
        out = torch.nn.functional.linear(x, w)
        del w
        ctx.save_for_backward(x)
        ctx.shape = weight.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        w = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        return torch.matmul(grad, w), None


def cuda_dropout(input, p=0.5, training=True, inplace=False):
    return torch.native_dropout(input, p, True)[0] if training and 0 < p < 1 else input


class Autocast(torch.autocast):  # the rotary embedding's autocast(enabled=False) on the meta device
    def __init__(self, device_type, *a, **k):
        super().__init__("cpu" if device_type == "meta" else device_type, *a, **k)


torch.autocast = Autocast
torch.nn.functional.dropout = cuda_dropout
torch.nn.functional.scaled_dot_product_attention = lambda q, k, v, *a, **kw: FlashAttention2.apply(q, k, v)
from transformers import MistralConfig, MistralForCausalLM
from transformers.models.mistral import modeling_mistral
from peft import LoraConfig, get_peft_model
modeling_mistral.repeat_kv = lambda x, n: x
try:  # transformers >= 4.48: the attention functions by name
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda module, q, k, v, *a, **kw: (FlashAttention2.apply(q, k, v).transpose(1, 2), None)
except ImportError:
    pass
config = MistralConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=32000, num_hidden_layers=32, max_position_embeddings=32768, rms_norm_eps=1e-5,
                       sliding_window=None)
config._attn_implementation = "sdpa"
with torch.device("meta"):
    model = MistralForCausalLM(config).to(torch.bfloat16)
model.config.use_cache = False
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=dropout,
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
base = model.base_model.model
if qlora:  # the decoder layers' linears are Linear4bit; the adapters gathered in 16 bits (FSDP1's MixedPrecision)
    for name, module in base.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear) and "lora_" not in name:
            module.forward = types.MethodType(lambda self, x: MatMul4Bit.apply(x, self.weight), module)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(torch.bfloat16)
base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
base.enable_input_require_grads()
model.train()
kept = []
if retain:
    def keep(module, args, kwargs):
        if torch.is_grad_enabled() and args and args[0].requires_grad:
            kept.append(args[0])
    for layer in base.model.layers:
        layer.register_forward_pre_hook(keep, with_kwargs=True)
ids = torch.zeros(batch, 4096, dtype=torch.long, device="meta")
recorder = Recorder()
for t in list(model.parameters()) + list(model.buffers()):
    recorder.seen[t.untyped_storage()] = None  # resident: not the step's
with recorder:
    for step in range(2):
        recorder.tag = f"step {step}: forward"
        loss = model(input_ids=ids, labels=ids).loss
        recorder.tag = f"step {step}: backward"
        loss.backward()
        del loss
        kept.clear()
        model.zero_grad(set_to_none=True)
json.dump(recorder.events, open(out_path, "w"))
'''


def record(site: str, batch: int, retain: bool, dropout: float, cache: Path, qlora: bool = False) -> list:
    """The recorded events (``[op, ident, bytes, phase]``), cached in ``cache``."""
    path = cache / f"{Path(site).name}-b{batch}-r{int(retain)}-d{dropout}{'-qlora' if qlora else ''}.json"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", _RECORDER, site, str(batch), "1" if retain else "0", str(dropout),
                        "1" if qlora else "0", str(path)], check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return json.loads(path.read_text())


def default_stream_reserve(events: list) -> tuple[int, int]:
    """(peak reserved, peak allocated) of the default stream's pool over ``events`` (timeline events), the side
    streams' keys left out."""
    from planner.memory.allocator import UNLIMITED, AllocatorConfig, _Replaying, kMinBlockSize

    state = _Replaying(UNLIMITED, AllocatorConfig(), ())
    state.advance(events, {e[4] for e in events if e[0] == "free"}, None)
    return state.allocator._peak_reserved * kMinBlockSize, state.peak


def compare(row_id: str, real: list) -> dict:
    """The planner's row: its timeline's default-stream reserve, and the same with its step replaced by the real
    sequence (the model states, wrap prelude included, kept)."""
    import published

    from planner.memory import estimate_memory
    from planner.memory.estimate import device_timeline

    rows = {r["id"]: r for r in published.load()["rows"]}
    spec, gpu, config, _ = published.map_row(rows[row_id])
    side = {key for key, _ in config.sharding.spec.streams(config)}
    events = [e for e in device_timeline(model=spec, config=config, gpu=gpu).events if e[1] not in side]
    first = next(i for i, e in enumerate(events) if e[5].startswith("step 1"))
    planner, _ = default_stream_reserve(events)
    substituted = list(events[:first]) + [(op, "activations/real", nb, 1, 10**9 + i, where)
                                          for op, i, nb, where in real]
    real_reserve, _ = default_stream_reserve(substituted)
    estimate = estimate_memory(model=spec, config=config, gpu=gpu)
    measured = published.measured_bytes(rows[row_id])
    total = estimate.process_total_bytes + real_reserve - planner
    return dict(row=row_id, measured=measured, predicted=estimate.process_total_bytes, planner=planner,
                real=real_reserve, with_real=total, error=(estimate.process_total_bytes - measured) / measured,
                error_real=(total - measured) / measured)


def markdown(results: list[dict]) -> str:
    lines = ["# The real allocation sequence of fms' Mistral-7B LoRA steps against the planner's drawing", "",
             "Generated by `python bench/fsdp1_real_sequence.py` (see its docstring). Default-stream reserve: the "
             "planner's timeline of the row replayed on the default stream (its model states, the FSDP1 wrap prelude "
             "and shards included; FSDP1's gathered units, on their own stream, left out), and the same with the "
             "step replaced by the real sequence of two steps. nvidia-smi: the row's measured figure, the planner's "
             "process total, and that total with the real sequence's reserve in place of the timeline's.", "",
             "| row | default-stream reserve GiB, planner | real sequence | real - planner | nvidia-smi GiB measured "
             "| predicted | error | with the real sequence | error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['row']} | {r['planner'] / GiB:.2f} | {r['real'] / GiB:.2f} | "
                     f"{(r['real'] - r['planner']) / GiB:+.2f} | {r['measured'] / GiB:.2f} | "
                     f"{r['predicted'] / GiB:.2f} | {r['error']:+.1%} | {r['with_real'] / GiB:.2f} | "
                     f"{r['error_real']:+.1%} |")
    groups = {"2-GPU FSDP1 LoRA rows": [r for r in results if "-g2-" in r["row"] and "-lora-" in r["row"]],
              "1-GPU LoRA rows": [r for r in results if "-g2-" not in r["row"]],
              "2-GPU FSDP1 QLoRA rows": [r for r in results if "-qlora-" in r["row"]]}

    def span(rs: list[dict], key: str) -> str:
        values = sorted((r[key] - r["measured"]) / GiB for r in rs)
        return f"{values[0]:+.2f} to {values[-1]:+.2f} GiB"

    lines += ["", "Predicted less measured (nvidia-smi), as planned and with the real sequence:", ""]
    lines += [f"- {name}: {span(rs, 'predicted')} -> {span(rs, 'with_real')}" for name, rs in groups.items() if rs]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", required=True, help="transformers 4.45.2 and peft 0.13.2 (pip install --target)")
    parser.add_argument("--site448", help="transformers 4.48.1 and peft 0.13.2, for the 2025 rows")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/fsdp1_real_sequence"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import published

    stated = {r["id"]: r["settings"] for r in published.load()["rows"]}
    results = []
    for row_id, version, batch, retain in ROWS:
        site = args.site if version == "4.45" else args.site448
        if site is None:
            continue
        dropout = float(stated[row_id].get("lora_dropout") or 0.0)  # as each row states it (2024: 0, 2025: 0.1)
        qlora = stated[row_id]["method"] == "qlora"
        results.append(compare(row_id, record(site, batch, retain, dropout, args.cache, qlora)))
        r = results[-1]
        print(f"{row_id:36s} default reserve planner {r['planner'] / GiB:6.2f} real {r['real'] / GiB:6.2f} "
              f"nvidia-smi {r['error']:+.1%} -> {r['error_real']:+.1%}", flush=True)
    if args.out:
        args.out.write_text(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
