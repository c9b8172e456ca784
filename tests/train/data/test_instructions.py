"""Instruction data: chats and prompt/completion pairs trained on the answers only, truncation, padding and
packing into fixed blocks, epochs and resume, bad rows."""

from __future__ import annotations

import copy
import itertools
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from adaptive.errors import AdaptiveError
from adaptive.train.data.batches import batches, eval_batches
from adaptive.train.data.instructions import CHAT, PROMPT_COMPLETION, TEXT, data_format, render_chat
from adaptive.train.data.packing import build_datasets
from adaptive.train.data.sources import DataConfig, check_local_rows

ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Both render a turn as "<|role|>\n{content}<|end|>", and the generation prompt as "<|assistant|>\n".
PLAIN_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
GENERATION_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}"
                       "{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
                       "{% else %}{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
                       "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# Like Qwen3's: only a final assistant turn shows its (empty) reasoning block, so a chat's start does not render
# as the start of the whole chat.
REWRITING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' and loop.last %}"
                      "<think></think>{% endif %}{{ m['content'] }}<|end|>{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

CHATS = [
    [{"role": "system", "content": "Answer as the Devil's Dictionary would."},
     {"role": "user", "content": "What is a cynic?"},
     {"role": "assistant", "content": "A blackguard whose faulty vision sees things as they are."},
     {"role": "user", "content": "And wit?"},
     {"role": "assistant", "content": "The salt with which the humorist spoils his cookery."}],
    [{"role": "user", "content": "Define a lawyer."},
     {"role": "assistant", "content": "One skilled in circumvention of the law."}],
]
WORDS = "cynic wit folly virtue wealth knave saint lawyer dragon river".split()


@pytest.fixture(scope="module")
def role_tokenizer(tokenizer):
    """The built-in tokenizer with role markers as special tokens (as a chat model's has), no template."""
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ROLE_TOKENS})
    return tok


def with_template(tok, template: str | None):
    out = copy.deepcopy(tok)
    out.chat_template = template
    return out


def tiny_llama(vocab_size: int, attention: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # use_cache=False: with a KV cache transformers reads no packed sequences from position_ids (masking_utils)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False,
                         attn_implementation=attention)
    return LlamaForCausalLM(config).eval()


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def cfg(path: Path, cache: str, seq_len: int = 128, **kw) -> DataConfig:
    return DataConfig(dataset=str(path), seq_len=seq_len, cache_dir=cache, **kw)


def make_chats(n: int, seed: int = 0) -> list[dict]:
    """Chats of varied length, one or two turns each."""
    rng = np.random.default_rng(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi))))

    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Question {i}: {words(1, 8)}?"},
                    {"role": "assistant", "content": f"{words(1, 10)}."}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": words(1, 4)}, {"role": "assistant", "content": words(1, 6)}]
        rows.append({"messages": messages})
    return rows


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def find(seq: list[int], part: list[int], start: int = 0) -> int:
    for i in range(start, len(seq) - len(part) + 1):
        if seq[i:i + len(part)] == part:
            return i
    raise AssertionError(f"{part} not in {seq}")


def assistant_positions(tok, ids: list[int], chat: list[dict]) -> list[int]:
    """Where each answer's tokens (its content and <|end|>) are in `ids`: the answers tokenized on their own
    and found after their header, independently of the pipeline's masks."""
    header = tok("<|assistant|>\n", add_special_tokens=False)["input_ids"]
    positions, at = [], 0
    for message in chat:
        if message["role"] == "assistant":
            answer = tok(message["content"] + "<|end|>", add_special_tokens=False)["input_ids"]
            at = find(ids, header + answer, at) + len(header)
            positions += range(at, at + len(answer))
            at += len(answer)
    return positions


# --- what is trained ----------------------------------------------------------------------------


@pytest.mark.parametrize("template", [GENERATION_TEMPLATE, PLAIN_TEMPLATE], ids=["generation-blocks", "prefixes"])
def test_the_assistant_only_loss_equals_a_hand_computation_over_the_unmasked_tokens(
        tmp_path, role_tokenizer, datasets_cache, template):
    tok = with_template(role_tokenizer, template)
    path = write_rows(tmp_path / "chats.jsonl", [{"messages": chat} for chat in CHATS])
    train, evaluation = build_datasets(cfg(path, datasets_cache), tok)
    # the last example is held out for eval: row 0 is CHATS[0], row 1 CHATS[1]
    parts = [next(batches(train, 1)), next(eval_batches(evaluation, 1))]
    batch = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (2, 128)

    model = tiny_llama(len(tok))
    with torch.no_grad():
        loss = model(**batch).loss
        logits = model(input_ids=batch["input_ids"]).logits.float()
    terms = []
    for row, chat in enumerate(CHATS):
        ids = batch["input_ids"][row].tolist()
        for p in assistant_positions(tok, ids, chat):
            terms.append(-torch.log_softmax(logits[row, p - 1], dim=-1)[ids[p]])
    assert len(terms) == int((batch["labels"][:, 1:] != -100).sum()) > 0
    hand = torch.stack(terms).mean()
    assert torch.allclose(loss, hand, atol=1e-6), (loss.item(), hand.item())
    # padding: the pad token, never trained
    used = [len(tok.apply_chat_template(chat, tokenize=True, return_dict=False)) for chat in CHATS]
    for row, n in enumerate(used):
        assert (batch["input_ids"][row, n:] == tok.pad_token_id).all()
        assert (batch["labels"][row, n:] == -100).all()


