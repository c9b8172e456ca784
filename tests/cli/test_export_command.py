"""`adaptive export RUN_DIR --format ...`: converts a run's HF export, says why when it cannot."""

from __future__ import annotations

import json

import pytest
import torch

from tests.cli.test_cli import adaptive


def tiny_export(run_dir, arch: str) -> None:
    from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM

    torch.manual_seed(0)
    config = AdaptiveConfig.from_preset("debug", arch=arch, vocab_size=128, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        moe_intermediate_size=32)
    AdaptiveForCausalLM(config).save_pretrained(run_dir / "hf")
    (run_dir / "hf" / "adaptive_export.json").write_text(json.dumps({"step": 7, "format": "adaptive"}))
    (run_dir / "hf" / "tokenizer.json").write_text("{}")


def test_export_converts_a_dense_run_to_llama(tmp_path):
    tiny_export(tmp_path, "dense")
    done = adaptive("export", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["format"] == "llama" and result["path"] == str(tmp_path / "hf-llama")
    assert json.loads((tmp_path / "hf-llama" / "config.json").read_text())["model_type"] == "llama"
    meta = json.loads((tmp_path / "hf-llama" / "adaptive_export.json").read_text())
    assert meta["step"] == 7 and meta["format"] == "llama"  # the run's metadata carried over
    assert (tmp_path / "hf-llama" / "tokenizer.json").exists()


def test_export_refuses_an_impossible_format_in_one_line(tmp_path):
    tiny_export(tmp_path, "mod")
    done = adaptive("export", str(tmp_path), "--format", "llama")
    assert done.returncode == 2
    assert done.stderr.startswith("error: cannot export as llama: Llama has only dense blocks")
    assert len(done.stderr.strip().splitlines()) == 1


def portable_export(run_dir, arch: str, export_format: str):
    """A run whose final export is already portable, as the loop writes it for a dense or plain MoE model."""
    from adaptive.models import AdaptiveForCausalLM
    from adaptive.models.export import export_pretrained

    tiny_export(run_dir / "source", arch)
    model = AdaptiveForCausalLM.from_pretrained(run_dir / "source" / "hf")
    export_pretrained(model, run_dir / "hf", export_format)
    return model


def test_an_export_that_already_is_llama_is_said_to_be_and_left_as_it_is(tmp_path):
    portable_export(tmp_path, "dense", "llama")
    before = sorted(p.name for p in tmp_path.iterdir())
    done = adaptive("export", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result == {"path": str(tmp_path / "hf"), "format": "llama", "written": False,
                      "reason": "already llama: it loads as LlamaForCausalLM as it is; nothing to export"}
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    shown = adaptive("export", str(tmp_path), "--format", "llama")
    assert shown.returncode == 0 and "already llama" in shown.stdout


def test_a_mixtral_export_converts_to_adaptive_with_the_same_logits_and_refuses_llama_in_one_line(tmp_path):
    from transformers import MixtralForCausalLM

    from adaptive.models import AdaptiveForCausalLM

    portable_export(tmp_path, "moe", "mixtral")
    done = adaptive("export", str(tmp_path), "--format", "adaptive", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["path"], result["format"], result["written"]) == (str(tmp_path / "hf-adaptive"), "adaptive", True)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = AdaptiveForCausalLM.from_pretrained(tmp_path / "hf-adaptive").eval()(ids).logits
        theirs = MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    refused = adaptive("export", str(tmp_path), "--format", "llama")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert refused.stderr.startswith("error: cannot export as llama:"), refused.stderr


@pytest.mark.slow  # three exports, each a fresh interpreter with torch and transformers
def test_export_replaces_an_old_conversion_whole_and_never_a_folder_that_is_not_one(tmp_path):
    tiny_export(tmp_path, "dense")
    stale = tmp_path / "hf-llama" / "stale.safetensors"
    assert adaptive("export", str(tmp_path)).returncode == 0
    stale.write_text("left by an older conversion")
    assert adaptive("export", str(tmp_path), "--force").returncode == 0
    assert not stale.exists() and (tmp_path / "hf-llama" / "config.json").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left beside
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    done = adaptive("export", str(tmp_path), "--out", str(mine))
    assert done.returncode == 2 and "is not an adaptive export" in done.stderr
    assert (mine / "notes.txt").read_text() == "keep me"


def routed_export(run_dir, step: int, seed: int = 0) -> None:
    """A MoD run's final export as the loop writes it: adaptive format, with its modeling code."""
    from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
    from adaptive.models.export import export_pretrained

    torch.manual_seed(seed)
    config = AdaptiveConfig.from_preset("debug", arch="mod", vocab_size=128, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    export_pretrained(AdaptiveForCausalLM(config), run_dir / "hf")
    (run_dir / "hf" / "adaptive_export.json").write_text(json.dumps({"step": step, "format": "adaptive"}))


def mtimes(folder):
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def test_an_adaptive_export_with_its_code_is_the_export_nothing_is_written_unless_forced(tmp_path):
    routed_export(tmp_path, step=40)
    before = mtimes(tmp_path / "hf")
    done = adaptive("export", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{tmp_path / 'hf'}: already holds step 40's export (adaptive format); nothing to " \
                                  "do (--force rewrites it)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and mtimes(tmp_path / "hf") == before
    forced = adaptive("export", str(tmp_path), "--force", "--json")
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout)["written"] is True
    assert (tmp_path / "hf-adaptive" / "modeling_adaptive.py").is_file()


def test_a_conversion_is_not_redone_for_the_same_export_but_is_for_a_newer_one(tmp_path):
    tiny_export(tmp_path, "dense")  # adaptive format, step 7: converts to llama
    assert adaptive("export", str(tmp_path)).returncode == 0
    before = mtimes(tmp_path / "hf-llama")
    again = adaptive("export", str(tmp_path))
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"{tmp_path / 'hf-llama'}: already holds step 7's export (llama format); nothing " \
                                   "to do (--force rewrites it)"
    assert mtimes(tmp_path / "hf-llama") == before
    tiny_export(tmp_path, "dense")  # the run exported again (a later step)
    (tmp_path / "hf" / "adaptive_export.json").write_text(json.dumps({"step": 9, "format": "adaptive"}))
    newer = adaptive("export", str(tmp_path), "--json")
    assert newer.returncode == 0, newer.stderr
    assert json.loads(newer.stdout)["written"] is True
    assert mtimes(tmp_path / "hf-llama") != before
    assert json.loads((tmp_path / "hf-llama" / "adaptive_export.json").read_text())["step"] == 9


def qwen3_finetune_export(run_dir) -> None:
    """A fine-tune of a transformers family as the loop writes it: hf/ holds transformers' own Qwen3 (merged)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    Qwen3ForCausalLM(config).save_pretrained(run_dir / "hf")
    (run_dir / "hf" / "adaptive_export.json").write_text(json.dumps({"step": 5, "finetune": "lora"}))


def test_a_finetune_of_another_transformers_family_is_its_own_export_and_an_explicit_format_is_one_line(tmp_path):
    qwen3_finetune_export(tmp_path)
    before = mtimes(tmp_path / "hf")
    done = adaptive("export", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{tmp_path / 'hf'}: already qwen3: transformers' own Qwen3ForCausalLM, loadable " \
                                  "by AutoModelForCausalLM as it is; nothing to convert"
    as_json = adaptive("export", str(tmp_path), "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) | {"reason": None} == {"path": str(tmp_path / "hf"), "format": "qwen3",
                                                             "written": False, "reason": None}
    for asked in ("llama", "mixtral", "adaptive"):
        refused = adaptive("export", str(tmp_path), "--format", asked)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert refused.stderr.startswith(f"error: cannot export as {asked}: "), refused.stderr
        assert "Qwen3ForCausalLM" in refused.stderr and "--format auto" in refused.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and mtimes(tmp_path / "hf") == before
