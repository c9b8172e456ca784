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


@pytest.mark.slow  # three exports, each a fresh interpreter with torch and transformers
def test_export_replaces_an_old_conversion_whole_and_never_a_folder_that_is_not_one(tmp_path):
    tiny_export(tmp_path, "dense")
    stale = tmp_path / "hf-llama" / "stale.safetensors"
    assert adaptive("export", str(tmp_path)).returncode == 0
    stale.write_text("left by an older conversion")
    assert adaptive("export", str(tmp_path)).returncode == 0
    assert not stale.exists() and (tmp_path / "hf-llama" / "config.json").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left beside
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    done = adaptive("export", str(tmp_path), "--out", str(mine))
    assert done.returncode == 2 and "is not an adaptive export" in done.stderr
    assert (mine / "notes.txt").read_text() == "keep me"
