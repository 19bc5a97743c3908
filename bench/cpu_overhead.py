"""Micro-benchmarks of what makes small models slow on the CPU: the figures behind the CPU
profile's constants and of a GPU host's dispatch (``planner.kernels`` CPU_*, HOST_OP_SECONDS; ``planner.gpus`` cpu profile).

    python bench/cpu_overhead.py [--quick] [--cpu-time] [--only dispatch,host,optimizer,gemm,bandwidth,step]

Prints, on this machine (torch's default threads; other processes share the cores: the 1-minute
load average is printed, run it when that is low):

* dispatch   host seconds per eager op: a tiny aten op (no grad), the same op recording an autograd
             node, the backward per node, and an ``nn.Module.__call__`` around it (hooks machinery)
* fixed      a whole HF training step on tiny tensors (8 tokens, vocabulary 256): its host time per aten
             op forward and backward, and AdamW's per parameter tensor
* host       a whole training micro-step's host time per counted op (``ops_per_micro_step``) on tiny tensors, gpt2,
             llama and BERT-large, fp32 and under autocast, without checkpointing and with the non-reentrant and
             reentrant ones, and the aten ops that would launch a GPU kernel per counted op (``HOST_OP_SECONDS``)
* optimizer  torch.optim.AdamW's step: seconds per parameter tensor (many 1-element tensors) and
             per element (one large tensor), for the single-tensor, foreach and fused paths
* gemm       achieved FLOP/s of the GEMM shapes small models run (fp32, bf16, and an fp32 weight
             under bf16 autocast, which casts the weight per call)
* bandwidth  achieved bytes/s of large elementwise ops (copy, add, mul) in fp32 and bf16
* step       one training step of small HF models split into forward, backward and optimizer, with
             the number of aten ops each launches (torch's dispatcher, counted by a TorchDispatchMode)
* adapter    what one peft LoRA layer (r 16, bf16 base, peft's fp32 adapters, no autocast) adds to its frozen
             base's forward + backward at the bench's shapes: seconds, aten ops, the seconds of its rank-r
             fp32 GEMMs (the rest: its casts, ``* scaling`` and the add)
* attention  SDPA forward + backward on the bench's shapes: the CPU flash kernel (causal, no dropout) and
             the math path dropout forces (fp32 for 16-bit inputs), as FLOP/s of the product
* dropout    ``bernoulli_`` (dropout's mask draw) per element, fp32 and bf16, several sizes, in this thread's CPU
             time and in wall time (one thread's CPU time equal to the wall at two threads: a serial kernel),
             and ``F.dropout`` forward + backward beside it
* adamw      torch.optim.AdamW's single-tensor path per element on one tensor, without page faults (glibc's trim
             and mmap thresholds raised with mallopt, so ``sqrt``'s and ``/``'s temporaries reuse the heap; this
             lasts for the rest of the process: it runs last), against the model's 80 B per element, and
             ``copy_`` of the same size
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


#: The clock: wall time, or with --cpu-time this thread's CPU time (single-threaded host work, such as
#: dispatching tiny ops, is then not inflated by other processes sharing the cores).
CLOCK = [time.perf_counter]


def _best(fn, *, repeat: int = 5, number: int = 1) -> float:
    """Median seconds of one call of ``fn`` (``number`` calls per timing, ``repeat`` timings)."""
    fn()
    times = []
    clock = CLOCK[0]
    for _ in range(repeat):
        t0 = clock()
        for _ in range(number):
            fn()
        times.append((clock() - t0) / number)
    return statistics.median(times)


def dispatch(quick: bool) -> None:
    import torch

    n = 2000 if quick else 20000
    a = torch.ones(8)
    b = torch.ones(8)

    def plain():
        x = a
        for _ in range(n):
            x = torch.add(x, b)

    print(f"aten op, no grad (torch.add of 8 floats):            {_best(plain) / n * 1e6:6.2f} us/op")
    ag = torch.ones(8, requires_grad=True)

    def forward_graph():
        x = ag
        for _ in range(n):
            x = torch.add(x, b)
        return x

    print(f"aten op recording an autograd node:                   {_best(forward_graph) / n * 1e6:6.2f} us/op")

    def fwd_bwd():
        forward_graph().sum().backward()

    total = _best(fwd_bwd)
    fwd = _best(forward_graph)
    print(f"backward per autograd node (AddBackward0 + accumulate): {(total - fwd) / n * 1e6:6.2f} us/node")
    lin = torch.nn.Linear(8, 8)
    x8 = torch.ones(1, 8)

    def module_calls():
        for _ in range(n // 10):
            lin(x8)

    def functional_calls():
        for _ in range(n // 10):
            torch.nn.functional.linear(x8, lin.weight, lin.bias)

    m, f = _best(module_calls) / (n // 10), _best(functional_calls) / (n // 10)
    print(f"nn.Linear(8, 8) call: module {m * 1e6:6.2f} us, F.linear {f * 1e6:6.2f} us, "
          f"Module.__call__ {1e6 * (m - f):6.2f} us")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ab = _best(module_calls) / (n // 10)
    print(f"nn.Linear(8, 8) under bf16 autocast (casts x, W, b):  {ab * 1e6:6.2f} us")
    xg = torch.ones(1, 8, requires_grad=True)

    def linear_fwd_bwd():
        y = xg
        for _ in range(50):
            y = lin(y)
        y.sum().backward()

    print(f"nn.Linear(8, 8) forward + backward, per layer:        {_best(linear_fwd_bwd) / 50 * 1e6:6.2f} us")


def optimizer(quick: bool) -> None:
    import torch

    tensors = 200 if quick else 1000
    big = 4_000_000 if quick else 16_000_000
    for impl in ("single", "foreach", "fused"):
        kw = {"foreach": impl == "foreach", "fused": True if impl == "fused" else None}
        ps = [torch.nn.Parameter(torch.zeros(1)) for _ in range(tensors)]
        for p in ps:
            p.grad = torch.ones(1)
        opt = torch.optim.AdamW(ps, lr=1e-4, **kw)
        per_tensor = _best(opt.step) / tensors
        p = torch.nn.Parameter(torch.zeros(big))
        p.grad = torch.ones(big)
        opt = torch.optim.AdamW([p], lr=1e-4, **kw)
        per_elem = _best(opt.step, repeat=3)
        print(f"AdamW {impl:<8} fp32: {per_tensor * 1e6:7.2f} us per parameter tensor, "
              f"{per_elem / big * 1e9:6.3f} ns per element ({big * 28 / per_elem / 1e9:5.2f} GB/s at 28 B/param)")


GEMM_SHAPES = [  # (M tokens, K in, N out): gpt2-tiny (384), gpt2 (768), llama-tiny (256 / 688), heads
    (64, 384, 1152), (512, 384, 1152), (512, 384, 1536), (512, 1536, 384), (128, 768, 2304), (128, 768, 3072),
    (64, 256, 688), (512, 256, 688), (512, 384, 50257), (64, 256, 8192), (512, 256, 8192), (2048, 2048, 2048),
    (512, 384, 16), (512, 16, 384),
]


def gemm(quick: bool) -> None:
    import torch

    print(f"{'M':>5} {'K':>5} {'N':>6} {'fp32 GF/s':>10} {'bf16 GF/s':>10} {'autocast GF/s':>14}")
    for m, k, n in GEMM_SHAPES[:6] if quick else GEMM_SHAPES:
        flops = 2.0 * m * k * n
        row = []
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
            row.append(flops / _best(lambda: torch.nn.functional.linear(x, w), repeat=5) / 1e9)
        x, w = torch.randn(m, k), torch.randn(n, k)

        def cast():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                torch.nn.functional.linear(x, w)

        row.append(flops / _best(cast, repeat=5) / 1e9)
        print(f"{m:>5} {k:>5} {n:>6} {row[0]:>10.1f} {row[1]:>10.1f} {row[2]:>14.1f}")


def bandwidth(quick: bool) -> None:
    import torch

    n = 16_000_000 if quick else 64_000_000
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.ones(n, dtype=dtype), torch.ones(n, dtype=dtype)
        e = a.element_size()
        out = torch.empty_like(a)
        for name, fn, moved in (("copy_", lambda: out.copy_(a), 2), ("add", lambda: torch.add(a, b, out=out), 3),
                                ("mul_", lambda: a.mul_(1.0), 2), ("add (new tensor)", lambda: a + b, 3)):
            s = _best(fn, repeat=5)
            print(f"{str(dtype):<15} {name:<17} {n * e * moved / s / 1e9:6.2f} GB/s")
    x = torch.ones(n)
    s = _best(lambda: x.to(torch.bfloat16), repeat=5)
    print(f"fp32 -> bf16 cast        {n * 6 / s / 1e9:6.2f} GB/s (4 B read + 2 B written)")
    # c10's CPU allocator hands a large block back to the OS when it is freed (glibc munmap), so each
    # fresh output is page-faulted in again: the cost per byte of a tensor allocated and first written
    kept = torch.empty(n)
    warm = _best(lambda: kept.fill_(1.0), repeat=5)
    fresh = _best(lambda: torch.empty(n).fill_(1.0), repeat=5)
    print(f"fill_ of a kept fp32 tensor   {n * 4 / warm / 1e9:6.2f} GB/s; of a fresh one {n * 4 / fresh / 1e9:6.2f} GB/s: "
          f"first touch costs {(fresh - warm) / (n * 4) * 1e12:.1f} ps/B ({n * 4 / (fresh - warm) / 1e9:.2f} GB/s)")


def _counting_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    return Count


def step(quick: bool) -> None:
    import os
    import sys

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from throughput_cpu import MODELS

    Count = _counting_mode()
    # (model, micro-batch, seq, precision): "lora" is the bench's LoRA rows, peft as the worker builds it (the
    # adapter settings planner emit writes, on a pure bf16 model, no autocast: peft's adapters stay fp32)
    for name, mb, seq, mode in (("gpt2-tiny", 1, 64, "bf16-mixed"), ("gpt2-tiny", 2, 256, "bf16-mixed"),
                                ("llama-tiny", 1, 64, "bf16-mixed"), ("gpt2-tiny", 1, 64, "fp32"),
                                ("gpt2-tiny", 2, 256, "lora"), ("llama-tiny", 2, 256, "lora")):
        mixed = mode == "bf16-mixed"
        cfg = {k: v for k, v in MODELS[name].items() if k != "model_type"}
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(MODELS[name]["model_type"], **cfg),
                                                 attn_implementation="sdpa",
                                                 dtype=torch.bfloat16 if mode == "lora" else torch.float32)
        if mode == "lora":
            from peft import LoraConfig, get_peft_model

            from planner.config import TrainConfig
            from planner.emit.settings import adapter_settings

            model = get_peft_model(model, LoraConfig(**adapter_settings(TrainConfig(method="lora", precision="bf16")),
                                                     task_type="CAUSAL_LM"))
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.randint(0, cfg["vocab_size"], (mb, seq))

        def fwd():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
                return model(input_ids=ids, labels=ids).loss

        for _ in range(2):
            fwd().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        times = {"forward": [], "backward": [], "optimizer": []}
        clock = CLOCK[0]
        for _ in range(3 if quick else 5):
            t0 = clock()
            loss = fwd()
            t1 = clock()
            loss.backward()
            t2 = clock()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = clock()
            for key, s in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[key].append(s)
        counts = {}
        for phase in ("forward", "backward", "optimizer"):
            with Count() as c:
                if phase == "forward":
                    loss = fwd()
                elif phase == "backward":
                    loss.backward()
                else:
                    opt.step()
            counts[phase] = c.ops
        opt.zero_grad(set_to_none=True)
        tensors = sum(1 for _ in model.parameters())
        label = f"{name} mb{mb} seq {seq} {mode}"
        print(f"{label}: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.1f} ms ({counts[k]} aten ops)"
                                       for k, v in times.items()) + f"; {tensors} parameter tensors")


TINY_WIDTHS = {"gpt2": dict(n_embd=32, n_head=2, vocab_size=256, bos_token_id=0, eos_token_id=0),
               "llama": dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                             vocab_size=256)}


def fixed(quick: bool) -> None:
    """The host time per op of a whole HF training step where the tensors are tiny (8 tokens, width 32, a
    256-token vocabulary): everything but the dispatch, module and autograd bookkeeping is negligible, so the
    step's time over its aten op count is the per-op cost the planner adds per op (``CPU_OP_SECONDS``)."""
    import os
    import sys

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from throughput_cpu import MODELS

    Count = _counting_mode()
    for name in ("gpt2-tiny", "llama-tiny"):
        for mixed in (False, True):
            cfg = {k: v for k, v in MODELS[name].items() if k != "model_type"}
            # the architecture's layers and ops at widths where the kernels' work is nothing
            cfg |= TINY_WIDTHS[MODELS[name]["model_type"]]
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(MODELS[name]["model_type"], **cfg),
                                                     attn_implementation="sdpa")
            model.train()
            ids = torch.randint(0, 256, (1, 8))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def fwd():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
                    return model(input_ids=ids, labels=ids).loss

            def fwd_bwd():
                fwd().backward()

            f, fb, o = _best(fwd, repeat=9), _best(fwd_bwd, repeat=9), _best(opt.step, repeat=9)
            counts = []
            for fn in (fwd, fwd_bwd, opt.step):
                with Count() as c:
                    fn()
                counts.append(c.ops)
            opt.zero_grad(set_to_none=True)
            fo, bo, oo = counts[0], counts[1] - counts[0], counts[2]
            tensors = sum(1 for _ in model.parameters())
            print(f"{name} {'bf16-mixed' if mixed else 'fp32'}, 8 tokens: forward {f * 1e3:.2f} ms / {fo} ops = "
                  f"{f / fo * 1e6:.1f} us/op; backward {(fb - f) * 1e3:.2f} ms / {bo} ops = {(fb - f) / bo * 1e6:.1f} "
                  f"us/op; AdamW {o * 1e3:.2f} ms / {tensors} tensors = {o / tensors * 1e6:.1f} us/tensor ({oo} ops)")