def test_templates_with_and_without_generation_blocks_mark_the_same_tokens(role_tokenizer):
    plain, marked = with_template(role_tokenizer, PLAIN_TEMPLATE), with_template(role_tokenizer, GENERATION_TEMPLATE)
    for chat in CHATS:
        assert render_chat(plain, chat) == render_chat(marked, chat)
        ids, trained = render_chat(plain, chat)
        assert [p for p, t in enumerate(trained) if t] == assistant_positions(plain, ids, chat)


def test_prompt_completion_trains_the_completion_and_eos_only(tmp_path, tokenizer, datasets_cache):
    pairs = [(f"Define {w}.", f" {w.capitalize()}: a word of {len(w)} letters.") for w in WORDS]
    path = write_rows(tmp_path / "pairs.jsonl", [{"prompt": p, "completion": c} for p, c in pairs])
    train, evaluation = build_datasets(cfg(path, datasets_cache, seq_len=48), tokenizer)
    expected = {}
    for p, c in pairs:
        prompt = tokenizer(p)["input_ids"]
        answer = tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        expected[tuple(prompt + answer)] = [-100] * len(prompt) + answer
    blocks = [train[i] for i in range(train.num_blocks)] + [evaluation[i] for i in range(evaluation.num_blocks)]
    assert len(blocks) == len(pairs)
    for block in blocks:
        assert set(block) == {"input_ids", "labels"}
        n = int((block["input_ids"] != tokenizer.pad_token_id).sum())
        labels = expected.pop(tuple(block["input_ids"][:n].tolist()))
        assert block["labels"].tolist() == labels + [-100] * (48 - n)
    assert not expected


# --- truncation, dropping, packing --------------------------------------------------------------


def test_truncation_is_said_once_with_a_count_and_examples_left_untrained_are_dropped(
        tmp_path, role_tokenizer, datasets_cache, caplog):
    tok = with_template(role_tokenizer, PLAIN_TEMPLATE)
    long = " ".join(WORDS * 4)
    short = [{"messages": [{"role": "user", "content": f"Define {w}."}, {"role": "assistant", "content": f"A {w}."}]}
             for w in WORDS[:3]]
    rows = short + [
        {"messages": [{"role": "user", "content": "Tell all."}, {"role": "assistant", "content": long}]},  # cut
        {"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "No."}]},  # cut, dropped
        {"messages": [{"role": "user", "content": "Nobody answers."}]},  # dropped
    ]
    path = write_rows(tmp_path / "chats.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="adaptive.train.data"):
        train, evaluation = build_datasets(cfg(path, datasets_cache, seq_len=32), tok)
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if "truncated" in m] == ["2 of 6 examples were longer than 32 tokens and were truncated"]
    assert sum("2 of 6 examples had no trained token within 32 tokens" in m for m in said) == 1
    assert train.num_blocks + evaluation.num_blocks == 4
    blocks = [train[i] for i in range(train.num_blocks)] + [evaluation[i] for i in range(evaluation.num_blocks)]
    cut = [b for b in blocks if (b["input_ids"] != tok.pad_token_id).all()]
    assert len(cut) == 1 and (cut[0]["labels"][-8:] != -100).all()  # trained up to the last token


def _per_example_losses(model, blocks: list[dict], pad: int, positions: bool = True) -> dict[tuple, torch.Tensor]:
    """Each example's token ids -> the losses of its trained tokens, from a forward of the blocks (with their
    position_ids, if they have them and `positions`)."""
    out = {}
    with torch.no_grad():
        for block in blocks:
            ids, labels = torch.as_tensor(block["input_ids"]), torch.as_tensor(block["labels"])
            packed = "position_ids" in block
            kwargs = {"position_ids": torch.as_tensor(block["position_ids"])[None]} if packed and positions else {}
            logits = model(input_ids=ids[None], **kwargs).logits[0]
            losses = F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=-100, reduction="none")
            if packed:
                starts = [int(s) for s in np.flatnonzero(np.asarray(block["position_ids"]) == 0)] + [len(ids)]
            else:
                starts = [0, int((ids != pad).sum())]
            for lo, hi in itertools.pairwise(starts):
                trained = [p for p in range(lo + 1, hi) if labels[p] != -100]
                if trained:
                    out[tuple(ids[lo:hi].tolist())] = losses[[p - 1 for p in trained]]
    return out


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packing_gives_each_example_the_loss_it_has_alone(tmp_path, role_tokenizer, datasets_cache, attention):
    tok = with_template(role_tokenizer, PLAIN_TEMPLATE)
    path = write_rows(tmp_path / "chats.jsonl", make_chats(24))
    model = tiny_llama(len(tok), attention)
    losses = {}
    for packing in (False, True):
        train, evaluation = build_datasets(cfg(path, datasets_cache, seq_len=128, packing=packing), tok)
        blocks = [train[i] for i in range(train.num_blocks)] + [evaluation[i] for i in range(evaluation.num_blocks)]
        assert all(b["input_ids"].shape == (128,) for b in blocks)
        losses[packing] = _per_example_losses(model, blocks, tok.pad_token_id)
        if packing:
            assert len(blocks) < 24 / 2, "packing put several examples in a block"
            assert "position_ids" in next(batches(train, 2))
            crossed = _per_example_losses(model, blocks, tok.pad_token_id, positions=False)
    assert losses[True].keys() == losses[False].keys() == crossed.keys() and len(losses[True]) == 24
    for example, alone in losses[False].items():
        torch.testing.assert_close(losses[True][example], alone, atol=1e-5, rtol=1e-5)
    # the same blocks without their position_ids attend across examples, and the check above would see it
    assert max((crossed[e] - alone).abs().max().item() for e, alone in losses[False].items()) > 1e-2


