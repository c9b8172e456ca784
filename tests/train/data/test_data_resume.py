"""Data that resume in O(1): the loader state goes through a checkpoint folder (JSON, per rank) and a resumed
iterator gives exactly the batches an uninterrupted one gives (streaming with and without loader workers,
map-style); resuming reads one window and tokenizes nothing it skips, wherever it resumes; two ranks stay
disjoint after a resume."""

from __future__ import annotations

import json
import os
import re

import pytest

from adaptive.errors import AdaptiveError
from adaptive.train.run_folder import checkpoint as ckpt
from adaptive.train.data import packing
from adaptive.train.data.batches import SampleIterator
from adaptive.train.data.packing import StreamingPackedDataset, build_datasets
from adaptive.train.data.sources import DataConfig
from tests.train.data.test_data import make_docs, write_jsonl

MICRO = 3


@pytest.fixture(autouse=True)
def accelerate_state():
    """accelerate's logger (checkpoint.py) needs its process state."""
    from accelerate import PartialState

    PartialState(cpu=True)


@pytest.fixture
def shards(tmp_path):
    """Four jsonl shards: split_dataset_by_node gives each of two ranks two, and each loader worker one."""
    folder = tmp_path / "shards"
    folder.mkdir()
    docs = make_docs(120)
    for k in range(4):
        write_jsonl(folder / f"{k}.jsonl", docs[k::4])
    return folder


def streaming(folder, cache, **kw) -> DataConfig:
    return DataConfig(str(folder), seq_len=16, streaming=True, shuffle_buffer=16, cache_dir=cache, **kw)


class OneRankAccelerator:
    is_main_process = is_local_main_process = True
    num_processes, process_index = 1, 0

    def wait_for_everyone(self) -> None:
        pass

    def save_state(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)


def drawn(samples: SampleIterator, steps: int) -> list:
    return [samples.next_batch(MICRO)["input_ids"] for _ in range(steps)]


def checkpoint_and_resume(train, tmp_path, steps: int) -> SampleIterator:
    """Train-like use: draw `steps` batches, committing each, checkpoint the state, resume from the folder."""
    samples = SampleIterator(train)
    for _ in range(steps):
        samples.next_batch(MICRO)
        samples.commit()
    samples.next_batch(MICRO)  # drawn, never committed: a checkpoint now must not count it
    files = {ckpt.data_state_file(0): json.dumps(samples.state_dict()) + "\n"}
    path = ckpt.save_checkpoint(OneRankAccelerator(), tmp_path / "run", steps, {"step": steps}, 3, rank_files=files)
    assert ckpt.verify(path) is None and ckpt.data_state_file(0) in json.loads((path / ckpt.MANIFEST).read_text())["files"]
    saved = ckpt.read_data_state(path, 0, steps * MICRO)
    return SampleIterator(train, saved["position"], saved)


@pytest.mark.parametrize("workers", [0, 2])
def test_streaming_resume_from_a_checkpoint_folder_gives_the_uninterrupted_batches(shards, tmp_path, tokenizer,
                                                                                   datasets_cache, workers):
    train = build_datasets(streaming(shards, datasets_cache, workers=workers), tokenizer)[0]
    assert train.workers == workers
    total, cut = 200, 97
    uninterrupted = SampleIterator(train)
    full = drawn(uninterrupted, total)
    uninterrupted.commit()
    resumed = drawn(checkpoint_and_resume(train, tmp_path, cut), total - cut)
    assert all(a.equal(b) for a, b in zip(full[cut:], resumed, strict=True))
    assert max(epochs(uninterrupted.state_dict())) >= 1, "the run crosses an epoch boundary"


def epochs(state: dict) -> list[int]:
    """Each loader worker's epoch in a SampleIterator state."""
    loader = state["loader"]
    workers = loader["_snapshot"]["_worker_snapshots"].values() if "_snapshot" in loader else [loader]
    return [w["dataset_state"]["stream"]["epoch"] for w in workers]


