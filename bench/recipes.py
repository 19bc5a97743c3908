"""Published fine-tuning recipes against the planner's #1 (issue 20, item 6).

Each row is a recipe someone published *with the GPU it runs on*: Unsloth's notebooks (the GPU is
the one the notebook says to run on, and the one its saved output printed), torchtune's
single-device configs with the GPU of its README's "Memory and training speed" table. Each is
turned into the ``planner suggest`` request it answers (model from the catalog, GPU, global
batch, sequence length, method and the recipe settings a request carries: packing, fused CE) and
its own configuration (micro-batch x accumulation, precision, optimizer, LoRA rank and targets,
gradient checkpointing) is estimated with the code ``planner estimate`` uses
(``planner.estimation.estimate_configuration``).

The claim checked row by row: the planner's #1 fits with ``oom_probability`` at most
``NEAR_EDGE_PROBABILITY`` and is at least as fast, by the planner's own throughput model, as the
recipe's configuration. Where it is not, the report says why.

What a row cannot carry is named in its ``not_modelled`` (Unsloth's own Triton kernels and
offloaded checkpointing, torchtune's optimizer-in-backward): the planner plans the Hugging Face
(transformers + peft + bitsandbytes) run of the same recipe.

    python bench/recipes.py [--out PATH] [--quiet]

Writes ``bench/results/recipes.md`` and prints it. Offline, ~1-2 min on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "recipes.md"

UNSLOTH = ("unslothai/notebooks", "bdda2efc7ad5ae129ea63cd2065d23c391406283")
TORCHTUNE = ("pytorch/torchtune", "bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1")

#: Unsloth's notebook template: per_device_train_batch_size = 2, gradient_accumulation_steps = 4,
#: max_seq_length = 2048, optim = "adamw_8bit", use_gradient_checkpointing = "unsloth",
#: packing = False, load_in_4bit = True, LoRA on q,k,v,o,gate,up,down (every notebook below
#: states these in its cells; the rank is the row's own).
_UNSLOTH_NOT_MODELLED = "Unsloth's Triton kernels and offloaded checkpointing (planned as HF+peft+bnb)"
#: peft's names for Unsloth's ``target_modules`` (q,k,v,o,gate,up,down: every linear of the blocks)
_ALL_BLOCK_LINEARS = ("all-linear",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """One published recipe, the planner request it answers and its own configuration."""

    name: str
    repo: str
    path: str
    commit: str
    quote: str
    """Where in the source the GPU and the settings are stated."""
    model: str
    gpu: str
    gpus: int = 1
    method: str
    micro_batch: int
    grad_accum: int
    seq_len: int
    precision: str | None = None
    """None: the device's mixed precision, as a recipe with ``fp16 = not is_bf16_supported()`` sets."""
    optimizer: str = "adamw"
    lora_r: int | None = None
    lora_targets: tuple[str, ...] | None = None
    grad_ckpt: bool = True
    zero: int = 0
    packing: bool = False
    fused_ce: bool = False
    guessed: str = ""
    """The settings the source does not state and this row assumes."""
    not_modelled: str = ""

    @property
    def target_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.gpus

    @property
    def source(self) -> str:
        return f"{self.repo}/{self.path}@{self.commit[:10]}"

    def request(self):
        """The ``planner suggest`` request the recipe answers."""
        from planner.planning import SuggestRequest

        return SuggestRequest(model=self.model, gpu=self.gpu, gpus=self.gpus, target_batch=self.target_batch,
                              seq_len=self.seq_len, method=self.method, packing=self.packing, fused_ce=self.fused_ce)

    def options(self) -> dict[str, Any]:
        """The recipe's own configuration as ``planner estimate`` options."""
        opts: dict[str, Any] = {"method": self.method, "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                                "gpus": self.gpus, "precision": self.precision, "optimizer": self.optimizer,
                                "grad_ckpt": self.grad_ckpt, "packing": self.packing, "fused_ce": self.fused_ce}
        if self.method != "full":
            opts |= {"lora_r": self.lora_r, "lora_targets": self.lora_targets}
        if self.zero:
            opts["zero"] = self.zero
        return opts


def _unsloth(name: str, notebook: str, model: str, gpu: str, *, r: int, seq_len: int = 2048, grad_ckpt: bool = True,
             packing: bool = False, guessed: str = "", gpu_said: str = "Tesla T4") -> Recipe:
    return Recipe(name=name, repo=UNSLOTH[0], path=f"nb/{notebook}.ipynb", commit=UNSLOTH[1],
                  quote=f'run on a {gpu_said}; per_device_train_batch_size = 2, gradient_accumulation_steps = 4, '
                        f'max_seq_length = {4096 if "TinyLlama" in notebook else seq_len}, load_in_4bit = True, r = {r}, optim = "adamw_8bit"',
                  model=model, gpu=gpu, method="qlora", micro_batch=2, grad_accum=4, seq_len=seq_len,
                  optimizer="adamw_8bit", lora_r=r, lora_targets=_ALL_BLOCK_LINEARS, grad_ckpt=grad_ckpt,
                  packing=packing, guessed=guessed, not_modelled=_UNSLOTH_NOT_MODELLED)


