"""ZeRO-Infinity under a fine-tune: `--zero 3 --offload nvme|nvme-optimizer --nvme-path DIR` trains a LoRA and a full
fine-tune of transformers' Llama on this CPU, with DeepSpeed's async_io op (libaio-dev; .ci/run installs it).

The checkpoint is a 2-layer Llama of hidden 256 in fp32 with the 2048-token vocabulary, so that its embedding and
head (2 MiB each) are swapped: DeepSpeed never swaps a tensor under 1 MiB (swap_tensor/utils.py MIN_AIO_BYTES). The
LoRA has rank 32 on every linear (286,720 trained parameters, 1.1 MiB in fp32), so its optimizer sub-group is swapped
too. Each run trains 8 steps at a high LR (the loss must fall clearly), records the files under --nvme-path at every
step end (DeepSpeed deletes them when the engine goes), and is compared with the same run under CPU offload
(`--offload all` / `optimizer`: the same DeepSpeedCPUAdam on the same partitions), whose losses it must equal.

DeepSpeed's async_io op is built by the module's fixture if it is not yet (minutes the first time; its own budget),
and the tests skip, saying why, where it cannot be (no libaio). What happens then is test_nvme_check.py's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.orchestrator._launch import read_records
from tests.train.finetune._checkpoints import write_chat, write_llama
from tests.train._launch import REPO, free_port, launch_env

pytestmark = pytest.mark.slow  # DeepSpeed's async_io op (built once) and four ZeRO-3 fine-tunes

DRIVER = REPO / "tests" / "train" / "finetune_extras" / "_driver.py"
BUILD_BUDGET_S = 1800  # async_io (+ pin_memory) and cpu_adam from scratch: ~7-15 min and ~2-4 min on 2 loaded cores
RUN_BUDGET_S = 300  # one warm run takes ~20 s here
STEPS = 8
FLAGS = ["--zero", "3", "--seq-len", "64", "--micro-batch", "4", "--max-steps", str(STEPS), "--log-every", "1",
         "--no-progress", "--orchestrator", "off"]
METHOD_FLAGS = {"lora": ["--lr", "2e-3", "--lora-rank", "32"], "full": ["--lr", "3e-4"]}
# (name, method, offload, its CPU-offload twin): each method and each mode once (all four pairs also pass; the
# suite's time keeps two)
RUNS = [("lora_nvme", "lora", "nvme", "all"), ("full_nvme_optimizer", "full", "nvme-optimizer", "optimizer")]
MIB = 2**20


@pytest.fixture(scope="module")
def nvme_ops(tmp_path_factory):
    """DeepSpeed's async_io and cpu_adam ops loadable here (built now if they are not): torch's lock in each op's
    folder keeps a second process from building one at the same time, so a machine builds each once."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tests.train.finetune_extras._nvme_ops"], cwd=REPO, capture_output=True,
                          text=True, timeout=BUILD_BUDGET_S, env=launch_env(tmp_path_factory.mktemp("ops_home")))
    if done.returncode == 3:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    print(f"DeepSpeed ops for NVMe offload ready in {time.monotonic() - started:.0f} s:\n{done.stdout}")