# --- epochs and resume --------------------------------------------------------------------------


@pytest.mark.parametrize("packing", [False, True])
def test_resume_at_sample_k_gives_the_uninterrupted_batches_across_an_epoch_boundary(
        tmp_path, role_tokenizer, datasets_cache, packing):
    tok = with_template(role_tokenizer, GENERATION_TEMPLATE)
    path = write_rows(tmp_path / "chats.jsonl", make_chats(60))
    train = build_datasets(cfg(path, datasets_cache, seq_len=64, packing=packing), tok, rank=1, world_size=2)[0]
    micro = 3
    steps = 2 * len(train) // micro + 3  # past two epoch boundaries
    full = list(itertools.islice(batches(train, micro), steps))
    start = steps // 2
    resumed = list(itertools.islice(batches(train, micro, start_sample=start * micro), steps - start))
    assert start * micro < len(train) * 2 < steps * micro  # the resumed part crosses a boundary
    for a, b in zip(full[start:], resumed, strict=True):
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_one_epoch_is_every_training_block_once_over_the_ranks(tmp_path, role_tokenizer, datasets_cache):
    tok = with_template(role_tokenizer, PLAIN_TEMPLATE)
    path = write_rows(tmp_path / "chats.jsonl", make_chats(41))
    ranks = [build_datasets(cfg(path, datasets_cache, seq_len=64), tok, rank=r, world_size=2)[0] for r in (0, 1)]
    n = ranks[0].samples_per_epoch
    assert n == ranks[0].num_blocks == ranks[1].num_blocks == 39  # 41 examples, 2 (5%) held out
    assert len(ranks[0]) == len(ranks[1]) == 19  # samples per rank and epoch
    # global sample g is rank g % 2's sample g // 2; epoch e is global samples [e n, (e + 1) n)
    epochs = [[ranks[g % 2].block_index(g // 2) for g in range(e * n, (e + 1) * n)] for e in (0, 1)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(n))
    assert epochs[0] != epochs[1]  # a new order each epoch


# --- sources ------------------------------------------------------------------------------------


def test_parquet_and_saved_instruction_rows_load_by_their_columns(tmp_path, role_tokenizer, datasets_cache):
    import datasets

    tok = with_template(role_tokenizer, PLAIN_TEMPLATE)
    datasets.Dataset.from_list(make_chats(6)).to_parquet(str(tmp_path / "chats.parquet"))
    pairs = [{"prompt": f"Define {w}.", "completion": f" {w}, a word."} for w in WORDS]
    datasets.Dataset.from_list(pairs).save_to_disk(str(tmp_path / "saved"))
    chats = build_datasets(cfg(tmp_path / "chats.parquet", datasets_cache), tok)
    saved = build_datasets(cfg(tmp_path / "saved", datasets_cache), tok)
    assert sum(d.num_blocks for d in chats) == 6 and sum(d.num_blocks for d in saved) == len(WORDS)


def test_the_fields_of_the_rows_say_what_they_are():
    assert data_format(["messages", "text"]) == CHAT
    assert data_format(["prompt", "completion", "id"]) == PROMPT_COMPLETION
    assert data_format(["prompt", "text"]) == data_format(["body"]) == TEXT
    assert data_format(["messages", "body"], text_field="body") == TEXT  # --text-field NAME, and the rows have it


def test_max_seq_len_and_packing_are_run_options():
    from adaptive.config.commandline import parse
    from adaptive.config.run import LAUNCH, TRAIN, to_argv

    config = parse(TRAIN, ["--max-seq-len", "512", "--packing"])
    assert (config.data.seq_len, config.data.packing) == (512, True)
    assert to_argv(config, TRAIN) == ["--seq-len", "512", "--packing"]
    assert parse(LAUNCH, ["--seq-len", "512"]).data.packing is False


# --- bad input: one line, before anything is written --------------------------------------------

GOOD_CHAT = {"messages": CHATS[1]}


@pytest.mark.parametrize("rows, needle", [
    ([GOOD_CHAT, {"text": "plain", "id": 2}], ":2 has no 'messages' field (fields: text, id)"),
    ([GOOD_CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}],
     ":2: message 2 has no content (fields: role)"),
    ([GOOD_CHAT, {"messages": [{"role": "bot", "content": "hi"}]}],
     ":2: message 1 has role 'bot'; use one of system, user, assistant, tool"),
    ([GOOD_CHAT, {"messages": [{"role": "user", "content": ["hi"]}]}],
     ":2: message 1's content must be a string, got array [\"hi\"]"),
    ([GOOD_CHAT, {"messages": []}], ":2: 'messages' must be a non-empty list of messages, got array []"),
    ([{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": 5}], ":2: 'completion' must be a string, got number 5"),
    ([{"prompt": "p", "completion": "c"}, {"prompt": "p"}], ":2 has no 'completion' field (fields: prompt)"),
], ids=["no-messages", "no-content", "unknown-role", "content-list", "empty-chat", "completion-number",
        "no-completion"])
def test_a_bad_instruction_row_is_one_line_naming_its_file_line_and_field(
        tmp_path, role_tokenizer, datasets_cache, rows, needle):
    path = write_rows(tmp_path / "rows.jsonl", rows)
    with pytest.raises(AdaptiveError) as before_the_run:  # what a run checks before it writes anything
        check_local_rows(str(path))
    assert one_line(before_the_run).startswith(f"{path}{needle}")
    with pytest.raises(AdaptiveError) as building:
        build_datasets(cfg(path, datasets_cache), with_template(role_tokenizer, PLAIN_TEMPLATE))
    assert one_line(building) == one_line(before_the_run)


def test_a_bad_parquet_or_saved_chat_row_names_its_row(tmp_path):
    import datasets

    rows = [GOOD_CHAT, {"messages": [{"role": "bot", "content": "hi"}]}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "chats.parquet"))
    with pytest.raises(AdaptiveError) as err:
        check_local_rows(str(tmp_path / "chats.parquet"))
    assert one_line(err).startswith(f"{tmp_path / 'chats.parquet'} row 2: message 1 has role 'bot'; use one of")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(AdaptiveError) as err:
        check_local_rows(str(tmp_path / "saved"))
    assert one_line(err).startswith(f"{tmp_path / 'saved'} row 2: message 1 has role 'bot'; use one of")


def test_chat_data_need_a_tokenizer_with_a_chat_template(tmp_path, role_tokenizer, datasets_cache):
    path = write_rows(tmp_path / "chats.jsonl", [{"messages": chat} for chat in CHATS])
    with pytest.raises(AdaptiveError) as err:
        build_datasets(cfg(path, datasets_cache), role_tokenizer)
    assert "the tokenizer has no chat template" in one_line(err)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path, role_tokenizer, datasets_cache):
    path = write_rows(tmp_path / "chats.jsonl", [{"messages": chat} for chat in reversed(CHATS)])
    build_datasets(cfg(path, datasets_cache), with_template(role_tokenizer, PLAIN_TEMPLATE))  # cached renderings
    with pytest.raises(AdaptiveError) as err:  # ... of another template: not reused
        build_datasets(cfg(path, datasets_cache), with_template(role_tokenizer, REWRITING_TEMPLATE))
    message = one_line(err)
    assert f"{path} row 2: the tokenizer's chat template does not render the chat up to message 3" in message
    assert "{% generation %}" in message
