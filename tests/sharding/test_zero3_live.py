"""ZeRO-3's gathered ("live") parameters and its partition of frozen weights, as DeepSpeed's own
code bounds them (planner/sharding/zero.py: zero3_live_params, zero3_param_split,
zero3_gathered_bytes). Byte counts derived by hand below; the slow test runs DeepSpeed's real
coordinator on the CPU and reads how many parameter elements it holds gathered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from planner.catalog import spec_from_config
from planner.config import TrainConfig
from planner.memory import model_state_breakdown
from planner.memory.parameters import param_tensor_sizes, trained
from planner.memory.states import base_tensor_sizes
from planner.sharding.zero import DS_MAX_LIVE_PARAMETERS, zero3_gathered_bytes, zero3_live_params

BLOOM_7B1 = dict(model_type="bloom", hidden_size=4096, n_layer=30, n_head=32, vocab_size=250880)


def test_live_bound_is_max_live_or_reuse_distance_plus_one_parameter_past_it():
    sizes = (10, 100, 300, 500)  # 10 persistent under a threshold of 10: 900 elements partitioned
    # max_live = max_reuse = 350: the prefetch stops once 350 are gathered, but its loop adds a
    # whole parameter past the bound, the largest at worst: 350 + 500 = 850 < 900
    assert zero3_live_params(sizes, max_live=350, max_reuse=350, persistence_threshold=10) == 850
    # a reuse distance of 380 keeps up to 380 (+ the largest) whatever max_live: 880
    assert zero3_live_params(sizes, max_live=100, max_reuse=380, persistence_threshold=10) == 880
    # bounds above the model: every partitioned parameter, 900 (the persistent 10 never leave)
    assert zero3_live_params(sizes, max_live=10**9, max_reuse=10**9, persistence_threshold=10) == 900
    # everything persistent: nothing to gather
    assert zero3_live_params((10, 5), max_live=10**9, max_reuse=10**9, persistence_threshold=10) == 0


def test_one_rank_without_parameter_offload_gathers_nothing():
    # world size 1: DeepSpeed hands the partition itself to the module (NoGatherHandle), no copy
    spec = spec_from_config(BLOOM_7B1, model_id="bloom-7b1", source="test")
    config = TrainConfig(method="lora", lora_targets=("query_key_value",), zero=3, precision="fp32")
    assert zero3_gathered_bytes(spec, config, trained(spec, config), base_tensor_sizes(spec)) == 0


def test_bloom_7b1_with_parameter_offload_gathers_max_live_plus_the_tied_embedding():
    spec = spec_from_config(BLOOM_7B1, model_id="bloom-7b1", source="test")
    config = TrainConfig(method="lora", lora_targets=("query_key_value",), zero=3, precision="fp32",
                         offload="optimizer+params")
    # the largest partitioned parameter: the word embedding tied to lm_head, 250880 x 4096 =
    # 1,027,604,480 elements; with DeepSpeed's max_live 1e9 the bound is 2,027,604,480 elements,
    # fp32 (no mixed precision): x 4 B = 8,110,417,920 B (the model has 7.07e9, so the bound holds)
    assert zero3_gathered_bytes(spec, config, trained(spec, config), base_tensor_sizes(spec)) == (DS_MAX_LIVE_PARAMETERS + 250880 * 4096) * 4
    assert 8_110_417_920 == (DS_MAX_LIVE_PARAMETERS + 250880 * 4096) * 4


def test_zero3_partitions_frozen_lora_base_weights():
    # bloom-7b1 LoRA on 8 ranks, fp32, no offload. Persistent (numel <= 10 x 4096 = 40,960): per
    # block 4 norm vectors (2 LayerNorms x weight+bias) 4 x 4096 + the biases of query_key_value
    # 12288, dense 4096, dense_h_to_4h 16384, dense_4h_to_h 4096 = 53,248; x 30 blocks = 1,597,440;
    # + word_embeddings_layernorm and ln_f, 2 x 2 x 4096 = 16,384: 1,613,824 elements.
    spec = spec_from_config(BLOOM_7B1, model_id="bloom-7b1", source="test")
    config = TrainConfig(method="lora", lora_targets=("query_key_value",), zero=3, precision="fp32", gpus=8)
    states, host = model_state_breakdown(spec, config)
    persistent = 30 * (4 * 4096 + 12288 + 4096 + 16384 + 4096) + 2 * 2 * 4096
    assert persistent == 1_613_824
    # every rank keeps 1/8 of the rest (7,069,016,064 - 1,613,824) and the persistent ones whole, fp32
    assert spec.params_total == 7_069_016_064
    assert states["weights"] == (spec.params_total - persistent) * 4 // 8 + persistent * 4 == 3_540_156_416
    assert host == 0


#: a bloom whose blocks are larger than the prefetch bucket and whose tied embedding (8000 x 128
#: = 1,024,000 elements) is larger than max_live and max_reuse_distance (600,000 each, about
#: three blocks of 196,608 weights), as bloom-7b1's (1.03e9) is larger than DeepSpeed's 1e9
TINY_BLOOM = dict(model_type="bloom", hidden_size=128, n_layer=8, n_head=4, vocab_size=8000)
MAX_LIVE = 600_000

_PROBE = textwrap.dedent('''
    import json, os, socket, sys
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    import torch, deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    deepspeed.init_distributed(dist_backend="gloo")
    spec, zero = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    cfg = AutoConfig.for_model(**spec)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(r=8, target_modules=["query_key_value"]))
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, **zero},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=ds)
    params = list(engine.module.parameters())
    peak = [0]
    def live():  # elements of partitioned parameters gathered (or in flight) now
        n = sum(p.ds_numel for p in params if not p.ds_persist and p.ds_status != ZeroParamStatus.NOT_AVAILABLE)
        peak[0] = max(peak[0], n)
    cls = ppc.PartitionedParameterCoordinator
    fetch, release = cls.fetch_sub_module, cls.release_sub_module
    cls.fetch_sub_module = lambda self, m, forward: (fetch(self, m, forward), live())[0]
    cls.release_sub_module = lambda self, m, forward=False: (release(self, m, forward), live())[0]
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):  # the trace is recorded in step 2 and complete (prefetching) in step 3
        peak[0] = 0
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    print(json.dumps({"peak": peak[0], "persistent": sum(p.ds_numel for p in params if p.ds_persist)}))
''')


@pytest.mark.slow
def test_deepspeed_coordinator_stays_within_the_live_bound(tmp_path):
    from planner.emit.deepspeed import build

    config = TrainConfig(method="lora", lora_r=8, lora_targets=("query_key_value",), zero=3, precision="fp32",
                         micro_batch=1)
    zero = dict(build(config, hidden_size=128)["zero_optimization"], stage3_max_live_parameters=MAX_LIVE,
                stage3_max_reuse_distance=MAX_LIVE)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(TINY_BLOOM), json.dumps(zero)], capture_output=True,
                         text=True, timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    spec = spec_from_config(TINY_BLOOM, model_id="tiny-bloom", source="test")
    sizes = param_tensor_sizes(spec, TrainConfig()) + trained(spec, config).sizes
    threshold = zero["stage3_param_persistence_threshold"]
    # persistent (numel <= 1280): per block 4 norm vectors of 128, the biases 384 + 128 + 512 +
    # 128 and lora_A 8 x 128 = 1024 (lora_B, 384 x 8 = 3072, is partitioned): 2688 x 8 blocks
    # + 2 LayerNorms x 2 x 128 = 22,016
    assert measured["persistent"] == sum(s for s in sizes if s <= threshold) == 8 * 2688 + 512
    bound = zero3_live_params(sizes, max_live=MAX_LIVE, max_reuse=MAX_LIVE, persistence_threshold=threshold)
    assert bound == MAX_LIVE + 8000 * 128  # max_live + the tied embedding, 1,624,000
    # the prefetcher fills max_live while the last blocks run and then prefetches the embedding
    # for lm_head: within the bound, and within one block's weights (196,608) of it
    assert bound - 196_608 <= measured["peak"] <= bound
