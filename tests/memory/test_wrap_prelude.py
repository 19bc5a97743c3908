"""FSDP1 wrapping a host-loaded model on 2 GPUs, drawn before the first step (planner/memory/wrap.py,
planner/memory/timeline.py ``_wrap_prelude``): each unit's parameters, sync_module_states' broadcast
buckets and flat parameter made and freed around its shard, by hand on a 2-layer model of Mistral-7B's
shapes (whose tensors reach the 250 MiB broadcast buckets); one-GPU plans and FSDP2 draw none."""

from __future__ import annotations

from planner.catalog import spec_from_config
from planner.config import TrainConfig
from planner.gpus import get_gpu
from planner.memory.timeline import step_timeline
from planner.memory.wrap import BUCKET_KEY, FLAT_KEY, PARAMETERS_KEY, draws_wrap
from planner.units import KiB, MiB

#: Mistral-7B-v0.1's config.json shapes, 2 layers
MODEL = spec_from_config(dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                              num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                              max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False),
                         model_id="small/mistral2", source="test")
KERNELS = get_gpu("a100-80gb").kernels
WHERE = "load and wrap"

#: one decoder layer's parameters in bf16, in the model's order: q 4096x4096, k and v 1024x4096, o, gate, up,
#: down 14336x4096, the two RMSNorm weights
Q, KV, MLP, NORM = 32 * MiB, 8 * MiB, 112 * MiB, 8 * KiB
LAYER = (Q, KV, KV, Q, MLP, MLP, MLP, NORM, NORM)
#: the root unit: embeddings and head 32000x4096 (250 MiB each, exactly PARAM_BROADCAST_BUCKET_SIZE), final norm
EMBED = 32000 * 4096 * 2
ROOT = (EMBED, NORM, EMBED)


def _config(**changes) -> TrainConfig:
    fields = dict(method="lora", precision="bf16", gpus=2, sharding="fsdp1", micro_batch=2, seq_len=1024, grad_ckpt=True,
                  lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    return TrainConfig(**(fields | changes))


def _prelude(timeline):
    return [(ev.op, ev.key, ev.nbytes) for ev in timeline.events if ev.where == WHERE]


def test_each_unit_by_hand_layers_then_the_root():
    timeline = step_timeline(model=MODEL, config=_config(), kernels=KERNELS)
    shard = [ev.nbytes for ev in timeline.events if ev.where == WHERE and ev.key == "weights"]
    layer = sum(LAYER)  # 416 MiB + 16 KiB: an even number of elements, no padding for 2 ranks
    one_layer = [
        ("alloc", PARAMETERS_KEY, layer),  # moved to the device one tensor each
        # buckets closed at >= 250 MiB: q, k, v, o, gate, up (304 MiB), then down and the norms
        ("alloc", BUCKET_KEY, 2 * Q + 2 * KV + 2 * MLP),
        ("alloc", BUCKET_KEY, MLP + 2 * NORM),
        ("free", BUCKET_KEY, 2 * Q + 2 * KV + 2 * MLP),
        ("free", BUCKET_KEY, MLP + 2 * NORM),
        ("alloc", FLAT_KEY, layer),  # torch.cat into the flat parameter
        ("free", PARAMETERS_KEY, layer),  # the parameters now its views
    ]
    root = sum(ROOT)
    expected = []
    for k in range(2):
        expected += one_layer + [("alloc", "weights", shard[k]), ("free", FLAT_KEY, layer)]
    expected += [
        ("alloc", PARAMETERS_KEY, root),
        # the embeddings alone fill a bucket (a view, no copy); the norm and the head are flattened
        ("alloc", BUCKET_KEY, NORM + EMBED),
        ("free", BUCKET_KEY, NORM + EMBED),
        ("alloc", FLAT_KEY, root),
        ("free", PARAMETERS_KEY, root),
        ("alloc", "weights", shard[2]),
        ("free", FLAT_KEY, root),
    ]
    assert _prelude(timeline) == expected
    # each shard this rank's half of its unit; the resident weights drawn nowhere else
    resident = [ev.nbytes for ev in timeline.events if ev.key == "weights" and ev.op == "alloc"]
    assert resident == shard and sum(shard) == MODEL.params_total * 2 // 2
    assert abs(shard[0] - layer // 2) <= 64 and abs(shard[2] - root // 2) <= 64
    # the parameters come as the tensors they are (the replay's grain)
    made = [ev for ev in timeline.events if ev.key == PARAMETERS_KEY and ev.op == "alloc"]
    assert [ev.tensors for ev in made] == [LAYER, LAYER, ROOT]


def test_every_temporary_freed_before_the_step():
    for config in (_config(), _config(method="qlora", precision="bf16-mixed", kbit_upcast=False),
                   _config(method="full", lora_r=None, lora_targets=None)):
        timeline = step_timeline(model=MODEL, config=config, kernels=KERNELS)
        live: dict[int, str] = {}
        for ev in timeline.events[:timeline.start]:
            if ev.key.startswith("weights/wrap/"):
                if ev.op == "alloc":
                    live[ev.ident] = ev.key
                else:
                    del live[ev.ident]
        assert not live, config
        assert timeline.peak >= max(timeline.curve()[:timeline.start + 1])  # (and the moments' accounting holds)


def test_qlora_shards_are_the_resident_4bit_and_16bit_weights():
    config = _config(method="qlora", precision="bf16-mixed", kbit_upcast=False)
    timeline = step_timeline(model=MODEL, config=config, kernels=KERNELS)
    made = [(ev.key, ev.nbytes) for ev in timeline.events if ev.where == WHERE and ev.op == "alloc"
            and not ev.key.startswith("weights/wrap/")]
    assert [key for key, _ in made] == ["weights/nf4", "weights/nf4", "weights/unquantized"]
    # a layer's packed codes two to a byte in the bf16 storage FSDP1 flattens with its norms
    params = [ev.nbytes for ev in timeline.events if ev.key == PARAMETERS_KEY and ev.op == "alloc"]
    assert params[0] == sum(LAYER[:7]) // 4 + 2 * NORM


def test_one_gpu_and_fsdp2_draw_no_prelude():
    for config in (_config(gpus=1), _config(sharding="none", gpus=1), _config(sharding="fsdp2")):
        assert not draws_wrap(MODEL, config)
        timeline = step_timeline(model=MODEL, config=config, kernels=KERNELS)
        assert not _prelude(timeline)
        weights = [ev for ev in timeline.events if ev.key == "weights"]
        assert len(weights) == 1 and weights[0].where == "model states"
