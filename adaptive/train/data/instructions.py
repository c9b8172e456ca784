"""Instruction rows as token ids with a loss mask: chats and prompt/completion pairs, trained on the answers only.

What the rows are follows from their fields (`data_format`):

* **chat**: `messages`, a list of {"role", "content"} (roles: system, user, assistant, tool), rendered with the
  tokenizer's own chat template; the loss is on the assistant turns only.
* **prompt/completion**: two strings; the prompt as the tokenizer encodes a text (its BOS, if it adds one), then
  the completion and EOS; the loss is on the completion and the EOS.
* **text**: anything else (a `--text-field` other than "text" that the rows have wins over both): documents, packed
  as before (`packing`).

Which tokens an assistant turn owns: a template with `{% generation %}` blocks marks them itself
(`apply_chat_template(..., return_assistant_tokens_mask=True)`). Most downloaded templates (Llama 3's, Qwen's)
have none. For those, a turn owns what it adds to the rendering: messages[:i] with the generation prompt against
messages[:i+1]. That holds only if the template renders the start of a conversation as the start of the whole
(the prefix property, checked on every turn); a template that rewrites earlier turns (Qwen3's drops the empty
reasoning block of past turns) breaks it and is refused, naming the row.

Labels are the ids on trained tokens and -100 elsewhere; an example's first token is never trained (nothing
before it predicts it, and in a packed block the previous example's last token would).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from adaptive.errors import AdaptiveError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TEXT, CHAT, PROMPT_COMPLETION = "text", "chat", "prompt/completion"
ROLES = ("system", "user", "assistant", "tool")
# what transformers itself looks for before it tracks assistant spans (utils/chat_template_utils.py)
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def data_format(fields: Collection[str], text_field: str = "text") -> str:
    """TEXT, CHAT or PROMPT_COMPLETION for rows with these fields."""
    if text_field != "text" and text_field in fields:
        return TEXT
    if "messages" in fields:
        return CHAT
    if "prompt" in fields and "completion" in fields:
        return PROMPT_COMPLETION
    return TEXT


def _kind(value: Any) -> str:
    """JSON's name for a value's type, and the value when short."""
    if value is None:
        return "null"
    name = {bool: "boolean", dict: "object", list: "array", str: "string", int: "number", float: "number"}.get(
        type(value), type(value).__name__)
    return f"{name} {json.dumps(value, default=str)[:40]}"


def _check_message(where: str, k: int, message: Any) -> None:
    if not isinstance(message, Mapping):
        raise AdaptiveError(f"{where}: message {k} is {_kind(message)}, not an object like "
                            '{"role": "user", "content": "..."}')
    role, content = message.get("role"), message.get("content")
    if role is None or content is None:
        missing = " and ".join(name for name, v in (("role", role), ("content", content)) if v is None)
        raise AdaptiveError(f"{where}: message {k} has no {missing} (fields: {', '.join(message) or 'none'}); "
                            'each message is {"role": "...", "content": "..."}')
    if role not in ROLES:
        raise AdaptiveError(f"{where}: message {k} has role {role!r}; use one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise AdaptiveError(f"{where}: message {k}'s content must be a string, got {_kind(content)}")


def check_row(where: str, row: Any, fmt: str) -> None:
    """AdaptiveError (one line naming `where` and the field) unless `row` is a valid `fmt` row."""
    if not isinstance(row, Mapping):
        raise AdaptiveError(f"{where} is {_kind(row)}, not an object")
    if fmt == CHAT:
        if "messages" not in row:
            raise AdaptiveError(f"{where} has no 'messages' field (fields: {', '.join(row) or 'none'}); a chat "
                                'dataset has {"messages": [{"role": "user", "content": "..."}, ...]} in every row')
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise AdaptiveError(f"{where}: 'messages' must be a non-empty list of messages, got {_kind(messages)}")
        for k, message in enumerate(messages, 1):
            _check_message(where, k, message)
    elif fmt == PROMPT_COMPLETION:
        for name in ("prompt", "completion"):
            if name not in row:
                raise AdaptiveError(f"{where} has no {name!r} field (fields: {', '.join(row) or 'none'}); a "
                                    'prompt/completion dataset has {"prompt": "...", "completion": "..."} in every row')
            if not isinstance(row[name], str):
                raise AdaptiveError(f"{where}: {name!r} must be a string, got {_kind(row[name])}")
    else:
        raise AssertionError(fmt)


def check_rows(rows: Iterable[tuple[str, Any]], fmt: str) -> None:
    """`check_row` on each (where, row)."""
    for where, row in rows:
        check_row(where, row, fmt)


def require_chat_template(tokenizer: PreTrainedTokenizerFast, label: str) -> None:
    """Chat data need the tokenizer's own template: refuse one without."""
    if not tokenizer.chat_template:
        raise AdaptiveError(f"{label!r} holds chats (messages), and the tokenizer has no chat template to render them "
                            "with (a base model's often has none): pass --tokenizer DIR of one that has (its instruct "
                            "model's), or give the rows prompt/completion fields")


