"""RoPE context extension (``--rope-scaling``, ``planner.config.context_limit``): the context limit with and
without it, the refusal for a model whose positions are not rotary, the request field through every surface
(CLI, payload, API body, search), what emit's train.py sets on the model's config and what ``planner check``
reads of axolotl's and LLaMA-Factory's files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from support.cli import assert_user_error, write_config

from planner.catalog import resolve_model
from planner.config import TrainConfig, context_limit
from planner.errors import InvalidConfigError
from planner.estimation import build_config
from planner.gpus import get_gpu
from planner.memory import estimate_memory
from planner.throughput import estimate_throughput

LLAMA2 = "meta-llama/Llama-2-7b-hf"  # max_position_embeddings 4096, rotary positions


def test_the_limit_is_the_position_table_times_the_factor():
    spec = resolve_model(LLAMA2)
    assert spec.max_seq_len == 4096
    assert context_limit(spec) == context_limit(spec, TrainConfig()) == 4096
    assert context_limit(spec, {"rope_scaling": "2"}) == 8192  # 4096 x 2
    assert context_limit(spec, TrainConfig(rope_scaling="yarn:2.5")) == 10240  # 4096 x 2.5
    assert context_limit(spec, {"rope_scaling": "llama3:8"}) == 32768  # 4096 x 8


def test_estimate_takes_the_extended_context_and_no_more():
    spec, gpu = resolve_model(LLAMA2), get_gpu("a100-40gb")
    with pytest.raises(InvalidConfigError, match=r"allows \(4096\): use at most 4096, or extend its RoPE context: "
                                                 r"--rope-scaling 3$"):
        build_config(spec, gpu, seq_len=8193, method="qlora")  # ceil(8193 / 4096) = 3
    assert build_config(spec, gpu, seq_len=8192, method="qlora", rope_scaling="2").seq_len == 8192
    with pytest.raises(InvalidConfigError, match=r"allows \(8192\): use at most 8192$"):
        build_config(spec, gpu, seq_len=8193, method="qlora", rope_scaling="2")


@pytest.mark.parametrize(("model", "kind", "table"), [("gpt2", "learned", 1024), ("bert-base-uncased", "learned", 512),
                                                     ("t5-large", "relative", 512),
                                                     ("bigscience/bloom-7b1", "alibi", 2048)])
def test_a_model_without_rotary_positions_refuses_the_scaling(model, kind, table):
    spec = resolve_model(model)
    line = f"--rope-scaling rescales rotary position embeddings; {model} has {kind} positions: drop --rope-scaling " \
           f"(at most {table} tokens)"
    with pytest.raises(InvalidConfigError) as error:
        context_limit(spec, {"rope_scaling": "2"})
    assert str(error.value) == line
    assert context_limit(spec) == table  # without the knob: the table, as before


def test_the_scaling_costs_no_memory_and_no_time():
    """The scaling changes the rotary tables' values, not their shapes (planner.request's note): the same
    estimate at the same length with and without it."""
    spec, gpu = resolve_model(LLAMA2), get_gpu("a100-40gb")
    plain = TrainConfig(method="qlora", seq_len=4096, grad_ckpt=True, attention="flash")
    scaled = plain.replace(rope_scaling="yarn:4")
    a, b = estimate_memory(model=spec, config=plain, gpu=gpu), estimate_memory(model=spec, config=scaled, gpu=gpu)
    assert dict(a.breakdown) == dict(b.breakdown) and a.process_total_bytes == b.process_total_bytes
    assert estimate_throughput(model=spec, config=plain, gpu=gpu).tokens_per_s == \
        estimate_throughput(model=spec, config=scaled, gpu=gpu).tokens_per_s


@pytest.mark.parametrize(("given", "canonical", "label"), [("4", "linear:4", "rope linear x4"), (2, "linear:2", "rope linear x2"),
                                                            ("YaRN:2.5", "yarn:2.5", "rope yarn x2.5")])
def test_the_field_round_trips_through_the_payload(given, canonical, label):
    config = TrainConfig(rope_scaling=given)
    assert config.rope_scaling == canonical and config.label().endswith(label)
    payload = config.to_dict()
    assert payload["rope_scaling"] == canonical and payload["version"] == 3  # a version-2 reader would drop it
    assert TrainConfig.from_dict(json.loads(json.dumps(payload))) == config
    assert "rope_scaling" not in TrainConfig().to_dict()  # off: a payload keeps its bytes


@pytest.mark.parametrize("value", ["1", "0.5", "x", "longrope:4", "yarn:", "2049", True])
def test_a_bad_value_is_one_line_with_the_spelling(value):
    with pytest.raises(InvalidConfigError, match=r"^--rope-scaling takes FACTOR or TYPE:FACTOR, TYPE one of "
                                                 r"linear\|dynamic\|yarn\|llama3 and FACTOR a number above 1"):
        TrainConfig(rope_scaling=value)


def test_estimate_and_suggest_take_the_flag(cli):
    base = ("-m", LLAMA2, "-g", "a100-40gb")
    assert_user_error(cli("estimate", *base, "--method", "qlora", "--seq-len", "8192"),
                      "error: --seq-len 8192 is longer than meta-llama/Llama-2-7b-hf allows (4096): use at most 4096, "
                      "or extend its RoPE context: --rope-scaling 2")
    result = cli("estimate", *base, "--method", "qlora", "--seq-len", "8192", "--rope-scaling", "2", "--grad-ckpt",
                 "--attention", "flash", "--json")
    assert result.code == 0, result
    assert json.loads(result.out)["config"]["rope_scaling"] == "linear:2"
    result = cli("suggest", *base, "-b", "4", "--seq-len", "8192", "--rope-scaling", "2", "--json", "--no-save")
    assert result.code == 0, result
    plans = json.loads(result.out)["plans"]
    assert plans and all(p["config"]["rope_scaling"] == "linear:2" and p["config"]["seq_len"] == 8192 for p in plans)
    assert_user_error(cli("suggest", *base, "-b", "4", "--seq-len", "8192", "--no-save"), "--rope-scaling 2")
    assert_user_error(cli("estimate", "-m", "gpt2", "-g", "t4", "--rope-scaling", "2"),
                      "error: --rope-scaling rescales rotary position embeddings; gpt2 has learned positions")


def test_the_longest_context_is_bounded_by_the_extended_limit():
    from planner.solve import longest_seq_len

    spec, gpu = resolve_model(LLAMA2), get_gpu("a100-80gb")
    config = TrainConfig(method="qlora", seq_len=1024, grad_ckpt=True, attention="flash")
    assert longest_seq_len(spec=spec, gpu=gpu, config=config).limit == 4096
    assert longest_seq_len(spec=spec, gpu=gpu, config=config.replace(rope_scaling="2")).limit == 8192


def test_the_api_body_takes_the_field():
    pytest.importorskip("fastapi")
    from planner.service.schemas import EstimateBody, PlanBody

    assert EstimateBody(model="gpt2", gpu="a10g", rope_scaling="yarn:4").rope_scaling == "yarn:4"
    assert PlanBody(model="gpt2", gpu="a10g", target_batch=8, rope_scaling="2").rope_scaling == "2"


# ---- emit -------------------------------------------------------------------------------------------
def _emitted_script(tmp_path, config: TrainConfig, model_dir):
    from planner.emit import settings
    from planner.emit.train_script import render_train_script

    path = tmp_path / "train.py"
    path.write_text(render_train_script(model=str(model_dir), plan_id="-", rank=1, label=config.label(),
                                        seq_len=config.seq_len, dtype="float32", dtype_why="", attention="sdpa",
                                        masked_lm=False, dataset=None, **settings.script_recipe(config)))
    spec = importlib.util.spec_from_file_location("emitted_rope_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("scaling", "rope", "context", "first_inv_freq"), [
    (None, None, 128, 1.0),
    ("2", {"rope_type": "linear", "factor": 2.0}, 256, 0.5),  # position interpolation: every frequency / 2
    ("yarn:4", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, 512, 1.0),
    ("dynamic:2", {"rope_type": "dynamic", "factor": 2.0}, 128, 1.0),  # dynamic NTK reads the original length there
])
def test_train_py_sets_the_scaling_on_the_model_config(tmp_path, scaling, rope, context, first_inv_freq):
    """The emitted train.py's config, built by the installed transformers: the rope parameters the plan says
    (the model's rope_theta kept), the context raised, and the rotary embedding built from it scaled."""
    folder = write_config(tmp_path / "model", rope_theta=500000.0)  # a tiny llama: 128 positions
    script = _emitted_script(tmp_path, TrainConfig(seq_len=128, rope_scaling=scaling), folder)
    if scaling is None:
        assert script.ROPE_SCALING is None
        return
    config = script.scaled_config(str(folder))
    assert config.rope_parameters == {"rope_theta": 500000.0, **rope}
    assert config.max_position_embeddings == context
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    assert float(LlamaRotaryEmbedding(config).inv_freq[0]) == pytest.approx(first_inv_freq)


# ---- planner check ----------------------------------------------------------------------------------
#: the trainers' own example files (tests/check/test_check_trainers.py reads them as they are)
EXAMPLES = Path(__file__).resolve().parents[1] / "data" / "check"


def _yaml(tmp_path, source: str, **changes) -> str:
    """The example ``source`` with ``changes``, written to ``tmp_path``."""
    import yaml

    data = {**yaml.safe_load((EXAMPLES / source).read_text()), **changes}
    path = tmp_path / source.split("/")[-1]
    path.write_text(yaml.safe_dump(data))
    return str(path)


LF = dict(model_name_or_path=LLAMA2, quantization_bit=4, flash_attn="fa2", lora_rank=8)


def test_check_reads_llama_factory_s_type_and_derives_its_factor(tmp_path):
    """LLaMA-Factory's factor is ceil(cutoff_len / max_position_embeddings) (model/model_utils/rope.py l.63):
    16384 / 4096 = 4; a cutoff_len within the model's positions disables the scaling (l.52-55)."""
    from planner.check import check
    from planner.check.trainers import trainer

    result = check([_yaml(tmp_path, "llama_factory/llama3_lora_sft.yaml", **LF, cutoff_len=16384, rope_scaling="linear")],
                   gpu="a100-80gb")
    assert result.config.rope_scaling == "linear:4" and result.config.seq_len == 16384
    assert result.origins["rope_scaling"]["key"] == "rope_scaling"
    assert trainer("llama-factory").write(result.config)["rope_scaling"] == "linear"  # the type: it derives the factor
    result = check([_yaml(tmp_path, "llama_factory/llama3_lora_sft.yaml", **LF, cutoff_len=4096, rope_scaling="yarn")],
                   gpu="a100-80gb")
    assert result.config.rope_scaling is None and any("disables the scaling" in n for n in result.notes)
    with pytest.raises(InvalidConfigError, match=r"allows \(4096\).*--rope-scaling 2 \[read from .*: cutoff_len\]"):
        check([_yaml(tmp_path, "llama_factory/llama3_lora_sft.yaml", **LF, cutoff_len=8192)], gpu="a100-80gb")


def test_check_reads_axolotl_s_model_config_rope_scaling(tmp_path):
    """axolotl sets model_config's keys on the model's config (loaders/utils.py l.201-203); Meta-Llama-3-8B has
    8192 positions, so factor 2 takes 16384 tokens; a top-level rope_scaling is axolotl's own refusal."""
    from planner.check import check
    from planner.check.trainers import trainer

    path = _yaml(tmp_path, "axolotl/llama3_qlora.yml", sequence_len=16384, micro_batch_size=1, flash_attention=True,
                 gradient_checkpointing=True, model_config={"rope_scaling": {"type": "linear", "factor": 2.0}})
    result = check([path], gpu="a100-80gb")
    assert result.config.rope_scaling == "linear:2" and result.config.seq_len == 16384
    assert result.origins["rope_scaling"]["key"] == "model_config.rope_scaling"
    assert trainer("axolotl").write(result.config)["model_config"] == {"rope_scaling": {"rope_type": "linear",
                                                                                        "factor": 2.0}}
    with pytest.raises(InvalidConfigError, match="axolotl refuses a top-level rope_scaling"):
        check([_yaml(tmp_path, "axolotl/llama3_qlora.yml", rope_scaling={"type": "linear", "factor": 2.0})],
              gpu="a100-80gb")


def test_the_emitted_plan_says_and_sets_the_scaling():
    from planner.catalog import fingerprint
    from planner.emit import plan_files
    from planner.results import Candidate, PlanRequest

    spec, gpu = resolve_model(LLAMA2), get_gpu("a100-80gb")
    config = TrainConfig(method="qlora", seq_len=8192, grad_ckpt=True, attention="flash", rope_scaling="2")
    candidate = Candidate(config=config, memory=estimate_memory(model=spec, config=config, gpu=gpu),
                          throughput=estimate_throughput(model=spec, config=config, gpu=gpu), fits=True, rank=1)
    request = PlanRequest(model_id=LLAMA2, model_fingerprint=fingerprint(spec), gpu="a100-80gb", gpu_count=1,
                          gpu_memory_bytes=gpu.memory_bytes, target_batch=1, seq_len=8192)
    files = plan_files(candidate=candidate, spec=spec, request=request)
    assert "ROPE_SCALING = {'rope_type': 'linear', 'factor': 2.0}" in files["train.py"]
    assert "rope linear x2" in files["PLAN.md"] and "RoPE scaling linear:2 set on the model's config" in files["PLAN.md"]
    assert "rope" not in json.dumps(json.loads(files["training_args.json"]))  # the model's config, not the Trainer's


def test_dataset_rows_are_cut_at_the_extended_limit(cli, tmp_path):
    """--dataset plans the longest row the data makes, cut at the context limit: 6000 tokens past Llama-2's
    4096 positions are cut to 4096 without the scaling, kept with factor 2 (limit 8192)."""
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": list(range(n))}) for n in (6000, 100)) + "\n")
    base = ("suggest", "-m", LLAMA2, "-g", "a100-80gb", "-b", "2", "--method", "qlora", "--no-packing",
            "--dataset", str(data), "--json", "--no-save")
    for extra, planned in (((), 4096), (("--rope-scaling", "2"), 6000)):
        result = cli(*base, *extra)
        assert result.code == 0, result
        assert {p["config"]["seq_len"] for p in json.loads(result.out)["plans"]} == {planned}