@pytest.fixture(scope="module")
def runs(nvme_ops, tmp_path_factory):
    """Every run of RUNS and its CPU-offload twin, two at a time (each single-threaded); their folders."""
    root = tmp_path_factory.mktemp("finetune_nvme")
    checkpoint = write_llama(root / "tiny-llama", hidden=256, layers=2)
    data = write_chat(root / "chat.jsonl")
    jobs = []
    for name, method, offload, twin in RUNS:
        for kind, device in ((name, offload), (f"{name}_cpu", twin)):
            out = root / kind
            nvme = out.with_name(f"{kind}_swap")
            spec = {"record": str(out / "recorded"), **({"swap_files": str(nvme)} if "nvme" in device else {})}
            if "nvme" in device:
                nvme.mkdir()
            flags = ["--init-from", str(checkpoint), "--dataset", str(data), "--finetune", method, *METHOD_FLAGS[method],
                     *FLAGS, "--offload", device, *(["--nvme-path", str(nvme)] if "nvme" in device else []),
                     "--output-dir", str(out)]
            jobs.append((kind, out, spec, flags))
    results, failed = {}, []
    for i in range(0, len(jobs), 2):
        procs = []
        for kind, out, spec, flags in jobs[i:i + 2]:
            home = root / f"home_{kind}"
            home.mkdir()
            command = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision",
                       "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), "--use_deepspeed",
                       "--num_processes", "1", str(DRIVER), json.dumps(spec), "--", *flags]
            log = open(root / f"{kind}.log", "w")
            procs.append((kind, out, log, time.monotonic(), subprocess.Popen(
                command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                env=launch_env(home, ADAPTIVE_CACHE=str(home / "cache")))))
        for kind, out, log, started, proc in procs:
            code = proc.wait(timeout=RUN_BUDGET_S)
            log.close()
            print(f"{kind}: exit {code} in {time.monotonic() - started:.0f} s")
            if code != 0:
                failed.append(f"{kind} exited {code}:\n" + (root / f"{kind}.log").read_text()[-3000:])
            results[kind] = out
    assert not failed, "\n".join(failed)
    return results


def losses(out) -> list[float]:
    return [r["loss"] for r in sorted(read_records(out, "train"), key=lambda r: r["step"])]


def swapped(out) -> list[dict]:
    """Per step end: bytes under the NVMe folder by kind (DeepSpeed's folders: <dtype>params, optimizer)."""
    seen = json.loads((out / "recorded" / "swap_files.json").read_text())
    per_step = []
    for entry in seen:
        kinds: dict[str, int] = {}
        for path, size in entry["files"].items():
            kind = "params" if "params" in path.split("/")[1] else path.split("/")[1]
            kinds[kind] = kinds.get(kind, 0) + size
        per_step.append(kinds)
    return per_step


@pytest.mark.parametrize("name, method, offload, twin", RUNS, ids=[r[0] for r in RUNS])
def test_a_fine_tune_trains_under_nvme_offload_and_swaps_to_the_drive(runs, name, method, offload, twin):
    out = runs[name]
    loss = losses(out)
    assert len(loss) == STEPS and all(x is not None for x in loss)
    assert loss[-1] < loss[0] - 0.3, loss  # it trains
    # the same run with the states in host RAM: the same optimizer on the same partitions, the same losses
    assert loss == pytest.approx(losses(runs[f"{name}_cpu"]), abs=1e-4)
    config = json.loads((out / "ds_config.json").read_text())
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "nvme"
    assert ("offload_param" in zero and zero["offload_param"]["device"] == "nvme") == (offload == "nvme")
    if offload == "nvme" and method == "lora":
        assert zero["stage3_prefetch_bucket_size"] == 0  # else "param already assigned swap buffer id" at step 1
    per_step = swapped(out)
    assert len(per_step) == STEPS
    for kinds in per_step:  # the files are there while the engine trains
        assert kinds.get("optimizer", 0) > 1 * MIB, kinds
        if offload == "nvme":
            assert kinds.get("params", 0) >= 2 * 2 * MIB, kinds  # the embedding and the head at least, fp32
        else:
            assert "params" not in kinds, kinds
    start = read_records(out, "start")[0]
    assert start["finetune"] == method and start["knobs"]["offload_optimizer"] is True
    assert start["knobs"]["offload_params"] is (offload == "nvme")


def test_the_lora_run_exports_an_adapter_and_a_merged_model_from_the_nvme_run(runs):
    out = runs["lora_nvme"]
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "hf" / "model.safetensors").is_file()
    metadata = json.loads((out / "hf" / "adaptive_export.json").read_text())
    assert metadata["format"] == "merged"
