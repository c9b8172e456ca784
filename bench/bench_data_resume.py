"""Streamed data: resume time by position, old (re-read, re-tokenize, skip) against new (the loader state),
and the loader's tokens/s against what b1 trains on an H100.

    PYTHONPATH=. python bench/bench_data_resume.py                 # seq 512; resume at 0, 1k, 4k, 16k samples
    PYTHONPATH=. python bench/bench_data_resume.py --quick         # smoke run

The data: a local jsonl corpus in 4 shards (the shipped Devil's Dictionary, its paragraphs shuffled and
numbered, repeated to about 37 MB of text at seq 512), loaded with `streaming=True` as C4 is;
so it times tokenizing and packing, not a download (the old approach also re-downloaded what it skipped).

Prints:
- resume time (the first batch after resuming) at each position: the old approach, reimplemented here as
  it was (`datasets` shuffle buffer, then read, tokenize and pack from the start and drop the first N
  blocks), and the new one (`SampleIterator(train, N, state)`, no workers), and their ratio;
- the loader's steady tokens/s with 0, 1 and 2 worker processes (blocks of 2048, as b1 trains), beside
  the tokens/s per GPU the planner predicts for b1 on an H100 (`adaptive fit --model b1 --gpu h100`), and
  the CPU time the training process itself spends getting one H100 step's blocks (tokenizing them with no
  workers; unpacking what workers send otherwise), as a share of that step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402

from adaptive.train.data.batches import SampleIterator
from adaptive.train.data.packing import _encode, _held_out, build_datasets
from adaptive.train.data.sources import DEFAULT_CORPUS, DataConfig, load_text_dataset  # noqa: E402
from adaptive.train.data.tokenizer import load_tokenizer  # noqa: E402


def write_corpus(folder: Path, target_chars: int, shards: int = 4) -> None:
    paragraphs = [p.strip() for p in DEFAULT_CORPUS.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    rng = random.Random(0)
    files = [open(folder / f"{k}.jsonl", "w", encoding="utf-8") for k in range(shards)]
    written, n = 0, 0
    while written < target_chars:
        rng.shuffle(paragraphs)
        for i in range(0, len(paragraphs), 4):
            doc = f"Document {n}. " + "\n\n".join(paragraphs[i:i + 4])
            files[n % shards].write(json.dumps({"text": doc}) + "\n")
            written, n = written + len(doc), n + 1
    for f in files:
        f.close()


def old_resume(cfg: DataConfig, tokenizer, start: int) -> np.ndarray:
    """The first block at `start` the way resume worked before: the same shuffled stream, re-read, re-tokenized
    and packed from the beginning, the first `start` blocks thrown away."""
    texts = load_text_dataset(cfg, "train", streaming=True)
    every = max(2, round(1 / cfg.eval_fraction))
    texts = texts.filter(lambda row: not _held_out(row["text"], every)).shuffle(seed=cfg.seed, buffer_size=cfg.shuffle_buffer)
    texts.set_epoch(0)
    docs = (row["text"] for row in texts)
    buffer: list[int] = []
    produced = 0
    while batch := list(itertools.islice(docs, 256)):
        for ids in _encode(tokenizer, batch):
            buffer.extend(ids)
            while len(buffer) >= cfg.seq_len:
                block, buffer = buffer[: cfg.seq_len], buffer[cfg.seq_len:]
                if produced >= start:
                    return np.asarray(block)
                produced += 1
    raise RuntimeError("corpus too small for this position")


def states_at(train, positions: list[int]) -> dict[int, dict]:
    """The new iterator's saved state at each position (one pass, not timed)."""
    samples, states = SampleIterator(train), {}
    for target in sorted(positions):
        if target > samples.position:
            samples.next_batch(target - samples.position)
        samples.commit()
        states[target] = json.loads(json.dumps(samples.state_dict()))
    return states


def new_resume(train, state: dict) -> float:
    started = time.perf_counter()
    SampleIterator(train, state["position"], state).next_batch(1)
    return time.perf_counter() - started


def loader_tokens_per_s(folder: Path, cache: str, tokenizer, workers: int, blocks: int) -> tuple[float, float]:
    """(steady tokens/s, CPU seconds the training process itself spends per block) with `workers` processes,
    blocks of 2048. Drained as fast as the loader goes: with workers, the training process only unpacks."""
    cfg = DataConfig(str(folder), seq_len=2048, streaming=True, cache_dir=cache, workers=workers)
    samples = SampleIterator(build_datasets(cfg, tokenizer)[0])
    samples.next_batch(8)  # start-up (workers forked, first window read) is not steady state
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(blocks // 8):
        samples.next_batch(8)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    return blocks // 8 * 8 * 2048 / elapsed, cpu / (blocks // 8 * 8)


def h100_b1_need() -> tuple[float, float]:
    """(tokens/s per GPU, seconds per optimizer step) the planner predicts for b1 on one H100."""
    from adaptive.config import RunConfig
    from adaptive.plan import fit
    from adaptive.plan.ds_config.emit import plan_dict
    from adaptive.plan.request import request_from_config

    plan = plan_dict(fit(request_from_config(RunConfig.from_options({"name": "b1", "gpu": "h100"}))))
    return plan["tokens_per_second"] / plan["num_gpus"], plan["step_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    positions = [0, 100, 400] if args.quick else [0, 1000, 4000, 16000]
    tokenizer = load_tokenizer(None)
    with tempfile.TemporaryDirectory() as tmp:
        folder, cache = Path(tmp) / "corpus", str(Path(tmp) / "hf")
        folder.mkdir()
        write_corpus(folder, (positions[-1] + 2000) * args.seq_len * 4)  # ~4 characters per token
        cfg = DataConfig(str(folder), seq_len=args.seq_len, streaming=True, cache_dir=cache)
        train = build_datasets(cfg, tokenizer)[0]
        states = states_at(train, positions)
        print(f"resume at N samples (seq {args.seq_len}, built-in tokenizer, 1 rank, no workers): time to the first batch")
        print(f"{'N':>7} {'old s':>8} {'new s':>8} {'old/new':>8}")
        for n in positions:
            started = time.perf_counter()
            old_resume(cfg, tokenizer, n)
            old = time.perf_counter() - started
            new = statistics.median(new_resume(train, states[n]) for _ in range(3))
            print(f"{n:>7} {old:8.3f} {new:8.3f} {old / new:8.1f}")

        need, step_s = h100_b1_need()
        step_blocks = need * step_s / 2048
        print(f"\nloader, blocks of 2048: b1 on one H100 trains {need:,.0f} tokens/s "
              f"(planner; a step of {step_s:.2f} s = {step_blocks:.0f} blocks)")
        print(f"{'workers':>7} {'tokens/s':>10} {'x need':>7} {'train-process CPU s/step':>24} {'share of step':>13}")
        for workers in (0, 1, 2):
            rate, per_block = loader_tokens_per_s(folder, cache, tokenizer, workers, 64 if args.quick else 256)
            draw = per_block * step_blocks
            print(f"{workers:>7} {rate:>10,.0f} {rate / need:>7.1f} {draw:>24.3f} {draw / step_s:>13.1%}")


if __name__ == "__main__":
    main()