#: torchtune README "Memory and training speed" (Llama 3.1 8B on 1x 4090 / 1x A6000) and its configs:
#: batch_size 2, dtype bf16, enable_activation_checkpointing True, packed False,
#: LinearCrossEntropyLoss (the chunked linear + CE: planned as --fused-ce), max_seq_len null on
#: alpaca (sequences padded to the longest of a batch: planned at 2048, guessed).
_TT_NOT_MODELLED = ("optimizer_in_bwd (gradients freed layer by layer), LinearCrossEntropyLoss (the planner models "
                    "a fused CE only with LoRA/QLoRA: planned with the standard loss), torchtune's own modules")


def _torchtune_8b(name: str, config: str, method: str, gpu: str, *, gpu_said: str) -> Recipe:
    full = method == "full"
    return Recipe(name=name, repo=TORCHTUNE[0], path=f"recipes/configs/llama3_1/{config}.yaml", commit=TORCHTUNE[1],
                  quote=f"README: Llama 3.1 8B | {method} | 1x {gpu_said}; config: batch_size: 2, "
                        f"gradient_accumulation_steps: {1 if full else 8}, dtype: bf16"
                        + ("" if full else ", lora_rank: 8, lora_attn_modules [q_proj, v_proj, output_proj], apply_lora_to_mlp"),
                  model="meta-llama/Llama-3.1-8B", gpu=gpu, method=method, micro_batch=2, grad_accum=1 if full else 8,
                  seq_len=2048, precision="bf16" if full else None,
                  optimizer="paged_adamw_8bit" if full else "adamw", lora_r=None if full else 8,
                  lora_targets=None if full else ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                  fused_ce=not full, guessed="seq_len 2048 (max_seq_len null, alpaca padded per batch)",
                  not_modelled=_TT_NOT_MODELLED if full else "torchtune's own modules")


