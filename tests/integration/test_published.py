"""bench/published.py: the published-measurement data file and the row -> TrainConfig mapping.

The data checks hold the collection to its rules (issue 10 item 3): every row sourced and quoted,
every measured number verbatim in its quote, each unstated setting named in ``guessed``, and the
minimum coverage. The mapping checks compare a few rows with configurations derived by hand from
their sources."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from planner.catalog import resolve_model
from planner.errors import PlannerError

BENCH = Path(__file__).resolve().parents[2] / "bench" / "published.py"
_spec = importlib.util.spec_from_file_location("bench_published", BENCH)
published = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(published)

DATA = published.load()
ROWS = {row["id"]: row for row in DATA["rows"]}
#: settings a row must state (or guess) for the planner to be asked at all
REQUIRED_SETTINGS = ("model", "model_id", "gpu", "gpu_id", "method", "precision", "optimizer", "micro_batch", "seq_len")
#: fields that may be guessed without being a setting
GUESSABLE_EXTRA = {"metric", "unit", "gpu"}


def test_row_ids_are_unique():
    assert len(ROWS) == len(DATA["rows"])


@pytest.mark.parametrize("row", DATA["rows"], ids=lambda r: r["id"])
def test_row_is_sourced_quoted_and_complete(row):
    assert row["source"] in DATA["sources"]
    assert row["quote"].strip()
    assert row["metric"] in published.METRICS
    assert row["unit"] in published.UNITS
    settings = row["settings"]
    for key in REQUIRED_SETTINGS:
        assert key in settings, f"{row['id']} lacks {key}"
    assert settings["method"] in ("full", "lora", "qlora")
    if settings["method"] != "full":
        assert settings.get("lora_r") and settings.get("lora_targets"), row["id"]
    assert set(row["guessed"]) <= set(settings) | GUESSABLE_EXTRA, row["id"]
    assert set(row["terms"]) <= set(DATA["terms"]), row["id"]


@pytest.mark.parametrize("row", DATA["rows"], ids=lambda r: r["id"])
def test_every_measured_number_is_in_its_quote(row):
    assert isinstance(row["value"], str) and row["value"] in row["quote"]
    assert float(row["value"]) > 0
    if row.get("throughput"):
        assert row["throughput"]["value"] in row["quote"]
        assert row["throughput"]["unit"] in ("samples/s", "tokens/s")


def test_every_source_names_where_it_is():
    for key, src in DATA["sources"].items():
        assert src["url"].startswith("https://"), key
        assert src["repo"] and src["path"], key
        assert src["how"], key
    for term in DATA["terms"].values():
        assert term["what"] and term["source"] and term["effect"] in ("under", "over", "either", "none", "unscored")


def test_coverage_meets_the_minimums():
    rows = DATA["rows"]
    assert len(rows) >= 40
    assert len({row["source"] for row in rows}) >= 5
    assert {row["settings"]["method"] for row in rows} == {"full", "lora", "qlora"}
    architectures = set()
    for row in rows:
        try:
            architectures.add(resolve_model(row["settings"]["model_id"]).model_type)
        except PlannerError:
            pass
    assert len(architectures) >= 4, architectures
    # every method is covered on models the planner resolves, not only in the data
    scored = [r for r in published.score_all(DATA) if r["status"] == "scored"]
    assert len(scored) >= 40
    assert {r["config"].method.value for r in scored} == {"full", "lora", "qlora"}


def test_units_convert_as_the_sources_print_them():
    # pynvml: info.used//1024**2 printed as "MB"; litgpt: max_memory_allocated() / 1e9 as "GB"
    assert published.measured_bytes(ROWS["hf-vanilla-bs4"]) == 14949 * 2**20
    assert published.measured_bytes(ROWS["litgpt-llama-2-7b-qlora"]) == 13_680_000_000
    assert published.measured_bytes(ROWS["torchtune-llama2-7b-qlora-tutorial"]) == round(9.29 * 2**30)


def test_hf_fp16_checkpointing_row_maps_to_its_trainer_arguments():
    # per_device_train_batch_size=1, gradient_accumulation_steps=4, gradient_checkpointing=True,
    # fp16=True; bert-large-uncased, 512-token sequences, Tesla V100 16GB; the 2022 Trainer's default AdamW,
    # transformers' own (optim="adamw_hf")
    spec, gpu, config, _ = published.map_row(ROWS["hf-accum4-ckpt-fp16"])
    assert spec.id == "bert-large-uncased" and gpu.name == "v100-16gb"
    assert (config.method.value, config.precision.value, config.optimizer.value) == ("full", "fp16-mixed", "adamw_hf")
    assert (config.micro_batch, config.grad_accum, config.seq_len, config.grad_ckpt) == (1, 4, 512, True)
    assert config.attention.value == "eager" and config.zero == 0
    assert published.METRICS[ROWS["hf-accum4-ckpt-fp16"]["metric"]] == "process_total_bytes"


def test_litgpt_qlora_row_maps_to_its_config_file():
    # llama-2-7b/qlora.yaml: bf16-true + bnb.nf4, lora_r 32 on query and value, micro_batch_size 2,
    # global_batch_size 8 (so 4 accumulation steps), max_seq_length 512
    spec, gpu, config, unmodelled = published.map_row(ROWS["litgpt-llama-2-7b-qlora"])
    assert spec.id == "meta-llama/Llama-2-7b-hf" and gpu.name == "a10g"
    assert (config.method.value, config.precision.value) == ("qlora", "bf16")
    assert (config.lora_r, config.lora_targets) == (32, ("q_proj", "v_proj"))
    assert (config.micro_batch, config.grad_accum, config.seq_len, config.grad_ckpt) == (2, 4, 512, False)
    assert published.METRICS[ROWS["litgpt-llama-2-7b-qlora"]["metric"]] == "peak_allocated_bytes"
    # Fabric's BitsandbytesPrecision keeps every non-4-bit tensor in bf16: no k-bit upcast, on every litgpt QLoRA row
    litgpt_qlora = [row for row in DATA["rows"] if row["settings"].get("framework") == "litgpt"
                    and row["settings"]["method"] == "qlora"]
    assert not config.kbit_upcast and all(row["settings"]["kbit_upcast"] is False for row in litgpt_qlora)
    # a setting without a TrainConfig field is reported, not dropped
    fields = published.config_fields()
    assert ("lora_dropout" in unmodelled) == ("lora_dropout" not in fields)


def test_deepspeed_offload_row_maps_to_zero3_with_parameter_offload():
    _, _, config, _ = published.map_row(ROWS["peft-bloomz-7b1-lora-zero3-offload"])
    assert (config.zero, config.offload.value, config.gpus) == (3, "optimizer+params", 1)
    assert (config.method.value, config.lora_targets, config.seq_len) == ("lora", ("query_key_value",), 64)


def test_a_model_outside_the_catalog_is_read_from_its_config_under_bench():
    """gpjt's Qwen1.5-0.5B is in neither the catalog nor the local cache: the rows name its
    config.json under bench/ (model_config), whose shape is the model card's 463,987,712 parameters;
    the run is ZeRO-3 in DeepSpeed's fp16 mode with the allocator setting its file names."""
    row = ROWS["gpjt-qwen1.5-0.5b-zero3-seq2048-es-reserved"]
    spec, _, config, unmodelled = published.map_row(row)
    assert spec.params_total == 463_987_712
    assert (config.zero, config.precision.value, config.alloc_conf) == (3, "fp16-mixed", "expandable_segments:True")
    # the run read its own ds_config, which sets no bucket key and builds AdamW itself (FusedAdam):
    # DeepSpeed's defaults, carried by the sharding (planner/sharding/zero.py zero_buckets)
    assert not unmodelled
    assert config.sharding.buffers == (("torch_adam", 0),)
    assert published.map_row(ROWS["peft-bloomz-7b1-lora-zero3-offload"])[2].sharding.buffers == ()
    assert not published.map_row(ROWS["gpjt-qwen1.5-0.5b-zero3-seq2048-default-reserved"])[2].alloc_conf