#: (name, HF model type, tiny-width config): the bench's models and BERT-large's 24 post-norm layers (the V100 rows of
#: bench/throughput.py: bert-large-uncased, sequence classification, eager attention)
HOST_MODELS = (("gpt2-tiny", "gpt2", None), ("llama-tiny", "llama", None),
               ("bert-large", "bert", dict(hidden_size=32, num_hidden_layers=24, num_attention_heads=2,
                                           intermediate_size=64, vocab_size=256, max_position_embeddings=64)))


def _launching(func) -> bool:
    """Whether an aten op runs a kernel: not a view (its schema returns an alias of an input: view, t, transpose,
    expand, detach, ...) nor a bare allocation (empty, empty_like)."""
    if func.overloadpacket.__name__ in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"):
        return False
    return not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def host(quick: bool) -> None:
    """A whole training micro-step's host time on tiny tensors (8 tokens, width 32: the kernels do no work), with and
    without checkpointing (transformers 5's non-reentrant, and the reentrant one transformers 4 called), fp32 and
    under bf16 autocast: its time over ``ops_per_micro_step``'s count (what the planner multiplies by its host seconds
    per op), and the aten ops that would launch a kernel on a GPU (not views, not bare allocations) per counted op."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import sys

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from throughput_cpu import MODELS

    from planner.catalog import spec_from_config
    from planner.config import TrainConfig
    from planner.kernels import ops_per_micro_step

    class Count(_counting_mode()):
        def __init__(self):
            super().__init__()
            self.launches = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.launches += _launching(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

    for name, model_type, tiny in HOST_MODELS[2:] if quick else HOST_MODELS:
        cfg = {k: v for k, v in MODELS[name].items() if k != "model_type"} | TINY_WIDTHS[model_type] if tiny is None \
            else tiny
        spec = spec_from_config({"model_type": model_type, **cfg}, model_id=f"bench/{name}", source="bench")
        for ckpt in (None, "non-reentrant", "reentrant"):
            for mixed in (False, True):
                torch.manual_seed(0)
                config = AutoConfig.for_model(model_type, **cfg)
                if model_type == "bert":
                    config._attn_implementation = "eager"
                    model = AutoModelForSequenceClassification.from_config(config)
                    labels = torch.tensor([1])
                else:
                    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
                    labels = None
                model.train()
                if ckpt:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
                ids = torch.randint(0, 256, (1, 8))

                def fwd_bwd(model=model, ids=ids, labels=labels, mixed=mixed):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
                        loss = model(input_ids=ids, labels=ids if labels is None else labels).loss
                    loss.backward()

                seconds = _best(fwd_bwd, repeat=9)
                with Count() as c:
                    fwd_bwd()
                counted = ops_per_micro_step(spec, TrainConfig(grad_ckpt=ckpt is not None))
                print(f"{name} {ckpt or 'no checkpointing'} {'bf16 autocast' if mixed else 'fp32'}: forward + backward "
                      f"{seconds * 1e3:.2f} ms, {c.ops} aten ops, {c.launches} launching; {counted} counted: "
                      f"{seconds / counted * 1e6:.1f} us and {c.launches / counted:.2f} launches per counted op")


def _op_seconds(fn) -> dict[str, float]:
    """Thread CPU seconds of each aten op ``fn`` runs (a TorchDispatchMode timing each call), by op name and
    its first tensor's dtype (``mm[float32]``)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Timed(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seconds = collections.defaultdict(float)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.thread_time()
            out = func(*args, **(kwargs or {}))
            dtype = next((str(a.dtype).removeprefix("torch.") for a in args if hasattr(a, "dtype")), "-")
            self.seconds[f"{func.overloadpacket.__name__}[{dtype}]"] += time.thread_time() - t0
            return out

    with Timed() as timed:
        fn()
    return dict(timed.seconds)


