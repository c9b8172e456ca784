"""An adaptive-format export (MoD, hybrid) carries its modeling code and auto_map: transformers loads and runs it
with trust_remote_code=True in a process where `import adaptive` fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
from adaptive.models.export import AUTO_MAP, code_files, export_pretrained, has_remote_code

# the fresh process: adaptive is installed (editable) in this venv, so a meta path finder in front refuses it
FRESH = textwrap.dedent("""
    import sys

    class NoAdaptive:
        def find_spec(self, name, path=None, target=None):
            if name == "adaptive" or name.startswith("adaptive."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, NoAdaptive())
    try:
        import adaptive  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("adaptive is importable: the test would prove nothing")

    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    ids = torch.load(sys.argv[1])
    for path in sys.argv[3:]:
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        with torch.no_grad():
            logits = model(ids).logits
        generated = model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
        out[path] = {"logits": logits, "generated": generated, "class": type(model).__name__}
    assert not [m for m in sys.modules if m == "adaptive" or m.startswith("adaptive.")]
    torch.save(out, sys.argv[2])
""")


def tiny(arch: str) -> AdaptiveForCausalLM:
    torch.manual_seed(0)
    config = AdaptiveConfig.from_preset("debug", arch=arch, vocab_size=128, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        moe_intermediate_size=32)
    return AdaptiveForCausalLM(config).eval()


def test_the_export_code_imports_only_torch_transformers_and_its_own_files(tmp_path):
    from transformers.dynamic_module_utils import get_imports, get_relative_imports

    files = code_files()
    assert {"configuration_adaptive.py", "modeling_adaptive.py", "mod.py", "moe.py"} <= set(files)
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    allowed = {"torch", "transformers", "huggingface_hub", "safetensors"}
    for name in files:
        third_party = {m for m in get_imports(tmp_path / name) if m not in sys.stdlib_module_names}
        assert third_party <= allowed, (name, third_party)
        assert {f"{m}.py" for m in get_relative_imports(tmp_path / name)} <= set(files), name


@pytest.mark.parametrize("arch", ["mod", "hybrid"])
def test_a_routed_export_names_its_classes_in_auto_map_and_holds_their_files(tmp_path, arch):
    chosen = export_pretrained(tiny(arch), tmp_path / arch)
    assert chosen.format == "adaptive"
    config = json.loads((tmp_path / arch / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and config["model_type"] == "adaptive"
    assert has_remote_code(tmp_path / arch)
    (tmp_path / arch / "mod.py").unlink()
    assert not has_remote_code(tmp_path / arch)


def test_mod_and_hybrid_exports_load_and_generate_without_adaptive(tmp_path):
    ids = torch.randint(1, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    paths = []
    for arch in ("mod", "hybrid"):
        export_pretrained(tiny(arch), tmp_path / arch)
        paths.append(str(tmp_path / arch))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    done = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path / "ids.pt"), str(tmp_path / "out.pt"), *paths],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    for path in paths:
        ours = AdaptiveForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            logits = ours(ids).logits
        generated = ours.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert theirs[path]["class"] == "AdaptiveForCausalLM"
        torch.testing.assert_close(theirs[path]["logits"], logits, rtol=0, atol=0)
        assert torch.equal(theirs[path]["generated"], generated)
        assert generated.shape == (1, 17)
