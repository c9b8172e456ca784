"""setup.load_data, the entry every run (and a recipe run) takes to its data: the run options it is given reach
the data config (--packing, ...), not only build_datasets' own callers."""

from __future__ import annotations

import contextlib
import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from adaptive.config.commandline import parse
from adaptive.config.run import TRAIN
from adaptive.train.run import setup

WORDS = "cynic wit folly virtue wealth knave saint lawyer dragon river".split()


class OneProcess:
    """What load_data asks of the accelerator, for one process."""

    num_processes, process_index = 1, 0

    @contextlib.contextmanager
    def main_process_first(self):
        yield


def run_plan(seq_len: int):
    knobs = SimpleNamespace(seq_len=seq_len, tp_size=1, pp_size=1)
    return SimpleNamespace(knobs=knobs, device=SimpleNamespace(kind="cpu"), init_from=None)


@pytest.fixture
def private_datasets_cache(monkeypatch, datasets_cache):
    """load_data leaves `datasets` its default cache: point that at the test's."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", datasets_cache)


def load(argv: list[str], seq_len: int, tokenizer):
    options = parse(TRAIN, argv).data
    return setup.load_data(options, 0, run_plan(seq_len), OneProcess(), len(tokenizer))


def test_packing_reaches_the_data_config_through_load_data(tmp_path, tokenizer, private_datasets_cache, caplog):
    pairs = [{"prompt": f"Define {w}.", "completion": f" {w.capitalize()}: {len(w)} letters."} for w in WORDS * 3]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="adaptive.train.data"):
        packed = load(["--dataset", str(path), "--packing"], 64, tokenizer)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data ")]
    assert packed.train.packed and "(packed;" in said[-1], said
    block = packed.train[0]
    assert "position_ids" in block and int((np.asarray(block["position_ids"]) == 0).sum()) > 1  # several examples
    single = load(["--dataset", str(path)], 64, tokenizer)
    assert not single.train.packed and single.train.num_blocks > packed.train.num_blocks


def test_packing_text_says_it_is_ignored_through_load_data(tokenizer, private_datasets_cache, caplog):
    with caplog.at_level(logging.WARNING, logger="adaptive.train.data"):
        load(["--dataset", "builtin", "--packing"], 32, tokenizer)
    assert any(r.getMessage().startswith("packing ignored:") for r in caplog.records)