#: (tokens, in, out) of the bench's adapted linears: gpt2-tiny's c_attn, c_fc, mlp c_proj; llama-tiny's q, gate, down
ADAPTER_SHAPES = [(512, 384, 1152), (512, 384, 1536), (512, 1536, 384), (512, 256, 256), (512, 256, 688),
                  (512, 688, 256), (8, 32, 32)]


def adapter(quick: bool) -> None:
    """A stack of 8 bf16 linears, frozen, alone and with peft LoRA r 16 on each (peft's fp32 adapters: its
    ``autocast_adapter_dtype``), forward + backward with the input's gradient (a frozen layer inside a model
    computes it), one thread's CPU time per layer."""
    import torch
    from peft import LoraConfig, get_peft_model

    layers, r = 8, 16

    class Stack(torch.nn.Module):
        def __init__(self, i, o):
            super().__init__()
            self.l = torch.nn.ModuleList([torch.nn.Linear(i, o, dtype=torch.bfloat16) for _ in range(layers)])

        def forward(self, x):
            return sum(lin(x).float().sum() for lin in self.l)

    for tokens, i, o in ADAPTER_SHAPES[:2] if quick else ADAPTER_SHAPES:
        row = {}
        for lora in (False, True):
            torch.manual_seed(0)
            model = Stack(i, o).requires_grad_(False)
            if lora:
                model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                                         target_modules=[f"l.{k}" for k in range(layers)]))
            x = torch.randn(tokens, i, dtype=torch.bfloat16, requires_grad=True)
            def step(model=model, x=x):
                model(x).backward()

            row[lora] = _best(step, repeat=9) / layers
            if lora:
                ops = _op_seconds(step)
                with _counting_mode()() as count:
                    step()
                gemm = ops.get("mm[float32]", 0.0) / layers  # the adapters' (the frozen base's dX is bf16)
                flops = 3 * 2.0 * tokens * r * (i + o)
        added = row[True] - row[False]
        print(f"[{tokens} x {i}] -> {o}: frozen {row[False] * 1e6:7.1f} us, with LoRA {row[True] * 1e6:7.1f} us: "
              f"adds {added * 1e6:7.1f} us; its fp32 rank-{r} GEMMs {gemm * 1e6:6.1f} us ({flops / gemm / 1e9:5.1f} GFLOP/s), "
              f"{count.ops / layers:.0f} aten ops per layer with LoRA")