def has_generation_blocks(tokenizer: PreTrainedTokenizerFast) -> bool:
    """Whether the template marks assistant tokens itself ({% generation %} ... {% endgeneration %})."""
    template = tokenizer.get_chat_template()  # a tokenizer's named templates: the default one, as apply_chat_template
    return _GENERATION_BLOCK.search(template) is not None


# ---------------------------------------------------------------------------------------------
# Rendering: (input ids, trained flags) per example


def _messages(messages: list[Mapping[str, Any]]) -> list[dict[str, str]]:
    # rows read through pyarrow carry every message key of the file, None where a message lacks it
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _apply(tokenizer: PreTrainedTokenizerFast, where: str, messages: list[dict[str, str]], **kwargs: Any) -> Any:
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    except TemplateError as err:  # the template's own raise_exception ("roles must alternate user/assistant")
        raise AdaptiveError(f"{where}: the tokenizer's chat template refuses this chat: {err}") from None


def render_chat(tokenizer: PreTrainedTokenizerFast, messages: list[Mapping[str, Any]],
                where: str = "chat") -> tuple[list[int], list[bool]]:
    """The chat's token ids and which of them are assistant tokens (see the module docstring)."""
    messages = _messages(messages)
    if has_generation_blocks(tokenizer):
        out = _apply(tokenizer, where, messages, return_dict=True, return_assistant_tokens_mask=True)
        ids, trained = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    else:
        ids = list(_apply(tokenizer, where, messages, return_dict=False))
        trained = [False] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            # an empty conversation cannot be rendered: an opening assistant turn owns its header too
            before = list(_apply(tokenizer, where, messages[:i], return_dict=False, add_generation_prompt=True)) if i else []
            through = list(_apply(tokenizer, where, messages[:i + 1], return_dict=False))
            if through[:len(before)] != before or ids[:len(through)] != through:
                raise AdaptiveError(
                    f"{where}: the tokenizer's chat template does not render the chat up to message {i + 1} as the "
                    "start of the whole chat, so the assistant tokens cannot be told apart; use a template with "
                    "{% generation %} blocks (transformers' return_assistant_tokens_mask) or prompt/completion rows")
            trained[len(before):len(through)] = [True] * (len(through) - len(before))
    if trained:
        trained[0] = False
    return ids, trained


def render_prompt_completions(tokenizer: PreTrainedTokenizerFast, prompts: list[str],
                              completions: list[str]) -> list[tuple[list[int], list[bool]]]:
    """Per pair: the prompt's ids (with the tokenizer's special tokens), the completion's and EOS; the
    completion and EOS trained."""
    eos = tokenizer.eos_token_id
    prompt_ids = tokenizer(prompts)["input_ids"]
    completion_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    out = []
    for p, c in zip(prompt_ids, completion_ids):
        ids = list(p) + list(c) + [eos]
        trained = [False] * len(p) + [True] * (len(c) + 1)
        trained[0] = False
        out.append((ids, trained))
    return out


def renderer(tokenizer: PreTrainedTokenizerFast, fmt: str, label: str) -> Callable[[dict[str, list], list[int]], dict[str, list]]:
    """A batched `datasets.map` function (with indices): rows -> {"input_ids", "trained"}."""
    if fmt == CHAT:
        require_chat_template(tokenizer, label)

    def render(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        if fmt == CHAT:
            pairs = [render_chat(tokenizer, messages, f"{label} row {i + 1}")
                     for messages, i in zip(batch["messages"], indices)]
        else:
            pairs = render_prompt_completions(tokenizer, batch["prompt"], batch["completion"])
        return {"input_ids": [ids for ids, _ in pairs], "trained": [trained for _, trained in pairs]}

    return render


__all__ = ["CHAT", "PROMPT_COMPLETION", "ROLES", "TEXT", "check_row", "check_rows", "data_format",
           "has_generation_blocks", "render_chat", "render_prompt_completions", "renderer", "require_chat_template"]
