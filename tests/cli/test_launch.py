"""`adaptive launch`: plans like `adaptive fit`, writes the run's configs, prints the exact launch command for one
node, for each of several nodes, and for DeepSpeed's hostfile launcher (checked against the command accelerate
itself builds from our config), and the recipe re-derives the same plan from what it is given."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest
import yaml

from adaptive.plan import fit, make_request
from tests.conftest import REPO_ROOT, subprocess_env

RECIPE = str(REPO_ROOT / "recipes" / "b1_mod.py")


def adaptive(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          env=subprocess_env(COLUMNS="200"), timeout=60, cwd=REPO_ROOT)


def launch_json(*args: str, recipe_args: tuple[str, ...] = ()) -> dict:
    done = adaptive("launch", *args, "--dry-run", "--json", *(("--", *recipe_args) if recipe_args else ()))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_single_node_plans_writes_configs_and_prints_the_accelerate_command(tmp_path):
    out = launch_json(RECIPE, "--gpu", "a100-80gb", "--gpus", "8", "--run-dir", str(tmp_path),
                      recipe_args=("--max-steps", "50"))
    assert (out["preset"], out["arch"], out["launcher"]) == ("b1", "mod", "single-node")
    plan = json.loads((tmp_path / "plan.json").read_text())
    expected = fit(make_request(model="b1", arch="mod", gpu="a100-80gb", gpus=8))
    assert (plan["zero_stage"], plan["micro_batch_size"], plan["gradient_accumulation_steps"]) == (
        expected.best.setup.zero_stage, expected.best.setup.micro_batch_size, expected.best.grad_accum)
    acc = yaml.safe_load((tmp_path / "accelerate_config.yaml").read_text())
    assert acc["distributed_type"] == "DEEPSPEED" and acc["num_processes"] == 8
    assert acc["deepspeed_config"]["deepspeed_config_file"] == str(tmp_path / "ds_config.json")
    command = shlex.split(out["commands"][0])
    assert command[:4] == ["accelerate", "launch", "--config_file", str(tmp_path / "accelerate_config.yaml")]
    assert command[4] == RECIPE and command[-2:] == ["--max-steps", "50"]
    for flag, value in (("--ds-config", str(tmp_path / "ds_config.json")), ("--output-dir", str(tmp_path)),
                        ("--gpu", "a100-80gb"), ("--seq-len", "2048")):
        assert command[command.index(flag) + 1] == value
    assert out["this_node"] == out["commands"][0]


def test_several_nodes_get_one_accelerate_command_each(tmp_path):
    out = launch_json(str(REPO_ROOT / "recipes" / "b1_moe.py"), "--gpu", "h100", "--gpus", "8", "--nodes", "2",
                      "--main-process-ip", "10.0.0.1", "--machine-rank", "1", "--run-dir", str(tmp_path))
    assert out["launcher"].startswith("multi-node (accelerate")
    assert len(out["commands"]) == 2
    ep_size = json.loads((tmp_path / "plan.json").read_text())["ep_size"]
    for rank, command in enumerate(map(shlex.split, out["commands"])):
        assert command[command.index("--machine_rank") + 1] == str(rank)
        assert command[command.index("--main_process_ip") + 1] == "10.0.0.1"
        assert command[command.index("--ep-size") + 1] == str(ep_size)
    assert out["this_node"] == out["commands"][1]
    acc = yaml.safe_load((tmp_path / "accelerate_config.yaml").read_text())
    assert (acc["num_machines"], acc["num_processes"]) == (2, 16)
    assert acc["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"


def test_a_hostfile_uses_deepspeeds_launcher_as_accelerate_builds_it(tmp_path, monkeypatch):
    hosts = tmp_path / "hostfile"
    hosts.write_text("# two nodes\nnode-a slots=8\nnode-b slots=8\n")
    run = tmp_path / "run"
    out = launch_json(RECIPE, "--gpu", "a100-80gb", "--gpus", "8", "--nodes", "2", "--hostfile", str(hosts),
                      "--run-dir", str(run))
    assert out["launcher"] == "multi-node (DeepSpeed launcher, pdsh)" and len(out["commands"]) == 1
    # what accelerate's own launcher makes of our accelerate config: the same deepspeed command
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as accelerate_launch
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    # accelerate refuses a busy main port on the main node; this test builds the command and starts nothing,
    # so it must not depend on port 29500 being free on the test machine
    monkeypatch.setattr(accelerate_launch, "is_port_in_use", lambda port=None: False)
    command = shlex.split(out["commands"][0])
    args = launch_command_parser().parse_args(command[2:])
    args, defaults, _ = _validate_launch_command(args)
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    built, env = prepare_deepspeed_cmd_env(args)
    assert shlex.join(built) == out["deepspeed_command"]
    assert built[:4] == ["deepspeed", "--hostfile", str(hosts), "--no_local_rank"]
    assert built[built.index("--master_addr") + 1] == "node-a" and built[built.index("--num_gpus") + 1] == "8"
    assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(run / "ds_config.json")


def test_the_recipe_rederives_the_launched_plan(tmp_path):
    out = launch_json(str(REPO_ROOT / "recipes" / "debug_200m_hybrid.py"), "--gpu", "l4", "--gpus", "4",
                      "--run-dir", str(tmp_path))
    recipe_args = shlex.split(out["commands"][0])[4:]
    done = subprocess.run([sys.executable, *recipe_args, "--dry-run", "--gpus", "4"], capture_output=True, text=True,
                          env=subprocess_env(), timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    recipe = json.loads(done.stdout)
    plan = json.loads((tmp_path / "plan.json").read_text())
    for key in ("zero_stage", "micro_batch_size", "gradient_accumulation_steps", "seq_len", "gradient_checkpointing",
                "ep_size", "offload_optimizer"):
        assert recipe["plan"][key] == plan[key], key
    assert recipe["run"]["ds_config_source"] == {"kind": "file", "path": str(tmp_path / "ds_config.json")}
    assert recipe["run"]["precision"] == "bf16" and recipe["ds_config"]["bf16"] == {"enabled": True}


def test_human_output_names_the_plan_files_and_command(tmp_path):
    done = adaptive("launch", RECIPE, "--gpu", "a100-80gb", "--run-dir", str(tmp_path), "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "b1 mod: ZeRO-" in done.stdout and f"wrote {tmp_path / 'ds_config.json'}" in done.stdout
    assert f"accelerate launch --config_file {tmp_path / 'accelerate_config.yaml'} {RECIPE}" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["recipes/nope_mod.py", "--gpu", "a100"], "does not exist"),
    ([str(REPO_ROOT / "ds_configs" / "generate.py"), "--gpu", "a100"], "cannot tell the preset and arch"),
    ([RECIPE, "--gpu", "a100", "--nodes", "2", "--gpus", "8", "--hostfile", "HOSTS"], "lists 1 hosts but --nodes is 2"),
    ([RECIPE, "--gpu", "t4", "--model", "b7", "--arch", "dense"], "does not fit 1 x t4-16gb"),
    ([RECIPE, "--gpu", "a100", "--nodes", "2", "--machine-rank", "2"], "--machine-rank must be in 0..1"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("only-one slots=8\n")
    args = [str(hosts) if a == "HOSTS" else a for a in args]
    done = adaptive("launch", *args, "--run-dir", str(tmp_path / "run"), "--dry-run")
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_without_dry_run_the_printed_command_is_what_accelerates_launcher_runs(tmp_path):
    """run_launch hands the printed command, minus `accelerate launch`, to accelerate's own parser and launcher
    (tests/train/run_folder/test_run_safety.py runs it for real)."""
    from accelerate.commands.launch import launch_command_parser

    from adaptive import launch as launcher
    from adaptive.config import RunConfig

    config = RunConfig().replace(gpu="a100", output_dir=str(tmp_path))
    planned = launcher.plan_launch(launcher.LaunchRequest(recipe=RECIPE, config=config))
    assert planned.this_node[:2] == ["accelerate", "launch"]
    args = launch_command_parser().parse_args(planned.this_node[2:])
    assert args.config_file == str(planned.files["accelerate_config"])
    assert [args.training_script, *args.training_script_args] == planned.this_node[4:]


def test_a_multi_node_launch_without_the_main_address_refuses_to_run(tmp_path):
    done = adaptive("launch", RECIPE, "--gpu", "a100", "--gpus", "8", "--nodes", "2", "--run-dir", str(tmp_path))
    assert done.returncode == 2 and "pass --main-process-ip" in done.stderr
    assert "MAIN_NODE_IP" in done.stdout  # the commands were still printed, with the placeholder


def test_launch_imports_no_torch(tmp_path):
    code = ("import sys; from cli.main import run;"
            "rc = run(['launch', 'recipes/b1_mod.py', '--gpu', 'h100', '--dry-run', '--run-dir', sys.argv[1]]);"
            "heavy = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules];"
            "print('HEAVY', heavy, rc, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          env=subprocess_env(), timeout=60, cwd=REPO_ROOT)
    assert "HEAVY [] 0" in done.stderr, done.stderr


def test_launch_plans_and_launches_the_model_it_was_given(tmp_path):
    """`launch recipes/b1_mod.py --model debug` once planned debug and then launched b1."""
    out = launch_json(RECIPE, "--model", "debug", "--gpu", "a100", "--run-dir", str(tmp_path))
    assert out["preset"] == "debug"
    command = shlex.split(out["this_node"])
    assert command[command.index("--model") + 1] == "debug"
    assert json.loads((tmp_path / "plan.json").read_text())["params_total"] < 10**7


@pytest.mark.parametrize("flag", ["--seq-len", "--micro-batch", "--max-steps"])
def test_launch_refuses_zero_where_a_positive_number_is_needed(flag, tmp_path):
    done = adaptive("launch", RECIPE, "--gpu", "a100", flag, "0", "--run-dir", str(tmp_path), "--dry-run")
    assert done.returncode == 2 and flag in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_resume_with_no_checkpoint_is_refused_before_launch_writes_anything(tmp_path):
    (tmp_path / "checkpoints" / "step_00000002").mkdir(parents=True)  # no COMPLETE.json: not a checkpoint
    (tmp_path / "checkpoints" / "latest").write_text("step_00000002\n")
    done = adaptive("launch", RECIPE, "--gpu", "a100", "--run-dir", str(tmp_path), "--resume")
    assert done.returncode == 2 and "Traceback" not in done.stderr  # the lookup warns without accelerate's state
    assert [line for line in done.stderr.splitlines() if line.startswith("error:")] == [
        f"error: --resume: {tmp_path} holds no complete checkpoint, so nothing was written; launch a fresh run "
        "without --resume"]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoints"]


@pytest.mark.parametrize("flags, section", [
    (("--sp-size", "2"), lambda ds: ds["sequence_parallel_size"] == 2),
    (("--tp-size", "2"), lambda ds: ds["tensor_parallel"] == {"autotp_size": 2}),
    (("--zero", "3", "--zero-hpz", "2", "--zero-quantize", "both"),
     lambda ds: (ds["zero_optimization"]["zero_hpz_partition_size"], ds["zero_optimization"]["zero_quantized_weights"],
                 ds["zero_optimization"]["zero_quantized_gradients"]) == (2, True, True)),
])
def test_sp_tp_and_zero_plus_plus_pins_reach_the_recipe_and_deepspeed_accepts_them(flags, section, tmp_path):
    out = launch_json(str(REPO_ROOT / "recipes" / "debug_dense.py"), "--gpu", "a100-80gb", "--gpus", "2",
                      "--run-dir", str(tmp_path), *flags)
    recipe_args = shlex.split(out["commands"][0])[4:]
    assert " ".join(flags) in " ".join(recipe_args)  # pinned like every knob: the recipe gets them
    done = subprocess.run([sys.executable, *recipe_args, "--dry-run", "--gpus", "2"], capture_output=True, text=True,
                          env=subprocess_env(), timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    ds = json.loads(done.stdout)["ds_config"]
    assert section(ds), ds
    from adaptive.train.run.runplan import check_with_deepspeed

    check_with_deepspeed(ds, 2)  # DeepSpeed's own DeepSpeedConfig takes every key


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


DEBUG = str(REPO_ROOT / "recipes" / "debug_dense.py")


@pytest.mark.skipif(_cuda_here(), reason="plans for the CPU only where there is no CUDA GPU")
def test_without_a_gpu_or_gpu_flag_launch_plans_the_cpu_run_the_recipe_makes(tmp_path):
    out = launch_json(DEBUG, "--gpus", "2", "--run-dir", str(tmp_path))
    assert any(note.startswith("no CUDA GPU here: 2 CPU process(es) train in fp32") for note in out["notes"])
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (4, 1)
    assert "bf16" not in ds and "fp16" not in ds  # fp32 on the CPU, as the recipe run directly
    assert yaml.safe_load((tmp_path / "accelerate_config.yaml").read_text())["num_processes"] == 2
    args = shlex.split(out["commands"][0])
    assert "--gpu" not in args and args[args.index("--seq-len") + 1] == "128"
    # the recipe run directly on this machine plans the same knobs
    done = subprocess.run([sys.executable, *args[4:], "--dry-run"], capture_output=True, text=True,
                          env=subprocess_env(), timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    knobs = json.loads(done.stdout)["run"]["knobs"]
    assert (knobs["micro_batch_size"], knobs["seq_len"]) == (4, 128)


@pytest.mark.skipif(_cuda_here(), reason="plans for the CPU only where there is no CUDA GPU")
def test_without_a_gpu_several_nodes_are_refused_in_one_line(tmp_path):
    done = adaptive("launch", DEBUG, "--nodes", "2", "--dry-run", "--run-dir", str(tmp_path))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "no CUDA GPU found here, and a CPU run is one machine" in done.stderr


@pytest.mark.slow  # a real launch: accelerate, DeepSpeed and two training steps
@pytest.mark.skipif(_cuda_here(), reason="plans for the CPU only where there is no CUDA GPU")
def test_launch_on_a_cpu_machine_trains_cpu_sized_batches(tmp_path):
    env = subprocess_env(COLUMNS="200", HF_HOME=str(tmp_path / "home"), ADAPTIVE_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-m", "cli", "launch", DEBUG, "--max-steps", "2", "--output-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=600, cwd=REPO_ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    start = next(json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["kind"] == "start")
    assert (start["device"], start["precision"], start["max_steps"]) == ("cpu", "fp32", 2)
    assert (start["knobs"]["micro_batch_size"], start["knobs"]["seq_len"]) == (4, 128)


@pytest.mark.skipif(_cuda_here(), reason="a GPU plan trains as planned where there is a CUDA GPU")
def test_a_gpu_plan_launched_on_a_cpu_machine_says_it_trains_gpu_sized_batches_there(tmp_path):
    from adaptive.config.run import RunConfig
    from adaptive.launch import LaunchRequest, plan_launch

    config = RunConfig().replace(gpu="a100-80gb", output_dir=str(tmp_path / "run"))
    planned = plan_launch(LaunchRequest(recipe=DEBUG, config=config))  # not a dry run; nothing is started here
    setup = planned.plan.shown.setup
    assert f"no CUDA GPU here: the run trains this a100-80gb plan's batches (micro-batch {setup.micro_batch_size} x " \
           f"sequence {setup.seq_len}) on the CPU" in " ".join(planned.notes)
    dry = plan_launch(LaunchRequest(recipe=DEBUG, config=config.replace(output_dir=str(tmp_path / "dry")), dry_run=True))
    assert not any(note.startswith("no CUDA GPU") for note in dry.notes)  # planning for a GPU from a laptop is normal
