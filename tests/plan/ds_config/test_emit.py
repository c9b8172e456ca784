"""Every emitted ds_config.json is accepted by DeepSpeed's own config class; accelerate reads ours."""

import json

from deepspeed.runtime.config import DeepSpeedConfig

from adaptive.plan import ARCHS, CATALOG, PRESETS, fit, make_request
from adaptive.plan.ds_config.emit import ds_config, plan_dict, write_plan_files
from adaptive.plan.ds_config.reader import parse, pins
from tests._deepspeed_config import DataParallel, single_process_group  # noqa: F401 (fixture)


def test_every_preset_arch_gpu_and_count_emits_a_config_deepspeed_accepts(single_process_group):
    seen: dict[str, int] = {}
    for name in PRESETS:
        for arch in ARCHS:
            for gpu in CATALOG:
                for gpus in (1, 8):
                    plan = fit(make_request(model=name, arch=arch, gpu=gpu, gpus=gpus), suggest=False)
                    c = plan.shown
                    cfg = ds_config(c.setup, c.grad_accum, plan.request.gpu)
                    if c.setup.spec.is_moe:
                        assert cfg["zero_optimization"]["stage"] < 3, (name, arch, gpu)
                    assert ("bf16" in cfg) == CATALOG[gpu].bf16 and ("fp16" in cfg) != CATALOG[gpu].bf16
                    seen[json.dumps(cfg, sort_keys=True)] = c.setup.dp_size  # data-parallel replicas
    assert len(seen) > 50  # the search really produces varied configs
    for text, replicas in seen.items():
        cfg = json.loads(text)
        parsed = DeepSpeedConfig(cfg, mpu=DataParallel(replicas))
        assert parsed.zero_optimization_stage == cfg["zero_optimization"]["stage"]
        assert parsed.train_batch_size == cfg["train_batch_size"]
        assert parsed.zero_config.offload_optimizer is not None or "offload_optimizer" not in cfg["zero_optimization"]


def test_out_dir_files_load_in_deepspeed_and_accelerate(tmp_path, single_process_group):
    from accelerate.commands.config.config_args import ClusterConfig

    plan = fit(make_request(model="b1", arch="moe", gpu="a100-80gb", gpus=8, nodes=2))
    files = write_plan_files(plan, tmp_path)
    ds = json.loads(files["ds_config"].read_text())
    DeepSpeedConfig(ds, mpu=DataParallel(16))
    acc = ClusterConfig.from_yaml_file(str(files["accelerate_config"]))
    assert acc.distributed_type.value == "DEEPSPEED"
    assert (acc.num_processes, acc.num_machines) == (16, 2)
    assert acc.deepspeed_config["deepspeed_config_file"] == str(files["ds_config"].resolve())
    assert json.loads(files["plan"].read_text())["num_gpus"] == 16


def test_fp16_with_loss_scaling_on_t4():
    plan = fit(make_request(model="debug", gpu="t4"))
    cfg = ds_config(plan.shown.setup, plan.shown.grad_accum, plan.request.gpu)
    assert cfg["fp16"]["enabled"] and cfg["fp16"]["loss_scale"] == 0 and "bf16" not in cfg


def test_a_pipeline_plan_emits_a_config_deepspeed_accepts(single_process_group):
    from deepspeed.runtime.config import DeepSpeedConfig

    plan = fit(make_request(model="b7", gpu="h100-80gb", gpus=8, nodes=2, pp_size=4, tp_size=2), suggest=False)
    s, m = plan.shown.setup, plan.shown.grad_accum
    cfg = ds_config(s, m, plan.request.gpu)
    assert cfg["pipeline"] == {"stages": 4, "partition": "parameters"} and "tensor_parallel" not in cfg
    assert cfg["zero_optimization"]["stage"] <= 1 and cfg["gradient_accumulation_steps"] == m
    parsed = DeepSpeedConfig(cfg, mpu=DataParallel(s.dp_size))  # the pipeline grid's data-parallel size
    assert parsed.gradient_accumulation_steps == m and parsed.pipeline["stages"] == 4
    assert parsed.train_batch_size == s.micro_batch_size * m * 16 // (4 * 2)
    # the file read back pins the same pipeline
    assert pins(cfg)["pp_size"] == 4 and parse(cfg, "x", s.spec.hidden_size).pp_size == 4
    d = plan_dict(plan)
    assert (d["pp_size"], d["tp_size"], d["dp_size"]) == (4, 2, 2)
    assert d["pipeline_p2p_bytes_per_micro_batch"] == 2 * s.micro_batch_size * s.seq_len * s.spec.hidden_size * 2
