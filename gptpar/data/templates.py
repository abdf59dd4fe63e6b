"""How a prompt/response pair becomes token ids: a prompt (what greedy decoding starts from) and a response (what
the loss counts, ending in the end token, where decoding stops).

- The plain template, for gptpar's own tokenizers: `prompt <sep> response <eos>`, two ids past the vocabulary that
  no text can produce (gptpar adds them to the model's table).
- The plain template of a folder's tokenizer without a chat template: `prompt <eos> response <eos>` with the
  tokenizer's own end token, adding no ids (pretrained weights have a fixed table).
- A folder's chat template (data.task=sft): the prompt is the user's turn rendered with the generation prompt, the
  response what rendering the assistant's turn too adds after it (its end-of-turn tokens included). A template
  that does not put the response after the prompt would train on something else, so it fails, naming the folder.

Prompts keep at most `data.max_source_len` tokens (a chat prompt's template tokens included: the question is cut to
fit) and responses `data.max_target_len` and the end token, so an example fits the width the config checked.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gptpar.config import DataConfig
from gptpar.data.tokenizer import ChatRenderer, Tokenizer
from gptpar.errors import GptparError

Framed = tuple[list[np.ndarray], list[np.ndarray]]  # (prompts, responses)


def end_tokens(tokenizer: Tokenizer) -> tuple[int, int]:
    """(separator, end) ids: two past the vocabulary for gptpar's tokenizers, a folder's end token for both else."""
    if tokenizer.eos is None:
        return tokenizer.vocab_size, tokenizer.vocab_size + 1
    return tokenizer.eos, tokenizer.eos


def frame(pairs: Sequence[tuple[str, str]], tokenizer: Tokenizer, cfg: DataConfig, where: str) -> Framed:
    """The pairs as (prompt, response) ids; `where` names the tokenizer in a template's error."""
    if tokenizer.chat is not None and cfg.task == "sft":
        return _chat_framed(pairs, tokenizer, tokenizer.chat, cfg, where)
    sep, eos = end_tokens(tokenizer)
    sources = tokenizer.encode_each([prompt for prompt, _ in pairs])
    targets = tokenizer.encode_each([response for _, response in pairs])
    return ([_joined(ids[:cfg.max_source_len], [sep]) for ids in sources],
            [_joined(ids[:cfg.max_target_len], [eos]) for ids in targets])


def _joined(*parts: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.concatenate([np.asarray(part, dtype=np.int64) for part in parts])


def _chat_framed(pairs: Sequence[tuple[str, str]], tokenizer: Tokenizer, chat: ChatRenderer, cfg: DataConfig,
                 where: str) -> Framed:
    prompts, responses = [], []
    eos = end_tokens(tokenizer)[1]
    for question, answer in pairs:
        prompt_text, response_text = _chat_texts(chat, question, answer, where)
        prompt = tokenizer.encode_each([prompt_text])[0]
        if len(prompt) > cfg.max_source_len:
            prompt = _cut_question(chat, tokenizer, question, len(prompt), cfg.max_source_len, where)
        response = tokenizer.encode_each([response_text])[0].astype(np.int64)
        if len(response) > cfg.max_target_len + 1 or eos not in response:
            response = _joined(response[:cfg.max_target_len], [eos])
        prompts.append(prompt.astype(np.int64))
        responses.append(response)
    return prompts, responses


def _chat_texts(chat: ChatRenderer, question: str, answer: str, where: str) -> tuple[str, str]:
    """The rendered prompt, and the text the assistant's turn adds after it."""
    user = [{"role": "user", "content": question}]
    prompt = chat(user, True)
    full = chat([*user, {"role": "assistant", "content": answer}], False)
    if not full.startswith(prompt) or answer.strip() not in full[len(prompt):]:
        raise GptparError(f"{where}: its chat template drops the response (a user turn and an assistant turn render "
                          "without the assistant's text after the prompt); fix chat_template in tokenizer_config.json, "
                          "or delete it to use the plain template")
    return prompt, full[len(prompt):]


def _cut_question(chat: ChatRenderer, tokenizer: Tokenizer, question: str, rendered: int, budget: int,
                  where: str) -> np.ndarray:
    """The prompt with its question cut so that, with the template's own tokens, it keeps `budget` tokens."""
    ids = tokenizer.encode_each([question])[0]
    keep = budget - (rendered - len(ids))
    if keep <= 0:
        raise GptparError(f"data.max_source_len={budget} leaves no room for the question: the chat template of {where}"
                          f" takes {rendered - len(ids)} tokens itself; raise data.max_source_len")
    while keep > 0:  # a cut can merge into other tokens when re-encoded: shorten until it fits
        prompt = tokenizer.encode_each([chat([{"role": "user", "content": tokenizer.decode(ids[:keep])}], True)])[0]
        if len(prompt) <= budget:
            return prompt
        keep -= len(prompt) - budget
    raise GptparError(f"data.max_source_len={budget}: no cut of a question fits the chat template of {where}; "
                      "raise data.max_source_len")