def test_score_is_the_signed_relative_error_on_the_measured_metric():
    from planner.memory import estimate_memory

    row = ROWS["litgpt-mistral-7b-lora"]
    result = published.score_row(row)
    spec, gpu, config, _ = published.map_row(row)
    predicted = estimate_memory(model=spec, config=config, gpu=gpu).peak_allocated_bytes
    assert result["predicted"] == predicted
    assert math.isclose(result["error"], (predicted - 20_660_000_000) / 20_660_000_000)


def test_throughput_is_scored_where_published():
    result = published.score_row(ROWS["hf-vanilla-bs4"])
    assert math.isclose(result["tokens_measured"], 8.86 * 512)  # samples/s x 512-token sequences
    assert result["tokens_predicted"] > 0 and "tokens_error" in result
    assert "tokens_error" not in published.score_row(ROWS["litgpt-llama-2-7b-lora"])


def test_unresolvable_models_are_reported_not_dropped(tmp_path):
    result = published.score_row(ROWS["litgpt-stablelm-base-alpha-3b-lora"])
    assert result["status"] == "unscorable" and "stablelm" in result["reason"]
    out = tmp_path / "report.md"
    assert published.main(["--out", str(out), "--quiet"]) == 0
    text = out.read_text()
    for row_id in ROWS:
        assert f"| {row_id} |" in text
    assert "unscorable" in text and "median abs error" in text and "## Throughput" in text