def attention(quick: bool) -> None:
    """SDPA forward + backward, bf16 inputs: causal without dropout (the CPU flash kernel) and with dropout 0.1
    (the math path, fp32), FLOP/s of the product (4 B T^2 H D forward, x 3.5 for the fused kernel's
    forward + backward, causal half; x 3 for the math path's full product)."""
    import torch

    for b, h, t, d in ((2, 4, 256, 64), (2, 6, 256, 64), (1, 12, 128, 64))[: 2 if quick else 3]:
        q, k, v = (torch.randn(b, h, t, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        product = 4.0 * b * h * t * t * d
        for label, p, flops in (("flash, causal", 0.0, product / 2 * 3.5), ("math (dropout 0.1)", 0.1, product * 3)):
            def step(q=q, k=k, v=v, p=p):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p).sum().backward()

            s = _best(step, repeat=9)
            print(f"B {b} H {h} T {t} D {d} {label:<20} {s * 1e3:7.2f} ms: {flops / s / 1e9:6.1f} GFLOP/s")


DROPOUT_SIZES = (64 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)


def dropout(quick: bool) -> None:
    import torch

    for n in DROPOUT_SIZES[:2] if quick else DROPOUT_SIZES:
        for dtype in (torch.float32, torch.bfloat16):
            mask, x = torch.empty(n, dtype=dtype), torch.randn(n, dtype=dtype)
            xg = x.clone().requires_grad_()

            def draw(mask=mask):
                mask.bernoulli_(0.9)

            def fwd_bwd(xg=xg, x=x):
                torch.nn.functional.dropout(xg, 0.1, training=True).backward(x)

            cpu = _best(draw, repeat=9)
            CLOCK[0], clock = time.perf_counter, CLOCK[0]
            wall = _best(draw, repeat=9)
            CLOCK[0] = clock
            both = _best(fwd_bwd, repeat=9)
            print(f"{n:>8} {dtype!s:<15} bernoulli_ {cpu / n * 1e9:5.2f} ns per element (wall {wall / n * 1e9:5.2f}); "
                  f"dropout forward + backward {both / n * 1e9:5.2f} ns per element")


def adamw(quick: bool) -> None:
    import ctypes

    import torch

    libc = ctypes.CDLL("libc.so.6")
    # M_TRIM_THRESHOLD (-1): never hand the heap's top back; M_MMAP_THRESHOLD (-3): heap blocks up to its 32 MiB cap
    if not (libc.mallopt(-1, 2**40) and libc.mallopt(-3, 32 * 2**20)):
        print("mallopt refused: the figures below include page faults")
    for n in (1_000_000, 4_000_000) if quick else (1_000_000, 4_000_000, 8_000_000):
        p = torch.nn.Parameter(torch.randn(n) * 0.02)
        p.grad = torch.randn(n)
        opt = torch.optim.AdamW([p], lr=1e-4, foreach=False)
        s = _best(opt.step, repeat=7)
        src, out = torch.randn(n), torch.empty(n)
        c = _best(lambda src=src, out=out: out.copy_(src), repeat=7)
        print(f"AdamW single-tensor fp32, {n / 1e6:.0f} M elements: {s / n * 1e9:5.2f} ns per element = "
              f"{80 * n / s / 1e9:5.1f} GB/s at the model's 80 B; copy_ {8 * n / c / 1e9:5.1f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only",
                        default="dispatch,fixed,host,optimizer,gemm,bandwidth,step,adapter,attention,dropout,adamw")
    parser.add_argument("--cpu-time", action="store_true", help="time dispatch and optimizer with this thread's CPU "
                        "time (robust to other processes; meaningless for multi-threaded kernels)")
    args = parser.parse_args()
    if args.cpu_time:
        CLOCK[0] = time.thread_time
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {Path('/proc/loadavg').read_text().split()[0]}")
    for name in args.only.split(","):
        print(f"--- {name}")
        globals()[name](args.quick)


if __name__ == "__main__":
    main()
