"""Data pipeline: loading, packing, sharding, eval split, order and resume, errors, shipped corpus."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from adaptive.errors import AdaptiveError
from adaptive.train.data.batches import SampleIterator, batches, eval_batches, samples_before_step
from adaptive.train.data.packing import build_datasets, pack
from adaptive.train.data.sources import C4, DEFAULT_CORPUS, DataConfig, load_text_dataset, resolve_source

REPO_ROOT = Path(__file__).resolve().parents[3]
WORDS = "cynic wit folly virtue wealth knave saint lawyer dragon river".split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    """Distinct documents of varying length (each starts with its own number)."""
    rng = np.random.default_rng(seed)
    return [f"Entry {i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) + "." for i in range(n)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def expected_stream(tokenizer, docs: list[str]) -> list[int]:
    """Counted independently of the pipeline: the public tokenizer call, one EOS after each document."""
    out: list[int] = []
    for doc in docs:
        out += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return out


def cfg(dataset, cache: str, seq_len: int = 32, **kw) -> DataConfig:
    return DataConfig(dataset=str(dataset) if dataset is not None else None, seq_len=seq_len, cache_dir=cache, **kw)


# --- packing ------------------------------------------------------------------------------------


def test_pack_makes_full_blocks_and_drops_only_the_tail():
    tokens = np.arange(1003)
    blocks = pack(tokens, 100)
    assert blocks.shape == (10, 100)
    assert np.array_equal(blocks.reshape(-1), tokens[:1000])


def test_packing_loses_no_tokens_except_the_tail(tmp_path, tokenizer, datasets_cache):
    docs = make_docs(200)
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    train, evaluation = build_datasets(cfg(path, datasets_cache, seq_len=32), tokenizer)
    stream = expected_stream(tokenizer, docs)
    n_blocks = len(stream) // 32
    assert train.num_blocks + evaluation.num_blocks == n_blocks
    assert train.blocks.shape[1] == evaluation.blocks.shape[1] == 32
    # train.blocks / evaluation.blocks are in stream order (shuffling happens at indexing time).
    packed = np.concatenate([train.blocks, evaluation.blocks]).reshape(-1)
    assert packed.tolist() == stream[: n_blocks * 32]


def test_eos_separates_documents(tmp_path, tokenizer, datasets_cache):
    docs = make_docs(60)
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    train, evaluation = build_datasets(cfg(path, datasets_cache, seq_len=16), tokenizer)
    packed = np.concatenate([train.blocks, evaluation.blocks]).reshape(-1).tolist()
    eos = tokenizer.eos_token_id
    pieces, current = [], []
    for tok in packed:
        if tok == eos:
            pieces.append(tokenizer.decode(current))
            current = []
        else:
            current.append(tok)
    # Every complete document comes back whole, in order, between EOS tokens.
    assert pieces == docs[: len(pieces)]
    assert len(pieces) >= len(docs) - 2  # only the dropped tail may cut the last document(s)


def test_blank_documents_add_no_lone_eos(tmp_path, tokenizer, datasets_cache):
    docs = make_docs(80)
    with_blanks = [d for doc in docs for d in (doc, "", "   ")]
    path = write_jsonl(tmp_path / "docs.jsonl", with_blanks)
    train, evaluation = build_datasets(cfg(path, datasets_cache, seq_len=16), tokenizer)
    packed = np.concatenate([train.blocks, evaluation.blocks]).reshape(-1).tolist()
    assert packed == expected_stream(tokenizer, docs)[: len(packed)]


# --- sharding and eval split -------------------------------------------------------------------


def test_ranks_get_disjoint_shards_that_cover_the_data(tmp_path, tokenizer, datasets_cache):
    path = write_jsonl(tmp_path / "docs.jsonl", make_docs(300))
    world = 3
    ranks = [build_datasets(cfg(path, datasets_cache, seq_len=16), tokenizer, rank=r, world_size=world)[0] for r in range(world)]
    n = ranks[0].num_blocks
    assert all(np.array_equal(r.blocks, ranks[0].blocks) for r in ranks)  # same data, different views
    seen = [{r.block_index(i) for i in range(-(-(n - r.rank) // world))} for r in ranks]
    for a, b in itertools.combinations(seen, 2):
        assert not a & b
    assert set().union(*seen) == set(range(n))
    # Rank r's sample i is global sample i*world + r of the single-process order.
    single = build_datasets(cfg(path, datasets_cache, seq_len=16), tokenizer)[0]
    assert [ranks[1].block_index(i) for i in range(50)] == [single.block_index(i * world + 1) for i in range(50)]


def test_eval_is_disjoint_from_train_and_equal_per_rank(tmp_path, tokenizer, datasets_cache):
    path = write_jsonl(tmp_path / "docs.jsonl", make_docs(300))
    world = 2
    built = [build_datasets(cfg(path, datasets_cache, seq_len=16, eval_fraction=0.1), tokenizer, r, world) for r in range(world)]
    train, evaluation = built[0]
    train_rows = {tuple(row) for row in train.blocks.tolist()}
    eval_rows = {tuple(row) for row in evaluation.blocks.tolist()}
    assert eval_rows and not train_rows & eval_rows
    total = train.num_blocks + evaluation.num_blocks
    assert evaluation.num_blocks == round(0.1 * total)
    # Each rank evaluates different blocks, the same number of them (an odd one out is skipped).
    per_rank = [[tuple(row) for b in eval_batches(ev, 4) for row in b["input_ids"].tolist()] for _, ev in built]
    assert len(per_rank[0]) == len(per_rank[1]) == evaluation.num_blocks // world
    assert not set(per_rank[0]) & set(per_rank[1])
    assert set(per_rank[0]) | set(per_rank[1]) <= eval_rows


# --- order and resume ---------------------------------------------------------------------------


def test_same_seed_same_order_and_other_seed_other_order(tmp_path, tokenizer, datasets_cache):
    path = write_jsonl(tmp_path / "docs.jsonl", make_docs(200))
    first = build_datasets(cfg(path, datasets_cache, seed=7), tokenizer)[0]
    again = build_datasets(cfg(path, datasets_cache, seed=7), tokenizer)[0]
    other = build_datasets(cfg(path, datasets_cache, seed=8), tokenizer)[0]
    n = first.num_blocks
    order = [first.block_index(i) for i in range(n)]
    assert order == [again.block_index(i) for i in range(n)]
    assert order != [other.block_index(i) for i in range(n)]
    assert order != list(range(n))  # actually shuffled
    assert sorted(order) == list(range(n))  # one epoch is a permutation


def test_each_epoch_is_a_new_permutation(tmp_path, tokenizer, datasets_cache):
    path = write_jsonl(tmp_path / "docs.jsonl", make_docs(100))
    train = build_datasets(cfg(path, datasets_cache), tokenizer)[0]
    n = train.num_blocks
    epoch0 = [train.block_index(i) for i in range(n)]
    epoch1 = [train.block_index(i) for i in range(n, 2 * n)]
    assert sorted(epoch1) == list(range(n)) and epoch1 != epoch0


def test_resume_at_sample_i_continues_the_uninterrupted_order(tmp_path, tokenizer, datasets_cache):
    path = write_jsonl(tmp_path / "docs.jsonl", make_docs(60))
    train = build_datasets(cfg(path, datasets_cache, seq_len=16), tokenizer, rank=1, world_size=2)[0]
    micro = 4
    steps = 2 * len(train) // micro + 3  # runs past two epoch boundaries
    full = [b["input_ids"] for b in itertools.islice(batches(train, micro), steps)]
    start_step = 5
    resumed = list(itertools.islice(batches(train, micro, start_sample=start_step * micro), steps - start_step))
    assert len(resumed) == steps - start_step
    for a, b in zip(full[start_step:], resumed):
        assert a.equal(b["input_ids"]) and b["labels"].equal(b["input_ids"])


def test_changing_micro_batch_keeps_the_sample_order(tmp_path, tokenizer, datasets_cache):
    path = write_jsonl(tmp_path / "docs.jsonl", make_docs(60))
    train = build_datasets(cfg(path, datasets_cache, seq_len=16), tokenizer)[0]
    samples = SampleIterator(train)
    rows = [samples.next_batch(b)["input_ids"] for b in (4, 4, 2, 2, 2, 1, 3)]
    assert samples.position == 18
    reference = next(batches(train, 18))["input_ids"]
    assert reference.equal(torch.cat(rows))


def test_batches_are_long_tensors_with_labels_equal_to_inputs(tmp_path, tokenizer, datasets_cache):
    path = write_jsonl(tmp_path / "docs.jsonl", make_docs(60))
    train = build_datasets(cfg(path, datasets_cache, seq_len=16), tokenizer)[0]
    batch = next(batches(train, 3))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (3, 16)
    assert batch["labels"].equal(batch["input_ids"])
    assert batch["labels"].data_ptr() != batch["input_ids"].data_ptr()


def test_samples_before_step_is_step_times_local_batch():
    assert samples_before_step(10, micro_batch_size=4, gradient_accumulation_steps=8) == 320


# --- sources ------------------------------------------------------------------------------------


def test_txt_jsonl_parquet_and_folder_all_load(tmp_path, datasets_cache):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_docs(6)
    (tmp_path / "a.txt").write_text("\n\n".join(docs[:3]) + "\n", encoding="utf-8")
    write_jsonl(tmp_path / "b.jsonl", docs[3:], field="content")
    pq.write_table(pa.table({"text": docs, "n": list(range(6))}), tmp_path / "c.parquet")
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "1.jsonl", docs[:2])
    write_jsonl(folder / "2.jsonl", docs[2:])

    def texts(dataset, **kw):
        return [row["text"].strip() for row in load_text_dataset(cfg(dataset, datasets_cache, **kw))]

    assert texts(tmp_path / "a.txt") == docs[:3]  # paragraphs are documents
    assert texts(tmp_path / "a.txt", txt_sample_by="document") == ["\n\n".join(docs[:3])]
    assert texts(tmp_path / "b.jsonl", text_field="content") == docs[3:]
    assert texts(tmp_path / "c.parquet") == docs
    assert texts(folder) == docs


def test_c4_is_the_hub_default_with_config_en():
    source = resolve_source(DataConfig("c4", seq_len=8))
    assert (source.builder, source.config_name, source.is_local) == (C4, "en", False)
    assert resolve_source(DataConfig(None, seq_len=8)).data_files == (str(DEFAULT_CORPUS),)


def test_streaming_ranks_get_disjoint_documents_and_eval_is_held_out(tmp_path, tokenizer, datasets_cache):
    docs = make_docs(120)
    folder = tmp_path / "shards"
    folder.mkdir()
    for k in range(4):  # four shards: split_dataset_by_node hands two to each rank
        write_jsonl(folder / f"{k}.jsonl", docs[k::4])
    c = cfg(folder, datasets_cache, streaming=True, eval_fraction=0.2, shuffle_buffer=16)
    built = [build_datasets(c, tokenizer, rank=r, world_size=2) for r in range(2)]
    train_docs = [set(tr.documents(0)) for tr, _ in built]
    eval_docs = [set(ev.documents(0)) for _, ev in built]
    assert not train_docs[0] & train_docs[1] and not eval_docs[0] & eval_docs[1]
    all_train, all_eval = train_docs[0] | train_docs[1], eval_docs[0] | eval_docs[1]
    assert all_eval and not all_train & all_eval
    assert all_train | all_eval == set(docs)


def test_streaming_resume_and_seed_behave_like_map_style(tmp_path, tokenizer, datasets_cache):
    docs = make_docs(60)
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    c = cfg(path, datasets_cache, seq_len=16, streaming=True, shuffle_buffer=8)
    train = build_datasets(c, tokenizer)[0]
    per_epoch = len(expected_stream(tokenizer, docs)) // 16
    steps = per_epoch // 2 + 4  # crosses an epoch boundary
    full = [b["input_ids"] for b in itertools.islice(batches(train, 2), steps)]
    again = [b["input_ids"] for b in itertools.islice(batches(build_datasets(c, tokenizer)[0], 2), steps)]
    first = SampleIterator(train)
    for _ in range(7):
        first.next_batch(2)
    first.commit()
    saved = json.loads(json.dumps(first.state_dict()))  # what a checkpoint holds
    resumed = [b["input_ids"] for b in itertools.islice(batches(train, 2, start_sample=14, state=saved), steps - 7)]
    assert all(a.equal(b) for a, b in zip(full, again))
    assert all(a.equal(b) for a, b in zip(full[7:], resumed)) and len(resumed) == steps - 7
    other = build_datasets(dataclasses.replace(c, seed=1), tokenizer)[0]
    assert not next(batches(other, 8))["input_ids"].equal(next(batches(train, 8))["input_ids"])
    assert list(train.documents(0)) != list(train.documents(1))  # reshuffled per epoch


# --- errors -------------------------------------------------------------------------------------


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message and message
    return message


def test_missing_path_names_the_path(tokenizer, tmp_path):
    missing = tmp_path / "nope" / "corpus.jsonl"
    with pytest.raises(AdaptiveError) as err:
        build_datasets(DataConfig(str(missing), seq_len=16), tokenizer)
    assert str(missing) in one_line(err)


def test_empty_file_says_zero_tokens_and_block_size(tmp_path, tokenizer, datasets_cache):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(AdaptiveError) as err:
        build_datasets(cfg(empty, datasets_cache, seq_len=64), tokenizer)
    message = one_line(err)
    assert "has 0 tokens" in message and "one block needs 64 tokens" in message


def test_too_small_corpus_says_how_many_tokens_it_has(tmp_path, tokenizer, datasets_cache):
    path = write_jsonl(tmp_path / "tiny.jsonl", ["A very short text."])
    n_tokens = len(expected_stream(tokenizer, ["A very short text."]))
    with pytest.raises(AdaptiveError) as err:
        build_datasets(cfg(path, datasets_cache, seq_len=64), tokenizer)
    message = one_line(err)
    assert f"has {n_tokens} tokens" in message and "one block needs 64 tokens" in message


def test_jsonl_without_the_text_field_names_the_field(tmp_path, datasets_cache):
    path = write_jsonl(tmp_path / "docs.jsonl", make_docs(3), field="body")
    with pytest.raises(AdaptiveError) as err:
        load_text_dataset(cfg(path, datasets_cache))
    message = one_line(err)
    assert "'text'" in message and "body" in message and "--text-field" in message


def test_unsupported_file_type_and_bad_rank_are_refused(tmp_path, tokenizer, datasets_cache):
    odd = tmp_path / "corpus.csv"
    odd.write_text("text\nhello\n")
    with pytest.raises(AdaptiveError, match="unsupported type"):
        build_datasets(cfg(odd, datasets_cache), tokenizer)
    with pytest.raises(AdaptiveError, match="rank 2 is not in a world of 2"):
        build_datasets(cfg(None, datasets_cache), tokenizer, rank=2, world_size=2)


def test_hub_dataset_offline_is_one_clear_error(tokenizer):
    import datasets

    assert datasets.config.HF_HUB_OFFLINE, "conftest must set HF_DATASETS_OFFLINE before datasets is imported"
    for name in ("c4", "someone/some-corpus"):
        with pytest.raises(AdaptiveError) as err:
            build_datasets(DataConfig(name, seq_len=16), tokenizer)
        message = one_line(err)
        assert repr(name) in message and "--dataset PATH" in message and "offline" in message


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: connections are refused


def test_unreachable_hub_endpoint_fails_fast_with_one_line(adaptive_cache):
    """A real process without offline mode, pointed at a hub that refuses connections."""
    script = (
        "import sys\n"
        "from adaptive.errors import AdaptiveError\n"
        "from adaptive.train.data.packing import build_datasets\n"
        "from adaptive.train.data.sources import DataConfig\n"
        "from adaptive.train.data.tokenizer import load_tokenizer\n"
        "try:\n"
        "    build_datasets(DataConfig('c4', seq_len=16), load_tokenizer(None))\n"
        "except AdaptiveError as err:\n"
        "    print(err, file=sys.stderr); sys.exit(2)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(PYTHONPATH=str(REPO_ROOT), HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", ADAPTIVE_CACHE=str(adaptive_cache))
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(proxy, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'c4'" in lines[0] and "--dataset PATH" in lines[0] and "Connection refused" in lines[0]


# --- the shipped corpus -------------------------------------------------------------------------


def test_shipped_corpus_is_small_and_enough_for_debug_runs(tokenizer, datasets_cache):
    assert DEFAULT_CORPUS.is_file() and DEFAULT_CORPUS.stat().st_size < 400_000
    text = DEFAULT_CORPUS.read_text(encoding="utf-8")
    assert text.startswith("THE DEVIL'S DICTIONARY") and "Wiretap" not in text  # edition boilerplate is gone
    for seq_len in (128, 256):
        train, evaluation = build_datasets(DataConfig(None, seq_len=seq_len, cache_dir=datasets_cache), tokenizer)
        # A few dozen debug steps at micro-batch 8 fit in one epoch, with eval blocks held out.
        assert train.num_blocks >= 48 * 8 and evaluation.num_blocks >= 8


@pytest.mark.slow  # two real processes
def test_two_real_processes_get_disjoint_shards(tmp_path, adaptive_cache, tokenizer):
    """torchrun, two ranks over gloo: each builds its own shard; rank 0 checks what both got.

    The `tokenizer` fixture has already built the tokenizer into the shared cache."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ADAPTIVE_CACHE": str(adaptive_cache), "OMP_NUM_THREADS": "1"}
    script = Path(__file__).with_name("_two_rank_data.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_closed_port()),
           str(script), str(tmp_path / "hf")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    rank0, rank1 = map(set, result["indices"])
    n = result["num_blocks"]
    assert not rank0 & rank1 and len(rank0) == len(rank1) == n // 2
    assert len(rank0 | rank1) == n - n % 2  # only an odd block out is left to the next epoch
    assert result["eval_counts"][0] == result["eval_counts"][1] > 0
    assert not result["first_batches_equal"]
