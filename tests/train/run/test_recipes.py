"""The recipes as users run them: `accelerate launch ... recipes/debug_*.py --max-steps 40` on the shipped
corpus trains (the loss falls), checkpoints, exports an HF folder that plain transformers loads and generates
with; each launch path (planned config, --ds-config, accelerate flags, accelerate config file) is honoured;
debug_moe trains on two processes with ep_size=2; every recipe plans with --dry-run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adaptive.recipe import Recipe, load_recipe

from adaptive.plan import ARCHS
from tests.train._launch import REPO, accelerate_launch, launch_env, records, tail

FINETUNE = REPO / "recipes" / "finetune.py"  # a checkpoint's fine-tune (tests/train/finetune)
RECIPES = sorted(p for p in (REPO / "recipes").glob("*.py") if p != FINETUNE)
PRESETS = ("debug", "debug_200m", "b1", "b7")

ACCELERATE_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {ds}
  zero3_init_flag: false
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 1
rdzv_backend: static
same_network: true
use_cpu: false
"""


def test_the_finetune_recipe_declares_its_method_and_gives_its_command():
    text = FINETUNE.read_text()
    assert load_recipe(FINETUNE) == Recipe(finetune="lora")
    assert "accelerate launch" in text.split('"""')[1]
    assert len([line for line in text.split('"""')[2].splitlines() if line.strip()]) == 4


