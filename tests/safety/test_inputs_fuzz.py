"""Bad input at every edge: config.json, --ds-config, --orchestrator-config, hostfiles and what reaches pdsh,
dataset rows, run folders for `adaptive report`, missing extras, and non-finite numbers. Each case: exit code 2,
one line on stderr naming the value and the rule, no traceback, and files that were there left byte for byte.

Commands run in-process through `cli.main.run` (the same one-line path as the `adaptive` script; typer's
CliRunner would bypass it); a subprocess only where a fresh interpreter is the point."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from adaptive.errors import AdaptiveError
from cli.main import run as cli
from tests.conftest import REPO_ROOT, subprocess_env

RECIPE = str(REPO_ROOT / "recipes" / "b1_mod.py")
LLAMA = dict(model_type="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
MIXTRAL = dict(LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
QWEN_MOE = dict(LLAMA, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2)
OURS = dict(LLAMA, model_type="adaptive", arch="dense", head_dim=64, block_types=["dense", "dense"])


def one_line(capsys, code: int, *needles: str) -> str:
    """The error line, after checking exit code 2, one line on stderr and no traceback."""
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def snapshot(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_error(call, *needles: str) -> str:
    with pytest.raises(AdaptiveError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


# ---------------------------------------------------------------------------------------------------------------
# 1. config.json

@pytest.mark.parametrize("cfg, needle", [
    (dict(LLAMA, hidden_size=-256), "hidden_size must be positive, got -256"),
    (dict(LLAMA, num_hidden_layers=0), "num_hidden_layers must be positive, got 0"),
    (dict(LLAMA, head_dim=-64), "head_dim must be positive"),
    (dict(LLAMA, head_dim=0), "head_dim must be positive"),
    (dict(LLAMA, intermediate_size=-1), "intermediate_size must be positive"),
    (dict(LLAMA, vocab_size=0), "vocab_size must be positive"),
    (dict(LLAMA, max_position_embeddings=-5), "max_position_embeddings must be positive"),
    (dict(MIXTRAL, num_experts_per_tok=8), "num_experts_per_tok (8) must be at most num_local_experts (4)"),
    (dict(MIXTRAL, num_local_experts=0), "num_local_experts must be positive, got 0"),
    (dict(QWEN_MOE, num_experts_per_tok=8), "num_experts_per_tok (8) must be at most num_experts (4)"),
    (dict(QWEN_MOE, decoder_sparse_step=0), "decoder_sparse_step must be positive"),
    (dict(QWEN_MOE, mlp_only_layers=3), "mlp_only_layers must be a list"),
    (dict(LLAMA, rope_theta="abc"), "rope_theta must be a number, got 'abc'"),
    (dict(LLAMA, rope_theta=-1.0), "rope_theta must be positive"),
    (dict(LLAMA, rope_parameters=[1]), "rope_parameters must be an object"),
    (dict(LLAMA, hidden_size="256"), "hidden_size must be an integer, got '256'"),
    (dict(LLAMA, hidden_size=True), "hidden_size must be an integer, got True"),
    (dict(LLAMA, hidden_size=256.0), "hidden_size must be an integer, got 256.0"),
    (dict(LLAMA, hidden_size=[256]), "hidden_size must be an integer, got [256]"),
    (dict(LLAMA, hidden_size=None), "hidden_size must be an integer, got None"),
    ({k: v for k, v in LLAMA.items() if k != "vocab_size"}, "lacks 'vocab_size'"),
    (dict(LLAMA, tie_word_embeddings="no"), "tie_word_embeddings must be true or false"),
    (dict(LLAMA, attention_bias="yes"), "attention_bias must be true or false"),
    (dict(LLAMA, _name_or_path=[1]), "_name_or_path must be a string"),
    (dict(LLAMA, hidden_size=250), "hidden_size (250) is not divisible by num_attention_heads (4)"),
    (dict(LLAMA, num_key_value_heads=3), "num_attention_heads (4) must be divisible by num_key_value_heads (3)"),
    (dict(LLAMA, model_type="lama"), "did you mean llama?"),
    (dict(OURS, vocab_size=-5), "vocab_size must be positive"),
    (dict(OURS, vocab_size="x"), "vocab_size must be an integer"),
    (dict(OURS, block_types=["dense", "foo"]), "unknown block type 'foo'"),
    (dict(OURS, num_hidden_layers=3), "block_types lists 2 layers, num_hidden_layers is 3"),
    (dict(OURS, arch="moe", block_types=["moe", "moe"], num_local_experts=2, num_experts_per_tok=4),
     "num_experts_per_tok (4) must be at most num_local_experts (2)"),
    (dict(OURS, mod_capacity=1.5), "mod_capacity must be at most 1"),
    (dict(OURS, arch="dnese"), "did you mean dense?"),
])
def test_a_bad_config_json_is_one_line_and_plans_nothing(tmp_path, capsys, cfg, needle):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    before = snapshot(tmp_path)
    code = cli(["fit", "--model", str(path), "--gpu", "a100", "--json"])
    one_line(capsys, code, needle)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("raw, needle", [
    (b'{"model_type": "llama",', "malformed config.json"),
    (b"", "malformed config.json"),
    (b"[1, 2]", "expected a JSON object, got list"),
    (b'"llama"', "expected a JSON object, got str"),
    (b'{"model_type": "llama\xff"}', "cannot read config.json"),
    (b"\x00\x01\xff\xfe", "cannot read config.json"),
])
def test_a_config_json_that_is_not_a_json_object_in_utf8_is_one_line(tmp_path, capsys, raw, needle):
    path = tmp_path / "config.json"
    path.write_bytes(raw)
    one_line(capsys, cli(["fit", "--model", str(path), "--gpu", "a100"]), needle)
    assert path.read_bytes() == raw


def test_good_configs_still_fit(tmp_path, capsys):
    for name, cfg in (("llama", dict(LLAMA, head_dim=None)), ("mixtral", MIXTRAL), ("qwen", QWEN_MOE), ("ours", OURS)):
        path = tmp_path / name / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(cfg))
        assert cli(["fit", "--model", str(path), "--gpu", "a100", "--json"]) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["fits"] is True


# ---------------------------------------------------------------------------------------------------------------
# 2. --ds-config: one reader for fit and the recipes, DeepSpeed's own check on the recipe side

BAD_DS = [
    ([1], "must hold a JSON object"),
    ({"zero_optimization": {"stage": "two"}}, 'zero_optimization.stage must be 0, 1, 2, 3 or "auto", got \'two\''),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage must be 0, 1, 2, 3"),
    ({"zero_optimization": {"stage": 1.0}}, "zero_optimization.stage must be 0, 1, 2, 3"),
    ({"zero_optimization": None}, "zero_optimization must be an object, got None"),
    ({"gradient_clipping": "nan"}, "gradient_clipping must be a finite number >= 0"),
    ({"gradient_clipping": -1}, "gradient_clipping must be a finite number >= 0"),
    ({"train_micro_batch_size_per_gpu": -4}, 'train_micro_batch_size_per_gpu must be a positive integer or "auto"'),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be a positive integer"),
    ({"train_batch_size": -1}, "train_batch_size must be a positive integer"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
     'zero_optimization.offload_optimizer.device must be "none", "cpu", "nvme" or "auto", got \'gpu\''),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}}, "offload_optimizer must be an object"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": -1}}, "reduce_bucket_size must be a positive integer"),
    ({"zero_optimization": {"stage": 2, "overlap_comm": "maybe"}}, "overlap_comm must be true or false"),
    ({"bf16": {"enabled": "yes"}}, 'bf16.enabled must be true, false or "auto"'),
    ({"bf16": [1]}, "bf16 must be an object"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "bf16.enabled and fp16.enabled are both true"),
    ({"optimizer": {"type": 3}}, "optimizer.type must be a string"),
    ({"optimizer": {"type": "AdamW", "params": [1]}}, "optimizer.params must be an object"),
]


@pytest.mark.parametrize("cfg, needle", BAD_DS)
def test_a_bad_ds_config_is_one_line_in_fit(tmp_path, capsys, cfg, needle):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    one_line(capsys, cli(["fit", "--model", "b1", "--gpu", "a100", "--ds-config", str(path), "--json"]), needle)
    assert path.read_text() == json.dumps(cfg)


@pytest.mark.parametrize("raw, needle", [
    (None, "does not exist"), (b"{nope", "is not valid JSON"), (b"\xff\xfe", "is not UTF-8 text"),
    (b"[]", "must hold a JSON object"),
])
def test_a_ds_config_that_is_no_json_object_is_one_line(tmp_path, capsys, raw, needle):
    path = tmp_path / "ds.json"
    if raw is not None:
        path.write_bytes(raw)
    one_line(capsys, cli(["fit", "--model", "b1", "--gpu", "a100", "--ds-config", str(path)]), needle)


def _plan_recipe(ds_path, env=None):
    from adaptive.config.commandline import parse
    from adaptive.plan import get_gpu
    from adaptive.train.run.runplan import Device, World, plan_run

    flags = ["--ds-config", str(ds_path)] if ds_path else []
    return plan_run(parse("train", flags), "b1", "dense", World(8, 8), Device("cuda", get_gpu("a100-80gb")), env or {})


@pytest.mark.parametrize("cfg, needle", BAD_DS)
def test_the_recipes_read_the_ds_config_with_the_same_reader(tmp_path, cfg, needle):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    one_line_error(lambda: _plan_recipe(path), needle)
    # the same file named by an accelerate config
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)}
    one_line_error(lambda: _plan_recipe(None, env), needle)


@pytest.mark.parametrize("cfg, needle", [
    ({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e8}},
     "reduce_bucket_sise is not a known key; did you mean reduce_bucket_size?"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memry": True}}},
     "offload_param.pin_memry is not a known key; did you mean pin_memory?"),
    ({"zero_optimization": {"stage": 1}, "amp": {"enabled": True}}, "DeepSpeed refuses the config: NVIDIA Apex AMP"),
])
def test_deepspeed_itself_checks_what_our_reader_passes(tmp_path, cfg, needle):
    from adaptive.train.run.runplan import check_with_deepspeed

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    run = _plan_recipe(path)  # our reader leaves keys it does not read to DeepSpeed
    one_line_error(lambda: check_with_deepspeed(run.ds_config, 8), needle)


def test_deepspeed_accepts_what_the_planner_emits():
    from adaptive.train.run.runplan import check_with_deepspeed

    check_with_deepspeed(_plan_recipe(None).ds_config, 8)
    check_with_deepspeed(_plan_recipe(REPO_ROOT / "ds_configs" / "zero3_offload_all.json").ds_config, 8)


@pytest.mark.slow  # a recipe process starts DeepSpeed (on a fresh machine it compiles its comm op first)
def test_a_recipe_with_a_config_deepspeed_refuses_stops_before_training(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 1, "reduce_bucket_sise": 5e8}}))
    done = subprocess.run([sys.executable, str(REPO_ROOT / "recipes" / "debug_dense.py"), "--ds-config", str(ds),
                           "--max-steps", "1", "--output-dir", str(tmp_path / "run")], capture_output=True, text=True,
                          env=subprocess_env(ADAPTIVE_CACHE=str(tmp_path / "cache")), timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    # stderr is the one line; on a fresh machine the run's notice that it compiles DeepSpeed's CPU comm op, and in
    # how long, goes to stdout
    lines = done.stderr.strip().splitlines()
    assert lines == ["error: DeepSpeed refuses the config's zero_optimization: "
                     "reduce_bucket_sise is not a known key; did you mean reduce_bucket_size?"]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------------------
# 3. --orchestrator-config, checked when the recipe starts and by launch before it writes anything

@pytest.mark.parametrize("text, needle", [
    ('{"balance": {"rate": "fast"}}', "balance.rate"),
    ('{"balance": {"rate": NaN}}', "balance.rate"),
    ('{"guard": {"bad_steps": true}}', "guard.bad_steps"),
    ('{"guard": {"bad_steps": "3"}}', "guard.bad_steps"),
    ('{"capacity": {"max_factor": -1, "min_factor": 10}}', "need 0 < min_factor <= max_factor"),
    ('{"capacity": {"max_factor": 2, "min_factor": 10}}', "need 0 < min_factor <= max_factor"),
    ('{"balanse": {}}', "did you mean balance?"),
    ('{"guard": {"bad_step": 3}}', "did you mean bad_steps?"),
    ('{"guard": [1]}', "must be an object of fields"),
    ("[1]", "neither a JSON object nor a file"),
    ("{x", "is not valid JSON"),
])
def test_bad_orchestrator_settings_are_one_line_before_training(tmp_path, capsys, text, needle):
    from adaptive.recipe import main

    one_line(capsys, main("debug", "dense", ["--gpu", "a100", "--dry-run", "--orchestrator-config", text]), needle)
    run_dir = tmp_path / "run"
    one_line(capsys, cli(["launch", RECIPE, "--gpu", "a100", "--dry-run", "--orchestrator-config", text,
                          "--run-dir", str(run_dir)]), needle)
    assert not run_dir.exists(), "launch wrote the run folder before refusing"


def test_orchestrator_policies_naming_nothing_and_a_binary_settings_file(tmp_path, capsys):
    from adaptive.recipe import main

    one_line(capsys, main("debug", "dense", ["--gpu", "a100", "--dry-run", "--orchestrator-policies", ",,"]),
             "names no policy")
    binary = tmp_path / "settings.json"
    binary.write_bytes(b"\xff\xfe{")
    one_line(capsys, main("debug", "dense", ["--gpu", "a100", "--dry-run", "--orchestrator-config", str(binary)]),
             "is not UTF-8 text")


# ---------------------------------------------------------------------------------------------------------------
# 4. Hostfiles and what could reach pdsh's remote shell

class TestInjection:
    """Hostile host names, addresses, ports and paths are refused before any command is built or any file is
    written; the marker file a successful injection would create never appears."""

    @pytest.fixture
    def marker(self, tmp_path):
        path = tmp_path / "pwned"
        yield path
        assert not path.exists(), "an injected command ran"

    def _launch(self, capsys, tmp_path, *extra, hosts="node-a slots=2\nnode-b slots=2\n", dry_run=True):
        hostfile = tmp_path / "hosts"
        hostfile.write_text(hosts)
        before = snapshot(tmp_path)
        args = ["launch", RECIPE, "--gpu", "a100", "--gpus", "2", "--nodes", "2", "--hostfile", str(hostfile),
                *(["--dry-run"] if dry_run else [])]
        if "--run-dir" not in extra:
            args += ["--run-dir", str(tmp_path / "run")]
        code = cli([*args, *extra])
        err = one_line(capsys, code)
        assert snapshot(tmp_path) == before, "something was written"
        return err

    @pytest.mark.parametrize("host", ["node-a;touch${IFS}MARKER;", "$(touch MARKER)", "`touch MARKER`",
                                      "node-a&&touch${IFS}MARKER", "-oProxyCommand=touch${IFS}MARKER"])
    @pytest.mark.parametrize("dry_run", [True, False])
    def test_hostile_host_names_in_the_hostfile(self, capsys, tmp_path, marker, host, dry_run):
        hosts = f"{host.replace('MARKER', str(marker))} slots=2\nnode-b slots=2\n"
        err = self._launch(capsys, tmp_path, hosts=hosts, dry_run=dry_run)
        assert "is not `HOST slots=N`" in err or "is not a host name" in err

    @pytest.mark.parametrize("ip", ["1.2.3.4;id", "10.0.0.1;touch${IFS}MARKER", "$(touch MARKER)", "1.2.3.4 -x"])
    def test_hostile_main_process_ip(self, capsys, tmp_path, marker, ip):
        err = self._launch(capsys, tmp_path, "--main-process-ip", ip.replace("MARKER", str(marker)))
        assert "--main-process-ip" in err and "is not a host name" in err

    @pytest.mark.parametrize("flag", ["--run-dir", "--output-dir"])
    def test_hostile_run_folders_never_reach_pdsh(self, capsys, tmp_path, marker, flag):
        err = self._launch(capsys, tmp_path, flag, f"{tmp_path}/run;touch${{IFS}}{marker}")
        assert "cannot go to the hosts' shell through pdsh" in err

    def test_hostile_recipe_arguments_never_reach_pdsh(self, capsys, tmp_path, marker):
        # a string the recipe's parser takes: the pdsh guard refuses it
        err = self._launch(capsys, tmp_path, "--", "--dataset", f"x;touch${{IFS}}{marker}")
        assert "cannot go to the hosts' shell through pdsh" in err
        # a value the recipe's parser refuses never gets as far (adaptive launch checks the recipe's argv first)
        err = self._launch(capsys, tmp_path, "--", "--seed", f"1;touch${{IFS}}{marker}")
        assert "Invalid value for '--seed'" in err

    @pytest.mark.parametrize("hosts, needle", [
        ("node-a slots=abc\nnode-b slots=2\n", "is not `HOST slots=N`"),
        ("node-a slots=0\nnode-b slots=2\n", "slots must be >= 1"),
        ("node-a slots=2\nnode-a slots=2\n", "lists node-a twice"),
        ("node-a slots=2\n", "lists 1 hosts but --nodes is 2"),
        ("node-a slots=4\nnode-b slots=2\n", "slots must equal --gpus (2)"),
    ])
    def test_malformed_hostfiles(self, capsys, tmp_path, hosts, needle):
        assert needle in self._launch(capsys, tmp_path, hosts=hosts)

    @pytest.mark.parametrize("port", ["0", "70000", "-1"])
    def test_ports_out_of_range(self, capsys, tmp_path, port):
        assert "--main-process-port" in self._launch(capsys, tmp_path, "--main-process-port", port)


# ---------------------------------------------------------------------------------------------------------------
# 5. Dataset rows

GOOD_ROW = json.dumps({"text": "the cynic wit folly virtue " * 20})


@pytest.mark.parametrize("line, needle", [
    ('{"text": 5}', ":4: 'text' must be a string of text, got number 5"),
    ('{"text": null}', ":4: 'text' must be a string of text, got null"),
    ('{"text": ["a"]}', ':4: \'text\' must be a string of text, got array ["a"]'),
    ('{"text": "a"', ":4 is not JSON"),
    ('{"body": "a"}', ":4 has no 'text' field (fields: body); a row needs 'text' (documents), 'messages' (chats) "
                      "or 'prompt' and 'completion'; for documents in another field pass --text-field NAME"),
    ('{"conversations": [{"from": "human", "value": "a"}]}', ":4 has 'conversations' (ShareGPT's from/value turns)"),
    ("[1, 2]", ":4 is a JSON array, not an object"),
    ("42", ":4 is a JSON number, not an object"),
])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_bad_row_names_its_file_line_and_field(tmp_path, line, needle, streaming):
    from adaptive.train.data.sources import DataConfig, load_text_dataset

    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([GOOD_ROW] * 3 + [line] + [GOOD_ROW] * 3) + "\n")
    cfg = DataConfig(dataset=str(path), seq_len=16, cache_dir=str(tmp_path / "hf"), streaming=streaming)
    one_line_error(lambda: load_text_dataset(cfg, streaming=streaming), f"{path}{needle}")


def test_binary_garbage_and_a_json_array_file(tmp_path):
    from adaptive.train.data.sources import DataConfig, load_text_dataset

    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b"\x00\x01\xff\xfe\x80garbage\n")
    one_line_error(lambda: load_text_dataset(DataConfig(dataset=str(garbage), seq_len=16)),
                   f"{garbage}:1 is not UTF-8 text")
    array = tmp_path / "docs.json"
    array.write_text(json.dumps([{"text": "fine"}, {"text": 7}]))
    one_line_error(lambda: load_text_dataset(DataConfig(dataset=str(array), seq_len=16)),
                   f"{array}: item 2: 'text' must be a string of text, got number 7")


def test_an_empty_file_is_one_line(tmp_path):
    from adaptive.train.data.packing import build_datasets
    from adaptive.train.data.sources import DataConfig
    from adaptive.train.data.tokenizer import load_tokenizer

    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    tokenizer = load_tokenizer(None)
    one_line_error(lambda: build_datasets(DataConfig(dataset=str(empty), seq_len=16, cache_dir=str(tmp_path)),
                                          tokenizer), "has 0 tokens, too few")


def test_a_recipe_with_a_bad_row_stops_in_one_line_before_the_run(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join([GOOD_ROW] * 5 + ['{"text": 5}']) + "\n")
    done = subprocess.run([sys.executable, str(REPO_ROOT / "recipes" / "debug_dense.py"), "--dataset", str(data),
                           "--max-steps", "1", "--output-dir", str(tmp_path / "run")], capture_output=True, text=True,
                          env=subprocess_env(ADAPTIVE_CACHE=str(tmp_path / "cache")), timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: {data}:6: 'text' must be a string of text, got number 5"]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------------------
# 6. adaptive report on odd run folders

TRAIN_ROWS = [json.dumps({"kind": "train", "step": s, "loss": 7.0 - 0.1 * s, "ppl": 100.0, "tokens_seen": 256 * s})
              for s in (1, 2, 3)]


@pytest.mark.parametrize("extra, skipped", [
    (b"{garbage\nnot json at all\n", 2),
    (b"\xff\xfe\x00\x01\n", 1),
    (b'[1, 2]\n42\n"s"\n', 3),
    (b'{"kind": "train"}\n{"kind": "train", "step": "x"}\n{"kind": "train", "step": 4, "loss": "low"}\n', 3),
    (b'{"kind": "train", "step": 4, "expert_counts": [[1, 2], [3, 4]]}\n'
     b'{"kind": "train", "step": 5, "expert_counts": [[1, 2, 3]]}\n', 1),
])
def test_report_skips_odd_lines_and_says_how_many_in_one_warning(tmp_path, capsys, extra, skipped):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(("\n".join(TRAIN_ROWS) + "\n").encode() + extra)
    before = metrics.read_bytes()
    assert cli(["report", str(tmp_path), "--out", str(tmp_path / "out" / "r.png")]) == 0
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [err.strip()] and f"skipped {skipped} line(s)" in err, err
    assert metrics.read_bytes() == before


def test_report_refuses_a_folder_without_records_in_one_line(tmp_path, capsys):
    one_line(capsys, cli(["report", str(tmp_path)]), "has no metrics.jsonl")
    (tmp_path / "metrics.jsonl").write_bytes(b"\xff\n[1]\n{\"kind\": \"train\"}\n")
    one_line(capsys, cli(["report", str(tmp_path)]), "has no training records yet (3 unreadable line(s) skipped)")
    (tmp_path / "metrics.jsonl").write_text("\n".join(TRAIN_ROWS))
    (tmp_path / "events.jsonl").write_bytes(b"\xff\n{\"kind\": \"decision\", \"step\": \"x\"}\n")
    assert cli(["report", str(tmp_path), "--out", "/proc/nowhere/r.png"]) == 2
    assert "cannot write the report" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# 7. A planner-only install: commands that need the extras say how to install them

BLOCK = "import sys\nfor m in ('torch', 'matplotlib', 'deepspeed', 'accelerate', 'transformers'): sys.modules[m] = None\n"


@pytest.mark.parametrize("args, needle", [
    (["measure", "--model", "debug"], "adaptive measure needs torch, transformers"),
    (["report", "."], "adaptive report needs matplotlib"),
    (["export", "."], "adaptive export needs torch, transformers"),
    (["launch", RECIPE, "--gpu", "a100", "--run-dir", "RUN"], "adaptive launch needs accelerate, torch"),
    (["launch", RECIPE, "--dry-run", "--run-dir", "RUN"], "finding the GPU (no --gpu given) needs torch"),
])
def test_a_planner_only_install_names_the_install_command(tmp_path, args, needle):
    args = [a.replace("RUN", str(tmp_path / "run")) for a in args]
    code = BLOCK + f"from cli.main import run\nsys.exit(run({args!r}))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "pip install" in lines[0], done.stderr
    assert not (tmp_path / "run").exists()


def test_a_recipe_in_a_planner_only_install_says_what_to_install(tmp_path):
    code = BLOCK + "from adaptive.recipe import main\nsys.exit(main('debug', 'dense', ['--max-steps', '1']))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert 'training needs torch, deepspeed, accelerate, transformers' in done.stderr
    from adaptive.extras import TRAIN_INSTALL

    assert TRAIN_INSTALL in done.stderr and "download.pytorch.org/whl/cpu" in done.stderr


def test_the_planner_still_works_without_the_extras(tmp_path):
    code = BLOCK + "from cli.main import run\nsys.exit(run(['fit', '--model', 'b1', '--gpu', 'a100', '--json']))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and json.loads(done.stdout)["fits"] is True, done.stderr


def test_require_reads_find_spec(monkeypatch):
    import importlib.util

    from adaptive.extras import require

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "seaborn" else real(name, *a))
    monkeypatch.setitem(__import__("adaptive.extras").extras.NEEDS, "plotting", (("seaborn",), "pip install seaborn"))
    monkeypatch.delitem(sys.modules, "seaborn", raising=False)
    one_line_error(lambda: require("plotting"), "plotting needs seaborn, which this install lacks: pip install seaborn")


# ---------------------------------------------------------------------------------------------------------------
# 8. Non-finite and negative numbers on recipes and launch

@pytest.mark.parametrize("flag, value, needle", [
    ("--lr", "nan", "--lr must be a finite number"), ("--lr", "inf", "--lr must be a finite number"),
    ("--lr", "-1e-3", "--lr must be positive"), ("--lr", "0", "--lr must be positive"),
    ("--weight-decay", "-0.1", "--weight-decay must be >= 0"), ("--weight-decay", "nan", "must be a finite number"),
    ("--weight-decay", "inf", "must be a finite number"), ("--tokens", "nan", "--tokens must be a finite number"),
    ("--tokens", "-5", "--tokens must be positive"), ("--warmup-steps", "-1", "--warmup-steps must be >= 0"),
    ("--max-steps", "0", "--max-steps must be positive"), ("--seed", "-1", "--seed must be >= 0"),
    ("--micro-batch", "0", "--micro-batch must be positive"), ("--zero", "4", "--zero must be <= 3"),
])
def test_bad_numbers_are_refused_at_parse_time_by_recipes_and_launch(tmp_path, capsys, flag, value, needle):
    from adaptive.recipe import main

    one_line(capsys, main("debug", "dense", ["--gpu", "a100", "--dry-run", flag, value]), needle)
    run_dir = tmp_path / "run"
    one_line(capsys, cli(["launch", RECIPE, "--gpu", "a100", "--dry-run", "--run-dir", str(run_dir), flag, value]),
             needle)
    assert not run_dir.exists()