def test_map_style_resume_from_a_checkpoint_folder_gives_the_uninterrupted_batches(tmp_path, tokenizer,
                                                                                   datasets_cache):
    path = write_jsonl(tmp_path / "docs.jsonl", make_docs(100))
    train = build_datasets(DataConfig(str(path), seq_len=16, cache_dir=datasets_cache), tokenizer)[0]
    full = drawn(SampleIterator(train), 80)
    resumed = checkpoint_and_resume(train, tmp_path, 30)
    assert resumed.state_dict() == {"position": 90, "workers": None, "loader": None}  # an index: O(1) by itself
    assert all(a.equal(b) for a, b in zip(full[30:], drawn(resumed, 50), strict=True))


def test_resume_reads_one_window_and_tokenizes_nothing_it_skips(tmp_path, tokenizer, datasets_cache, monkeypatch):
    """Counted, not timed: the documents read and tokenized to resume and draw one batch, at sample 60 and at
    sample 3000 of a 6000-document stream, are the same few (at most one window of 16 and one batch)."""
    path = write_jsonl(tmp_path / "docs.jsonl", make_docs(6000))
    train = build_datasets(streaming(path, datasets_cache), tokenizer)[0]
    counts = {"read": 0, "tokenized": 0}
    windows, encode = StreamingPackedDataset._windows, packing._encode_each

    def counted_windows(self, *args):
        for window in windows(self, *args):
            counts["read"] += len(window[1])
            yield window

    def counted_encode(tokenizer_, texts):
        counts["tokenized"] += len(texts)
        return encode(tokenizer_, texts)

    monkeypatch.setattr(StreamingPackedDataset, "_windows", counted_windows)
    monkeypatch.setattr(packing, "_encode_each", counted_encode)
    cost = {}
    for steps in (20, 1000):
        samples = SampleIterator(train)
        for _ in range(steps):
            samples.next_batch(MICRO)
        samples.commit()
        saved = json.loads(json.dumps(samples.state_dict()))
        counts.update(read=0, tokenized=0)
        SampleIterator(train, saved["position"], saved).next_batch(MICRO)
        cost[steps] = dict(counts)
    assert cost[1000]["read"] <= 2 * 16 and cost[1000]["tokenized"] <= 2 * 16, cost  # the window, and maybe the next
    assert cost[1000]["read"] <= cost[20]["read"] + 16 and cost[1000]["tokenized"] <= cost[20]["tokenized"] + 16, cost


def entries(tokenizer, batches) -> set[int]:
    """The document numbers ("Entry N:") in a run of consecutive blocks (the packed stream, decoded)."""
    text = tokenizer.decode([t for b in batches for row in b.tolist() for t in row])
    return {int(n) for n in re.findall(r"Entry (\d+):", text)}


def test_two_ranks_stay_disjoint_after_a_resume(shards, tmp_path, tokenizer, datasets_cache):
    c = streaming(shards, datasets_cache, workers=1)
    after = []
    for rank in range(2):
        train = build_datasets(c, tokenizer, rank=rank, world_size=2)[0]
        full = drawn(SampleIterator(train), 40)
        resumed = drawn(checkpoint_and_resume(train, tmp_path / f"rank{rank}", 10), 30)
        assert all(a.equal(b) for a, b in zip(full[10:], resumed, strict=True))
        after.append(entries(tokenizer, resumed))
    assert after[0] and after[1] and not after[0] & after[1]


def test_streaming_resume_needs_the_saved_state_and_the_same_workers(shards, tokenizer, datasets_cache):
    train = build_datasets(streaming(shards, datasets_cache), tokenizer)[0]
    samples = SampleIterator(train)
    samples.next_batch(MICRO)
    samples.commit()
    with pytest.raises(AdaptiveError, match="needs the loader state"):
        SampleIterator(train, MICRO)
    other = build_datasets(streaming(shards, datasets_cache, workers=1), tokenizer)[0]
    with pytest.raises(AdaptiveError, match="--data-workers 0"):
        SampleIterator(other, MICRO, samples.state_dict())