RECIPES: tuple[Recipe, ...] = (
    _unsloth("Unsloth Llama 3.1 8B Alpaca", "Llama3.1_(8B)-Alpaca", "meta-llama/Llama-3.1-8B", "t4", r=16),
    _unsloth("Unsloth Llama 3 8B Alpaca", "Llama3_(8B)-Alpaca", "meta-llama/Meta-Llama-3-8B", "t4", r=16),
    _unsloth("Unsloth Llama 3.2 3B Conversational", "Llama3.2_(1B_and_3B)-Conversational", "meta-llama/Llama-3.2-3B",
             "t4", r=16, guessed="the base model for -Instruct (same architecture)"),
    _unsloth("Unsloth Llama 3.3 70B (A100)", "Llama3.3_(70B)_A100-Conversational", "meta-llama/Llama-3.3-70B-Instruct",
             "a100-80gb", r=16, gpu_said="A100 (its output: NVIDIA A100-SXM4-80GB)"),
    _unsloth("Unsloth Mistral v0.3 7B Alpaca", "Mistral_v0.3_(7B)-Alpaca", "mistralai/Mistral-7B-v0.1", "t4", r=16,
             guessed="Mistral-7B-v0.1 for v0.3 (v0.3's vocabulary is 32,768, not 32,000)"),
    _unsloth("Unsloth Mistral Nemo 12B Alpaca", "Mistral_Nemo_(12B)-Alpaca", "yuyouyu/Mistral-Nemo-BD-RP", "t4", r=16,
             guessed="a Mistral-Nemo fine-tune's config for Mistral-Nemo-Base-2407 (same architecture)"),
    _unsloth("Unsloth Phi-3.5 mini Conversational", "Phi_3.5_Mini-Conversational", "microsoft/Phi-3.5-mini-instruct",
             "t4", r=16),
    _unsloth("Unsloth Phi-4 Conversational", "Phi_4-Conversational", "microsoft/phi-4", "t4", r=16),
    _unsloth("Unsloth Qwen2.5 7B Alpaca", "Qwen2.5_(7B)-Alpaca", "Qwen/Qwen2.5-7B", "t4", r=16),
    _unsloth("Unsloth Qwen3 14B", "Qwen3_(14B)", "Qwen/Qwen3-14B", "t4", r=32),
    _unsloth("Unsloth Qwen3 4B Instruct", "Qwen3_(4B)-Instruct", "Qwen/Qwen3-4B", "t4", r=32,
             guessed="Qwen3-4B's config for Qwen3-4B-Instruct-2507 (same architecture)"),
    _unsloth("Unsloth Qwen3 32B (A100)", "Qwen3_(32B)_A100-Reasoning-Conversational", "Qwen/Qwen3-32B", "a100-40gb",
             r=32, gpu_said="A100 (its output: NVIDIA A100-SXM4-40GB)"),
    _unsloth("Unsloth Gemma 3 4B", "Gemma3_(4B)", "google/gemma-3-4b-it", "t4", r=8,
             guessed="targets: finetune_language_layers/attention/mlp = every linear of the text blocks"),
    _unsloth("Unsloth Gemma 3 27B (A100)", "Gemma3_(27B)_A100-Conversational", "google/gemma-3-27b-it", "a100-40gb",
             r=8, gpu_said="A100 (its output: NVIDIA A100-SXM4-40GB)",
             guessed="targets: finetune_language_layers/attention/mlp = every linear of the text blocks"),
    _unsloth("Unsloth Gemma 2 9B Alpaca", "Gemma2_(9B)-Alpaca", "google/gemma-2-9b", "t4", r=16),
    _unsloth("Unsloth TinyLlama 1.1B Alpaca", "TinyLlama_(1.1B)-Alpaca", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "t4",
             r=32, seq_len=2048, grad_ckpt=False, packing=True,
             guessed="the chat model's config for tinyllama-bnb-4bit (same architecture); seq 2048, the model's "
                     "maximum (the notebook's max_seq_length = 4096 relies on RoPE scaling)"),
    _torchtune_8b("torchtune Llama 3.1 8B full (4090)", "8B_full_single_device", "full", "rtx4090", gpu_said="4090"),
    _torchtune_8b("torchtune Llama 3.1 8B full (A6000)", "8B_full_single_device", "full", "rtx-a6000", gpu_said="A6000"),
    _torchtune_8b("torchtune Llama 3.1 8B LoRA (4090)", "8B_lora_single_device", "lora", "rtx4090", gpu_said="4090"),
    _torchtune_8b("torchtune Llama 3.1 8B LoRA (A6000)", "8B_lora_single_device", "lora", "rtx-a6000", gpu_said="A6000"),
    _torchtune_8b("torchtune Llama 3.1 8B QLoRA (4090)", "8B_qlora_single_device", "qlora", "rtx4090", gpu_said="4090"),
    Recipe(name="torchtune Llama 3.2 3B full (A100)", repo=TORCHTUNE[0], path="README.md", commit=TORCHTUNE[1],
           quote="Baseline uses Recipe=full_finetune_single_device, Model=Llama 3.2 3B, Batch size=2, "
                 "Max sequence length=4096, Precision=bf16, Hardware=A100",
           model="meta-llama/Llama-3.2-3B", gpu="a100-80gb", method="full", micro_batch=2, grad_accum=1,
           seq_len=4096, precision="bf16", optimizer="adamw", grad_ckpt=False,
           guessed="A100 80GB; the baseline row's AdamW without activation checkpointing"),
    Recipe(name="torchtune Llama 3.1 70B LoRA (8x A100)", repo=TORCHTUNE[0], path="recipes/configs/llama3_1/70B_lora.yaml",
           commit=TORCHTUNE[1],
           quote="README: Llama 3.1 70B | LoRA | 8x A100; config: batch_size: 2, gradient_accumulation_steps: 1, "
                 "lora_rank: 16, dtype: bf16, enable_activation_checkpointing: True",
           model="meta-llama/Llama-3.1-70B", gpu="a100-80gb", gpus=8, method="lora", micro_batch=2, grad_accum=1,
           seq_len=2048, precision="bf16-mixed", optimizer="adamw", lora_r=16,
           lora_targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), zero=3,
           guessed="A100 80GB; FSDP full shard planned as ZeRO-3; seq_len 2048",
           not_modelled="FSDP2 (planned as ZeRO-3); LinearCrossEntropyLoss (no fused CE under ZeRO-3: standard loss)"),
)


@dataclasses.dataclass(frozen=True)
class Row:
    recipe: Recipe
    recipe_peak: int
    recipe_fits: bool
    recipe_risk: float
    recipe_speed: float
    top: Any
    """The planner's #1 (a ``Candidate``), None when nothing fits."""
    top_risk: float | None
    error: str = ""

    @property
    def verdict(self) -> str:
        from planner.uncertainty import NEAR_EDGE_PROBABILITY

        if self.top is None:
            return f"no plan: {self.error}"
        if self.top_risk is not None and self.top_risk > NEAR_EDGE_PROBABILITY:
            return f"#1 near the edge ({self.top_risk:.0%} > {NEAR_EDGE_PROBABILITY:.0%}): no safe plan exists"
        speed = self.top.throughput.tokens_per_s
        if speed >= self.recipe_speed * 0.995:
            return "ok" if speed < self.recipe_speed * 1.02 else f"ok, {speed / self.recipe_speed:.2f}x"
        if not self.recipe_fits or self.recipe_risk > NEAR_EDGE_PROBABILITY:
            return (f"ok: slower ({speed / self.recipe_speed:.2f}x) but the recipe's own configuration is "
                    f"{'predicted not to fit' if not self.recipe_fits else f'near the edge ({self.recipe_risk:.0%})'}")
        return f"SLOWER: {speed / self.recipe_speed:.2f}x the recipe's configuration"


