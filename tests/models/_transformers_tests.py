"""transformers' own common model tests, fetched at test time from the sdist of the *installed* version.

The repository holds none of transformers' test code. `load()` downloads `transformers==<installed>` as a
source distribution with pip (once; cached under `$ADAPTIVE_TEST_CACHE` or `~/.cache/adaptive`), extracts
`tests/test_modeling_common.py` and `tests/test_configuration_common.py` into a package named
`hf_common_tests`, and imports them.

The sdist lacks three modules those files import; we supply our own minimal stand-ins:
- `.generation.test_utils.GenerationTesterMixin` and `.exporters.test_export.ExportTesterMixin`: empty mixins
  (those tests live only in transformers' repository; tests/models/test_generation_modes.py covers generation);
- `.utils.test_configuration_utils.config_common_kwargs`: PreTrainedConfig keyword arguments that any config
  must store as given (our own list).
"""

from __future__ import annotations

import fcntl
import importlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "hf_common_tests"
FILES = ("test_modeling_common.py", "test_configuration_common.py")

_STUBS = {
    "generation/test_utils.py": (
        '"""Stand-in written by adaptive: the generation mixin is not in the sdist."""\n\n\n'
        "class GenerationTesterMixin:\n    pass\n"
    ),
    "exporters/test_export.py": (
        '"""Stand-in written by adaptive: the export mixin is not in the sdist."""\n\n\n'
        "class ExportTesterMixin:\n    pass\n"
    ),
    "utils/test_configuration_utils.py": (
        '"""Stand-in written by adaptive: PreTrainedConfig kwargs every config must store as given."""\n\n'
        "config_common_kwargs = {\n"
        '    "return_dict": False,\n'
        '    "output_hidden_states": True,\n'
        '    "dtype": "float16",\n'
        '    "chunk_size_feed_forward": 5,\n'
        '    "architectures": ["AdaptiveForCausalLM"],\n'
        '    "finetuning_task": "translation",\n'
        '    "id2label": {0: "label"},\n'
        '    "label2id": {"label": "0"},\n'
        '    "problem_type": "regression",\n'
        '    "tokenizer_class": "PreTrainedTokenizerFast",\n'
        '    "prefix": "prefix",\n'
        '    "bos_token_id": 6,\n'
        '    "pad_token_id": 7,\n'
        '    "eos_token_id": 8,\n'
        '    "sep_token_id": 9,\n'
        '    "task_specific_params": {"translation": "some_params"},\n'
        "}\n"
    ),
}


class Unavailable(RuntimeError):
    """The sdist could not be fetched (no network, no index): the caller skips with this reason."""


def cache_root(version: str) -> Path:
    base = os.environ.get("ADAPTIVE_TEST_CACHE") or Path.home() / ".cache" / "adaptive"
    return Path(base) / f"transformers-{version}-tests"


def _download(version: str, root: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
               "--quiet", f"transformers=={version}", "-d", tmp]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired as err:
            raise Unavailable(f"pip download transformers=={version} (sdist) timed out") from err
        archives = list(Path(tmp).glob("transformers-*.tar.gz"))
        if done.returncode or not archives:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise Unavailable(f"could not download the transformers=={version} sdist: {last}")
        staging = Path(tempfile.mkdtemp(dir=root.parent))
        package = staging / PACKAGE
        package.mkdir()
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                name = Path(member.name)
                if name.parts[1:3] == ("tests", name.name) and name.name in FILES:
                    (package / name.name).write_bytes(tar.extractfile(member).read())
        missing = [f for f in FILES if not (package / f).exists()]
        if missing:
            raise Unavailable(f"the transformers=={version} sdist lacks tests/{missing[0]}")
        for rel, text in _STUBS.items():
            path = package / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        for folder in [package, *[p for p in package.rglob("*") if p.is_dir()]]:
            (folder / "__init__.py").touch()
        staging.rename(root)  # atomic: a half-extracted cache is never seen


def ensure_cache(root: Path, download) -> None:
    """Fill `root` with `download()` unless it is there. pytest-xdist's workers collect at once on an empty
    cache: one downloads under a file lock, the others wait for it and find the cache."""
    if (root / PACKAGE / FILES[0]).exists():
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / PACKAGE / FILES[0]).exists():
            download()


def load():
    """(test_modeling_common, test_configuration_common) of the installed transformers; raises Unavailable."""
    import transformers

    root = cache_root(transformers.__version__)
    ensure_cache(root, lambda: _download(transformers.__version__, root))
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        modeling = importlib.import_module(f"{PACKAGE}.test_modeling_common")
        configuration = importlib.import_module(f"{PACKAGE}.test_configuration_common")
    except ImportError as err:  # e.g. `parameterized` missing: install the [test] extra
        raise Unavailable(f"transformers' common tests do not import: {err}") from err
    return modeling, configuration