def test_fms_qlora_row_maps_to_its_scenario_files():
    # scenarios.yaml baseline-peft-bnb: fp16 True, torch_dtype float16, r 16 on q,k,v,o (CSV: lora_dropout 0.0);
    # defaults.yaml: use_flash_attn, gradient_checkpointing, gradient_accumulation_steps 1; the CSV's
    # train_tokens_per_second / train_samples_per_second = 2748.9 / 0.671 = 4097 tokens per sequence
    row = ROWS["fms-mistral-qlora-bs4-alloc"]
    spec, gpu, config, _ = published.map_row(row)
    assert spec.id == "mistralai/Mistral-7B-v0.1" and gpu.name == "a100-80gb"
    assert (config.method.value, config.precision.value, config.attention.value) == ("qlora", "fp16-mixed", "flash")
    assert (config.lora_r, config.lora_targets) == (16, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert (config.micro_batch, config.grad_accum, config.seq_len, config.grad_ckpt) == (4, 1, 4096, True)
    assert published.measured_bytes(row) == 22_825_932_800
    assert published.measured_bytes(ROWS["fms-mistral-qlora-bs4-nvidia"]) == 27023 * 2**20


def test_batch_pairs_split_per_sequence_and_fixed_bytes():
    results = published.score_all(DATA)
    pairs = {p["rows"]: p for p in published.batch_pairs(results, DATA)}
    lora = pairs[("fms-mistral-lora-bs4-alloc", "fms-mistral-lora-bs8-alloc")]
    # (37098695168 - 26108963328) / (8 - 4) bytes per extra sequence, by hand
    assert lora["slope_measured"] == (37_098_695_168 - 26_108_963_328) / 4
    assert lora["intercept_measured"] == 26_108_963_328 - 4 * lora["slope_measured"]
    by_id = {r["id"]: r for r in results}
    assert lora["slope_predicted"] == (by_id["fms-mistral-lora-bs8-alloc"]["predicted"]
                                      - by_id["fms-mistral-lora-bs4-alloc"]["predicted"]) / 4
    # rows that differ in more than the micro-batch are never paired
    assert all(a.split("-bs")[0] == b.split("-bs")[0] for a, b in pairs)


def test_a_source_that_measures_its_context_plans_its_rows_with_it():
    # perf_train_gpu_one: torch.ones((1, 1)).to("cuda") -> "GPU memory occupied: 1343 MB." (CUDA 11.2, eager
    # module loading); the context is outside the caching allocator, so on an nvml row the prediction moves by
    # exactly (1343 - 512) MiB against the planner's lazy-loading constant, and not at all on an allocator row
    import dataclasses

    from planner.memory import estimate_memory

    row = ROWS["hf-vanilla-bs4"]
    result = published.score_row(row, DATA["sources"])
    spec, gpu, config, _ = published.map_row(row)
    assert gpu.cuda_context_bytes == 512 * 2**20 and result["context_bytes"] == 1343 * 2**20
    default = estimate_memory(model=spec, config=config, gpu=gpu).process_total_bytes
    stated = estimate_memory(model=spec, config=config, gpu=dataclasses.replace(gpu, cuda_context_bytes=1343 * 2**20))
    assert result["predicted"] == stated.process_total_bytes == default + (1343 - 512) * 2**20
    # a source without a measured context keeps the device's own
    assert published.score_row(ROWS["fms-mistral-lora-bs4-nvidia"], DATA["sources"])["context_bytes"] == 512 * 2**20


def test_the_checkpointed_block_backward_is_the_models_own_moment():
    from planner.memory import estimate_memory

    # no checkpointing, no such moment
    spec, gpu, config, _ = published.map_row(ROWS["hf-vanilla-bs4"])
    assert published.block_moment(spec, config, gpu) is None
    # Mistral QLoRA, fp32 residual stream (prepare_model_for_kbit_training): the moment is the predicted peak
    # (at batch 8: at batch 4 transformers 4.45's loss, the rows' loss_shift, peaks at the end of its forward)
    spec, gpu, config, _ = published.map_row(ROWS["fms-mistral-qlora-bs8-alloc"])
    moment, others = published.block_moment(spec, config, gpu)
    est = estimate_memory(model=spec, config=config, gpu=gpu)
    assert moment > others and est.peak_phase == "first_block_backward" and est.peak_allocated_bytes == moment
    # pure-fp16 LoRA of the same file: below the other moments
    spec, gpu, config, _ = published.map_row(ROWS["fms-mistral-lora-bs4-alloc"])
    moment, others = published.block_moment(spec, config, gpu)
    assert moment < others


def test_every_fully_stated_row_that_misses_the_target_says_why():
    results = published.score_all(DATA)
    for r in published.groups(results)["fully stated"]:
        if r["error"] < published.TARGET_UNDER:
            assert len(ROWS[r["id"]].get("note", "")) > 80, r["id"]
    text = "\n".join(published._miss_lines(results))
    assert "no reason written" not in text


def test_every_row_outside_five_percent_or_unscorable_says_why():
    """Issue 10's Done-when: the report 'says row by row why a row cannot be met'. A row within
    +-5% needs no note; one outside it (or one the planner cannot score) must carry one, and the
    report's table lists exactly those rows."""
    results = published.score_all(DATA)
    flagged = [r for r in results if published.needs_note(r)]
    assert flagged and len(flagged) < len(results)
    for r in flagged:
        assert len(ROWS[r["id"]].get("note", "")) > 80, r["id"]
    table = published._note_lines(results)
    assert len(table) == 2 + len(flagged)
    assert "no reason written" not in "\n".join(table)


def test_needs_note_is_the_five_percent_band():
    assert published.needs_note({"status": "unscorable"})
    assert published.needs_note({"status": "scored", "error": -0.051})
    assert published.needs_note({"status": "scored", "error": 0.06})
    assert not published.needs_note({"status": "scored", "error": 0.049})


def test_torchtune_rows_map_to_the_loss_and_loop_torchtune_runs():
    """torchtune's CEWithChunkedOutputLoss materialises the logits (8 chunks, each upcast alone:
    torchtune/modules/loss/ce_chunked_output_loss.py), so it is not the planner's --fused-ce (a
    fused linear cross-entropy that never materialises them); the recipes ``del logits`` before
    ``loss.backward()`` ('free logits otherwise it peaks backward memory'), which is the
    trainer loop's logits lifetime, not the manual loop's."""
    from planner.config import Loop

    rows = [row for row in DATA["rows"] if row["settings"].get("framework") == "torchtune"]
    assert len(rows) == 7
    for row in rows:
        spec, gpu, config, unmodelled = published.map_row(row)
        assert config.fused_ce is False and config.loop is Loop.TRAINER, row["id"]
        if row["source"] == "torchtune-readme":
            assert "loss" in unmodelled and "chunked_ce" in row["terms"], row["id"]


def test_no_run_of_stated_settings_is_called_does_not_fit():
    """Every row is a run that ran: none whose settings are all stated may be refused (issue 25
    item 4). Mistral-7B full fine-tuning at batch 4 on an A100-80GB (fms-acceleration, 75.9 GiB on
    nvidia-smi) was, at 78.4 GiB of process total, before the replay placed each tensor at its size."""
    stated = [published.score_row(row, DATA["sources"]) for row in DATA["rows"] if not row.get("guessed")]
    stated = [r for r in stated if r["status"] == "scored"]
    assert stated and [r["id"] for r in stated if not r["fits"]] == []
    assert ROWS["fms-mistral-full-bs4-nvidia"]["id"] in {r["id"] for r in stated}


def test_a_refusal_is_laid_on_what_makes_the_plan_too_large():
    """refused_by, by hand: an allocated peak (with the context) past the usable memory; else one
    predicted more than 5% over a measured max_memory_allocated (or over a measured reserve);
    else the reserve."""
    GiB = 2**30
    row = {"states_over": False, "metric": "max_memory_allocated", "measured": 20 * GiB}
    assert published.refused_by({**row, "states_over": True, "predicted_allocated": 30 * GiB}) == "the allocated peak"
    assert published.refused_by({**row, "predicted_allocated": 21 * GiB}) == "the reserve"  # +5.0%: within
    assert published.refused_by({**row, "predicted_allocated": 21 * GiB + 1}).endswith("over-prediction")
    reserved = {**row, "metric": "max_memory_reserved"}
    assert published.refused_by({**reserved, "predicted_allocated": 20 * GiB + 1}).endswith("over-prediction")
    assert published.refused_by({**reserved, "predicted_allocated": 19 * GiB}) == "the reserve"


def test_a_row_that_cannot_be_its_stated_run_is_not_a_plan_that_ran():
    """A term marked not_the_run is one a hand check proves: litgpt's phi-3 full row (bf16-true,
    AdamW, devices 1: bf16 weights, gradients and two bf16 moments, 8 bytes a parameter) measured
    less than those states alone. It stays scored and visible, and is not counted by ``refused``."""
    row = ROWS["litgpt-phi-3-full"]
    spec = published.map_row(row)[0]
    assert published.measured_bytes(row) < 8 * spec.params_total
    marked = [k for k, t in DATA["terms"].items() if t.get("not_the_run")]
    assert marked == ["measured_below_states"]
    result = published.score_row(row, DATA["sources"])
    assert result["status"] == "scored" and not result["fits"]
    assert published.not_the_run(result, DATA["terms"])
    assert result not in published.refused([result], DATA["terms"])
    assert published.refused([{**result, "terms": []}], DATA["terms"]) != []


def test_the_recipes_own_terms_are_estimated_where_they_are_request_fields():
    """torchtune's rows state optimizer_in_bwd and an 8-piece chunked loss (8B_full_single_device.yaml,
    CEWithChunkedOutputLoss' default): both are request fields, so the rows' configs carry them and
    the scored prediction is the estimate's with them. The full 4090 row's allocated peak is at least its gradient set less the largest
    tensor's (8,030,261,248 - 525,336,576 bf16 elements) below the same plan without them, less
    the loss backward's two fp32 vocab-wide gradients of 4096 tokens."""
    from planner.memory import estimate_memory

    for row_id in ("torchtune-llama3.1-8b-lora-4090", "torchtune-llama3.1-8b-full-4090"):
        row = ROWS[row_id]
        spec, gpu, config, unmodelled = published.map_row(row)
        assert config.loss_chunks == 8 and "optimizer_in_bwd" not in unmodelled
        result = published.score_row(row, DATA["sources"])
        assert result["predicted"] == estimate_memory(model=spec, config=config, gpu=gpu).peak_reserved_bytes
    assert config.optimizer_in_bwd
    plain = config.replace(optimizer_in_bwd=False)
    drop = (estimate_memory(model=spec, config=plain, gpu=gpu).peak_allocated_bytes
            - estimate_memory(model=spec, config=config, gpu=gpu).peak_allocated_bytes)
    assert drop >= (8_030_261_248 - 525_336_576) * 2 - 7 * 2 * 512 * 128256 * 4


def test_litgpts_loss_is_estimated_in_bf16_pieces():
    """litgpt's rows state its loss as request fields (litgpt/finetune/lora.py: model(input_ids,
    lm_head_chunk_size=128), chunked_cross_entropy on the bf16 pieces): 4 pieces of 128 of the 512
    tokens, no upcast. phi-2 at 4 x 512 tokens is estimated below the same plan with transformers'
    fp32 loss by at most the bf16 half of its 2048 x 51200 fp32 log-probabilities and its loss
    backward's two fp32 gradients less two bf16 ones of a 4 x 128-token piece; the plan fits the
    A10G (issue 25: it ran)."""
    from planner.memory import estimate_memory

    row = ROWS["litgpt-phi-2-lora"]
    spec, gpu, config, unmodelled = published.map_row(row)
    assert (config.loss_chunks, config.loss_upcast) == (4, False) and not {"loss_chunks", "loss_upcast"} & set(unmodelled)
    upcast = config.replace(loss_chunks=1, loss_upcast=True)
    moved = (estimate_memory(model=spec, config=upcast, gpu=gpu).peak_allocated_bytes
             - estimate_memory(model=spec, config=config, gpu=gpu).peak_allocated_bytes)
    assert 0 < moved <= 2048 * 51200 * 2 + 2 * 2048 * 51200 * 4 - 2 * 512 * 51200 * 2
    assert published.score_row(row, DATA["sources"])["fits"]


def test_a_multi_gpu_row_is_one_ranks_peak():
    """fms-acceleration's 2-GPU rows are FSDP1 FULL_SHARD (accelerate.yaml) at 2 sequences a device, and
    each figure is one rank's (the Trainer's metrics of rank 0; nvidia-smi's per-device peak averaged
    over the devices, benchmark.py). The estimate is per device: Mistral-7B in pure fp16 keeps its
    weights, gradients and AdamW's two moments in fp16 (8 B a parameter), half on each rank; the
    nvidia-smi row adds, outside the allocator, the CUDA context and NCCL's buffers, by hand 24
    NVLink ring channels x (a 6 MiB send side, 4 KiB + Simple 4 MiB rounded up to 2 MiB, and a 6 MiB
    receive side, 4 KiB + LL 8*512*8*16 B + LL128 120*640*8*8 B rounded up to 2 MiB), and the device
    structures of the 32 channels NCCL sets up (24 raised to a power of two), 3 a channel and 1 for the
    communicator, a 2 MiB cuMem granule each. The throughput is one rank's tokens/s against the
    estimate over the GPUs."""
    from planner.memory import estimate_memory
    from planner.throughput import estimate_throughput

    row = ROWS["fms24-mistral-full-g2-bs2-nvidia"]
    spec, gpu, config, unmodelled = published.map_row(row)
    assert (config.gpus, config.sharding.scheme, config.micro_batch, config.seq_len) == (2, "fsdp1", 2, 4096)
    assert config.loss_shift and not unmodelled
    est = estimate_memory(model=spec, config=config, gpu=gpu)
    result = published.score_row(row, DATA["sources"])
    assert result["predicted"] == est.process_total_bytes
    nccl = 24 * (6 * 2**20 + 6 * 2**20) + (32 * 3 + 1) * 2 * 2**20  # 288 + 194 = 482 MiB
    assert est.process_total_bytes == est.peak_reserved_bytes + gpu.cuda_context_bytes + nccl
    alloc = published.score_row(ROWS["fms24-mistral-full-g2-bs2-alloc"], DATA["sources"])
    assert 8 * spec.params_total / 2 <= alloc["predicted"] < 8 * spec.params_total
    speed = estimate_throughput(model=spec, config=config, gpu=gpu, paged_host=est.paged_host_bytes)
    assert math.isclose(alloc["tokens_predicted"], speed.tokens_per_s / 2)
    assert math.isclose(alloc["tokens_measured"], 2698.11)
    # the report says it is a rank's
    assert "fsdp1 x2, per rank" in published._config_text(config)


def test_fms_2025_rows_run_transformers_448s_loss():
    """fms-acceleration's 2025 re-run pins transformers 4.48.1, whose model returns the head's 16-bit
    logits and whose ForCausalLMLoss upcasts them and copies the shifted positions (loss_returns_head):
    its 1-GPU LoRA and accelerated-peft-bnb max_memory_allocated rows, -3.9..-7.5% under 4.45's loss
    (loss_shift alone), are within 0.5%; each moves by the 16-bit logits (b x 4096 x 32,000 x 2 B)."""
    for row_id, batch in (("fms25-mistral-lora-g1-bs4-alloc", 4), ("fms25-mistral-lora-g1-bs8-alloc", 8),
                          ("fms25-mistral-qlora-accel-g1-bs4-alloc", 4), ("fms25-mistral-qlora-accel-g1-bs8-alloc", 8)):
        row = ROWS[row_id]
        _spec, _gpu, config, unmodelled = published.map_row(row)
        assert config.loss_shift and config.loss_returns_head and not unmodelled, row_id
        result = published.score_row(row, DATA["sources"])
        assert abs(result["error"]) <= 0.005, (row_id, result["error"])
        before = published.score_row({**row, "settings": {**row["settings"], "loss_returns_head": False}}, DATA["sources"])
        assert before["error"] < -0.035, (row_id, before["error"])
        assert abs(result["predicted"] - before["predicted"] - batch * 4096 * 32000 * 2) <= 0.02 * 2**30, row_id
    assert all(row["settings"].get("loss_returns_head") for row in DATA["rows"] if row["id"].startswith("fms25"))


#: the transformers release each source's runs had, where it is known (fms-acceleration's 2024 csv: its framework's
#: transformers<4.40 pin at 04702cc; its 2025 re-run: refs/requirements.txt 4.48.1; gpjt: requirements.txt 4.40.0)
SOURCE_TRANSFORMERS = {"fms-acceleration-a100": "4.39.3", "fms-acceleration-a100-2025": "4.48.1",
                       "gpjt-fine-tune-2024-04": "4.40.0"}


def test_rows_state_the_knobs_their_transformers_release_sets():
    """Each row of a source whose transformers release is known states exactly the knobs the version table gives
    that release and model (planner/transformers_versions.py), so the bench and ``--transformers`` agree."""
    from planner.transformers_versions import KNOBS, knobs_for

    checked = 0
    for row in DATA["rows"]:
        version = SOURCE_TRANSFORMERS.get(row["source"])
        if version is None:
            continue
        settings = row["settings"]
        spec = resolve_model(published.model_source(settings))
        knobs = knobs_for(version, spec.model_type, is_moe=spec.is_moe,
                          causal_lm=not (spec.is_encoder or spec.is_encoder_decoder),
                          encoder_decoder=spec.is_encoder_decoder)
        assert {k: bool(settings.get(k, False)) for k in KNOBS} == knobs, row["id"]
        checked += 1
    assert checked == 106