def evaluate(recipe: Recipe) -> Row:
    """The recipe's own configuration as ``planner estimate`` sees it, and the planner's #1."""
    from planner.errors import NothingFitsError
    from planner.estimation import estimate_configuration, resolve
    from planner.planning import make_plan
    from planner.tradeoffs import oom_risk

    spec, gpu = resolve(model=recipe.model, gpu=recipe.gpu)
    d, memory = estimate_configuration(spec=spec, gpu=gpu, seq_len=recipe.seq_len, **recipe.options())
    from planner.estimation import build_config

    config = build_config(spec, gpu, seq_len=recipe.seq_len, **recipe.options())
    risk = oom_risk(config, memory, capacity=gpu.memory_bytes)
    try:
        top = make_plan(recipe.request()).result.plans[0]
    except NothingFitsError as exc:
        return Row(recipe, memory.process_total_bytes, d["fits"], risk, d["throughput"]["tokens_per_s"], None, None,
                   str(exc).splitlines()[0])
    return Row(recipe, memory.process_total_bytes, d["fits"], risk, d["throughput"]["tokens_per_s"], top,
               top.memory.oom_probability)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def render(rows: list[Row]) -> str:
    from planner.uncertainty import NEAR_EDGE_PROBABILITY

    ok = sum(r.verdict.startswith("ok") for r in rows)
    lines = [
        "# Published recipes against the planner's #1",
        "",
        "Generated by `python bench/recipes.py` (issue 20, item 6). Each recipe states its GPU; the request is",
        "what it answers (model, GPU x count, global batch, seq len, method, packing, fused CE); the recipe's own",
        "configuration is estimated with `planner estimate`'s code. Speed is the planner's throughput model for",
        f"both. Verdict `ok`: #1 fits with oom_probability <= {NEAR_EDGE_PROBABILITY:.0%} and is at least as fast.",
        "",
        f"**{ok} of {len(rows)} rows ok.**",
        "",
        "| # | recipe | source | request | recipe config | recipe peak GiB / fits / OOM risk / tok/s | planner #1 | #1 peak GiB / OOM risk / tok/s | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        rc = r.recipe
        req = (f"{rc.model} on {rc.gpus}x {rc.gpu}, batch {rc.target_batch}, seq {rc.seq_len}, {rc.method}"
               + (", packing" if rc.packing else "") + (", fused CE" if rc.fused_ce else ""))
        cfg = (f"{rc.precision or 'mixed'} {rc.optimizer} mb{rc.micro_batch}x{rc.grad_accum}"
               + (f" r{rc.lora_r} {','.join(rc.lora_targets or ())}" if rc.method != "full" else "")
               + (" ckpt" if rc.grad_ckpt else "") + (f" zero{rc.zero}" if rc.zero else ""))
        mine = f"{_gib(r.recipe_peak)} / {'yes' if r.recipe_fits else 'no'} / {r.recipe_risk:.0%} / {r.recipe_speed:,.0f}"
        if r.top is None:
            top, topn = "-", "-"
        else:
            top = r.top.config.label()
            topn = f"{_gib(r.top.memory.process_total_bytes)} / {r.top_risk:.0%} / {r.top.throughput.tokens_per_s:,.0f}"
        src = f"[{rc.repo}/{rc.path}](https://github.com/{rc.repo}/blob/{rc.commit}/{rc.path.replace('(', '%28').replace(')', '%29')})"
        lines.append(f"| {i} | {rc.name} | {src} | {req} | {cfg} | {mine} | {top} | {topn} | {r.verdict} |")
    lines += ["", "## What each row states, assumes and leaves out", ""]
    for i, r in enumerate(rows, 1):
        rc = r.recipe
        lines.append(f"{i}. **{rc.name}** ({rc.source}): \"{rc.quote}\"."
                     + (f" Assumed: {rc.guessed}." if rc.guessed else "")
                     + (f" Not modelled: {rc.not_modelled}." if rc.not_modelled else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    rows = [evaluate(r) for r in RECIPES]
    text = render(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if not args.quiet:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