def test_there_is_one_recipe_per_preset_and_arch_and_each_names_them():
    assert [p.stem for p in RECIPES] == sorted(f"{p}_{a}" for p in PRESETS for a in ARCHS)
    for path in RECIPES:
        preset, arch = path.stem.rsplit("_", 1)
        text = path.read_text()
        assert load_recipe(path) == Recipe(model=preset, arch=arch)  # the declaration launch reads
        assert "accelerate launch" in text.split('"""')[1]  # the docstring gives the command
        code = [line for line in text.split('"""')[2].splitlines() if line.strip()]
        assert len(code) == 4, code  # import, the declaration, __main__ guard, recipe.main(): nothing else


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_parses_its_flags_and_plans_with_dry_run(recipe, tmp_path):
    preset, arch = recipe.stem.rsplit("_", 1)
    gpus, nodes = (8, 2) if preset == "b7" else (1, 1)  # b7 MoE needs 16 A100s (ep_size 8, ZeRO-2)
    cmd = [sys.executable, str(recipe), "--dry-run", "--gpu", "a100-80gb", "--gpus", str(gpus), "--nodes", str(nodes),
           "--seq-len", "2048", "--orchestrator", "auto", "--output-dir", str(tmp_path)]
    done = subprocess.run(cmd, env=launch_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    run, plan = out["run"], out["plan"]
    assert (run["preset"], run["arch"], plan["model"], plan["arch"]) == (preset, arch, preset, arch)
    assert plan["fits"] and run["world_size"] == gpus * nodes == plan["num_gpus"] and run["precision"] == "bf16"
    assert run["knobs"]["micro_batch_size"] == plan["micro_batch_size"] == out["ds_config"][
        "train_micro_batch_size_per_gpu"]
    assert run["knobs"]["zero_stage"] == out["ds_config"]["zero_optimization"]["stage"]
    assert out["ds_config"]["bf16"] == {"enabled": True}
    assert run["max_steps"] * run["tokens_per_step"] >= plan["train_tokens"]  # 20 x active params by default
    assert run["orchestrator"]["enabled"] == plan["orchestrator"]["recommended"]
    assert not list(tmp_path.glob("*.json")), "--dry-run writes nothing"


def test_dry_run_with_gpu_imports_no_torch(tmp_path):
    code = ("import sys; from adaptive.recipe import main; rc = main('b1', 'moe', ['--dry-run', '--gpu', 'h100']);"
            "heavy = [m for m in ('torch', 'deepspeed', 'accelerate') if m in sys.modules];"
            "print('HEAVY', heavy, rc, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], env=launch_env(tmp_path), capture_output=True, text=True,
                          timeout=60)
    assert "HEAVY [] 0" in done.stderr, done.stderr


@pytest.mark.parametrize("flags, message", [
    (["--zero", "3"], "--zero 3 is impossible for MoE"),
    (["--gpu", "a100-41gb"], "did you mean a100-40gb"),
    (["--ds-config", "nowhere.json"], "does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(flags, message, tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "recipes" / "debug_moe.py"), "--dry-run", *flags],
                          env=launch_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_a_flag_contradicting_the_ds_config_file_is_refused(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "recipes" / "debug_dense.py"), "--dry-run",
                           "--ds-config", str(REPO / "ds_configs" / "zero1.json"), "--zero", "2"],
                          env=launch_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--zero 2 contradicts 1" in done.stderr


# --- real training runs -------------------------------------------------------------------------

# arch -> (how it is launched, what the run must report as its DeepSpeed config source and ZeRO stage);
# together they cover ZeRO 0-3 (ZeRO-3's export goes through DeepSpeed's consolidated 16-bit weights)
LAUNCH_PATHS = {
    "dense": ("accelerate flags", 3, "accelerate"),  # --use_deepspeed --zero_stage 3: honoured
    "moe": ("plan", 0, "plan"),  # plain --use_deepspeed: the plan's config (ZeRO-0 for one CPU process)
    "mod": ("accelerate config file", 1, "accelerate"),  # DEEPSPEED config naming ds_configs/zero1.json
    "hybrid": ("--ds-config", 2, "file"),  # the recipe's own flag
}


@pytest.fixture(scope="module")
def debug_runs(tmp_path_factory):
    """The four debug recipes, 40 steps each on the shipped corpus, one per launch path."""
    home = tmp_path_factory.mktemp("home")
    runs = {}
    for arch, (how, _, _) in LAUNCH_PATHS.items():
        out = tmp_path_factory.mktemp(f"debug_{arch}")
        # seq 64 instead of the CPU default 128 halves the suite's time; the command is otherwise the user's
        args = ["--max-steps", "40", "--seq-len", "64", "--output-dir", str(out), "--log-every", "5", "--no-progress"]
        launch_args = None
        if how == "accelerate flags":
            launch_args = ["--use_deepspeed", "--zero_stage", "3", "--num_processes", "1"]
        elif how == "accelerate config file":
            config = out.parent / f"accelerate_{arch}.yaml"
            config.write_text(ACCELERATE_CONFIG.format(ds=REPO / "ds_configs" / "zero1.json"))
            launch_args = ["--config_file", str(config)]
        elif how == "--ds-config":
            args += ["--ds-config", str(REPO / "ds_configs" / "zero2.json")]
        done = accelerate_launch(REPO / "recipes" / f"debug_{arch}.py", args, launch_args=launch_args, home=home,
                                 ADAPTIVE_CACHE=str(home / "cache"))
        runs[arch] = (out, done)
    return runs


@pytest.mark.slow  # real recipe runs
@pytest.mark.parametrize("arch", ARCHS)
def test_debug_recipe_trains_checkpoints_and_exports(debug_runs, arch):
    out, done = debug_runs[arch]
    assert done.returncode == 0, tail(done)
    train = records(out, "train")
    assert [r["step"] for r in train] == list(range(5, 45, 5))
    assert train[-1]["loss"] < train[0]["loss"] - 0.8, [r["loss"] for r in train]  # falls clearly
    assert train[0]["loss"] < 8.0 and all(r["tokens_per_s"] > 0 for r in train)
    assert all(r["mfu"] is None and r["memory"] is None for r in train)  # a CPU has no catalog peak
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_00000040" and (out / "checkpoints" / latest / "COMPLETE.json").is_file()
    assert (out / "hf" / "model.safetensors").is_file() and (out / "hf" / "tokenizer.json").is_file()
    evals = records(out, "eval")
    assert evals[-1]["step"] == 40 and evals[-1]["eval_loss"] < 7.0
    assert records(out, "end")[-1]["export"] == str(out / "hf")


@pytest.mark.slow  # real recipe runs
@pytest.mark.parametrize("arch", ARCHS)
def test_each_launch_path_is_honoured(debug_runs, arch):
    out, done = debug_runs[arch]
    how, zero, source = LAUNCH_PATHS[arch]
    start = records(out, "start")[0]
    assert start["ds_config_source"]["kind"] == source, how
    assert start["knobs"]["zero_stage"] == zero
    assert json.loads((out / "ds_config.json").read_text())["zero_optimization"]["stage"] == zero
    assert start["precision"] == "fp32" and start["device"] == "cpu"
    assert start["orchestrator"] == {"requested": "auto", "enabled": False,
                                     "reason": "debugging: keep behaviour tight and predictable"}
    plan = json.loads((out / "plan.json").read_text())
    assert plan["run"]["knobs"] == start["knobs"] and plan["model"] == "debug" and plan["arch"] == arch


@pytest.mark.slow  # real recipe runs
def test_router_metrics_match_the_architecture(debug_runs):
    tokens_per_interval = 5 * 4 * 64  # log every 5 steps x micro-batch 4 x seq 64, one process
    moe = records(debug_runs["moe"][0], "train")[-1]
    assert len(moe["expert_counts"]) == 5 and all(len(layer) == 8 for layer in moe["expert_counts"])
    # top-2: every token is counted for two experts, in every MoE layer
    assert all(sum(layer) == 2 * tokens_per_interval for layer in moe["expert_counts"])
    mean = 2 * tokens_per_interval / 8
    assert moe["max_vio"][0] == pytest.approx((max(moe["expert_counts"][0]) - mean) / mean)
    assert moe["max_vio_max"] == max(moe["max_vio"]) and moe["mod_skip_rate"] is None
    assert all(0 <= d < 1 for d in moe["dropped_fraction"]) and moe["aux_loss"] > 0
    mod = records(debug_runs["mod"][0], "train")[-1]
    assert mod["expert_counts"] is None and len(mod["mod_skip_rate"]) == 2  # blocks 1 and 3 are routed
    assert all(r == pytest.approx(0.5) for r in mod["mod_skip_rate"])  # capacity 0.5 of each sequence
    hybrid = records(debug_runs["hybrid"][0], "train")[-1]
    # hybrid: MoE in every block, blocks 1 and 3 MoD-routed; a routed block's experts see only the
    # half of the tokens its router kept
    assert len(hybrid["expert_counts"]) == 5 and len(hybrid["mod_skip_rate"]) == 2
    assert [sum(layer) for layer in hybrid["expert_counts"]] == [2 * tokens_per_interval, tokens_per_interval] * 2 + [
        2 * tokens_per_interval]
    dense = records(debug_runs["dense"][0], "train")[-1]
    assert dense["aux_loss"] is None and dense["lm_loss"] == dense["loss"]
    assert dense["ppl"] == pytest.approx(2.718281828459045 ** dense["lm_loss"])


@pytest.mark.slow  # real recipe runs
def test_exports_load_in_plain_transformers_and_generate(debug_runs, tmp_path):
    folders = {arch: str(out / "hf") for arch, (out, _) in debug_runs.items()}
    code = f"""
import json, sys
import adaptive
from transformers import AutoModelForCausalLM, AutoTokenizer
result = {{}}
for arch, path in {folders!r}.items():
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("The lawyer is a", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    loss = model(**ids, labels=ids["input_ids"]).loss.item()
    result[arch] = dict(cls=type(model).__name__, moe=getattr(model.config, "moe_implementation", None), loss=loss,
                        new=out.shape[1] - ids["input_ids"].shape[1], text=tok.decode(out[0]))
result["deepspeed_imported"] = "deepspeed" in sys.modules
print(json.dumps(result))
"""
    done = subprocess.run([sys.executable, "-c", code], env=launch_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result.pop("deepspeed_imported") is False
    classes = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "adaptive": "AdaptiveForCausalLM"}
    for arch, r in result.items():
        meta = json.loads((Path(folders[arch]) / "adaptive_export.json").read_text())
        # the most portable format: dense -> llama, MoE -> mixtral unless its selection bias is in use
        assert meta["format"] == {"dense": "llama", "mod": "adaptive", "hybrid": "adaptive"}.get(arch, meta["format"])
        assert r["cls"] == classes[meta["format"]], (arch, meta)
        assert r["moe"] == ("native" if meta["format"] == "adaptive" else None), arch
        assert r["new"] == 8 and r["text"].startswith("The lawyer is a"), r
        assert r["loss"] < 7.2, r  # trained: below ln(2048) = 7.62 of a uniform guess


@pytest.mark.slow  # real recipe runs
def test_debug_moe_trains_on_two_processes_with_expert_parallelism(tmp_path):
    out = tmp_path / "run"
    flags = ["--max-steps", "30", "--ep-size", "2", "--ds-config", str(REPO / "ds_configs" / "zero2_moe.json"),
             "--output-dir", str(out), "--log-every", "5", "--seq-len", "64", "--no-progress"]
    done = accelerate_launch(REPO / "recipes" / "debug_moe.py", flags, nproc=2, home=tmp_path,
                             ADAPTIVE_CACHE=str(tmp_path / "cache"))
    assert done.returncode == 0, tail(done)
    start = records(out, "start")[0]
    assert start["world_size"] == 2 and start["knobs"]["ep_size"] == 2 and start["knobs"]["zero_stage"] == 2
    train = records(out, "train")
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, [r["loss"] for r in train]
    # both ranks' tokens are counted: 2 ranks x 5 steps x 4 x 64 tokens, twice (top-2), per layer
    assert all(sum(layer) == 2 * 2 * 5 * 4 * 64 for layer in train[-1]["expert_counts"])
    saved = json.loads((out / "hf" / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(out / "hf" / "model.safetensors"), "pt") as f:
        if saved["model_type"] == "mixtral":  # the portable export, saved by transformers in Mixtral's checkpoint layout
            keys = [k for k in f.keys() if "layers.0.block_sparse_moe.experts." in k]
            experts = {k.split("experts.")[1].split(".")[0] for k in keys}
            rank0, rank1 = (f.get_tensor(f"model.layers.0.block_sparse_moe.experts.{i}.w3.weight") for i in (0, 4))
        else:
            assert (saved["moe_implementation"], saved["ep_size"]) == ("native", 1)
            keys = [k for k in f.keys() if "layers.0." in k and "experts" in k]
            experts = {k.split("deepspeed_experts.")[1].split(".")[0] for k in keys}
            rank0, rank1 = (f.get_tensor(f"model.layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.{i}.up_proj.weight")
                            for i in (0, 4))
    assert experts == {str(i) for i in range(8)}, "the export gathers both ranks' experts"
    assert not (rank0 == rank1).all(), "each rank drew its own experts"
    ckpt = out / "checkpoints" / "step_00000030"
    assert len(list(ckpt.rglob("*expert*"))) >= 2  # DeepSpeed's per-expert checkpoint files


def test_the_docs_document_every_recipe_flag():
    from adaptive.config.run import TRAIN, options_for

    text = (REPO / "docs" / "training.md").read_text()
    section = text.split("## Recipe flags", 1)[1].split("\n## ", 1)[0]
    options = {name for _, _, flag in options_for(TRAIN) for name in (*flag.names, flag.negative)
               if name and name.startswith("--")}
    options.add("--dry-run")
    missing = {o for o in options if f"`{o}" not in section and f", {o}" not in section and f"/{o}`" not in section}
    assert not missing, f"docs/training.md's recipe flags table misses {sorted(missing)}"
