"""A config.json that ships quantized weights is planned as its 16-bit model, and the plan says so
(planner/catalog/architectures.py ``_quantized_checkpoint_note``): no silent hole."""

from planner.catalog import resolve_model
from planner.catalog.architectures import spec_from_config

LLAMA = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
         "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096}


def test_a_gptq_checkpoint_counts_the_16_bit_model_and_says_it():
    plain = spec_from_config(LLAMA, model_id="llama", source="test")
    gptq = spec_from_config({**LLAMA, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}},
                            model_id="llama-gptq", source="test")
    assert gptq.params_total == plain.params_total and plain.training_notes == ()
    assert gptq.training_notes == ("gptq checkpoint: planned as the 16-bit model it de-quantizes to (--method qlora: "
                                   "bitsandbytes' NF4 of it); training on its gptq weights directly is not modelled",)


def test_a_quantization_config_without_a_method_is_named_quantized():
    spec = spec_from_config({**LLAMA, "quantization_config": {"bits": 4}}, model_id="m", source="test")
    assert spec.training_notes[0].startswith("quantized checkpoint:")


def test_gpt_oss_keeps_its_own_note():
    # the catalog's gpt-oss config carries an mxfp4 quantization_config; its builder's note stands alone
    spec = resolve_model("openai/gpt-oss-20b")
    assert spec.config["quantization_config"]["quant_method"] == "mxfp4"
    assert len(spec.training_notes) == 1 and spec.training_notes[0].startswith("gpt-oss: the MXFP4 experts")
