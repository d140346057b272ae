"""TITO conversations (rollout/conversation.py): the ids the trainer gets are exactly what was sent to and returned
by the engine, turn after turn, with ChatML and with a template that adds a reasoning block; a template that
rewrites history fails loudly, naming the message."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from miles_hpc.data.sample import token_hash
from miles_hpc.models.tokenizer import CHATML_TEMPLATE, EOS_TOKEN, special_token_id, write_tokenizer
from miles_hpc.rollout.conversation import Conversation, TITOError

EOS = special_token_id(EOS_TOKEN)
# ChatML whose assistant turns carry a reasoning block: the generation prompt opens "<think>\n", history keeps it.
REASONING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
# Drops the reasoning of earlier assistant turns (as some released templates do): not append-only.
STRIPPING_TEMPLATE = REASONING_TEMPLATE.replace(
    "message['content'] + '<|im_end|>'", "message['content'].split('</think>')[-1] + '<|im_end|>'", 1
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return AutoTokenizer.from_pretrained(str(d))


def text_ids(tok, rng: random.Random, n: int) -> list[int]:
    return tok("".join(rng.choice("abcdef xyz=0123456789\n") for _ in range(n)), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, REASONING_TEMPLATE], ids=["chatml", "reasoning"])
def test_random_conversations_keep_every_id_sent_and_returned(tokenizer, template: str) -> None:
    tokenizer.chat_template = template
    rng = random.Random(0)
    for _ in range(60):
        conv = Conversation.start(
            tokenizer,
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "task " + str(rng.random())}],
        )
        pieces, mask = [list(conv.ids)], [0] * len(conv.ids)
        for turn in range(rng.randint(1, 5)):
            out = text_ids(tokenizer, rng, rng.randint(0, 12))
            if rng.random() < 0.8:
                out.append(EOS)  # stopped on the end-of-turn token; else cut by max_new_tokens
            versions = [turn] * len(out)
            conv.add_generated(
                out,
                [-0.5] * len(out),
                versions,
                prompt_tokens=len(conv.ids),
                finish="stop" if out and out[-1] == EOS else "length",
            )
            pieces.append(out)
            mask += [1] * len(out)
            role = rng.choice(["tool", "user"])
            held = tokenizer.decode(conv.ids, skip_special_tokens=False)
            suffix = conv.add_message({"role": role, "content": "out " + str(rng.randint(0, 999))})
            pieces.append(suffix)
            mask += [0] * len(suffix)
            # Re-rendering never changes earlier tokens: the held text is a prefix of the full rendering.
            rendered = tokenizer.apply_chat_template(conv.messages, tokenize=False, add_generation_prompt=True)
            assert rendered.startswith(held) and tokenizer.decode(conv.ids, skip_special_tokens=False) == rendered
        flat = [t for p in pieces for t in p]
        assert conv.ids == flat and conv.loss_mask == mask
        assert len(conv.logprobs) == len(conv.versions) == len(flat)
        sample = conv.to_sample(prompt_id=1, group_id=2)
        assert sample.tokens == flat and sample.token_hash == token_hash(flat)
        assert sample.prompt_len == len(pieces[0]) and sample.metadata["turns"] == conv.turns


def test_a_template_that_rewrites_history_fails_naming_the_message(tokenizer) -> None:
    tokenizer.chat_template = STRIPPING_TEMPLATE
    conv = Conversation.start(tokenizer, [{"role": "user", "content": "hi"}])
    think = tokenizer("plan</think>answer", add_special_tokens=False)["input_ids"] + [EOS]
    conv.add_generated(think, None, [0] * len(think))
    with pytest.raises(TITOError, match=r"message 2 \(role 'tool'\).*first difference at character"):
        conv.add_message({"role": "tool", "content": "result"})


def test_generated_ids_are_kept_even_when_retokenizing_would_change_them(tokenizer) -> None:
    tokenizer.chat_template = CHATML_TEMPLATE
    conv = Conversation.start(tokenizer, [{"role": "user", "content": "x"}])
    odd = [ord("a"), ord("b"), EOS]
    conv.add_generated(odd, [0.0] * 3, [1, 1, 1], prompt_tokens=len(conv.ids), cached_tokens=2)
    assert conv.ids[-3:] == odd and conv.cache_hit_rate == 2 / (len(conv.ids) - 3)
    with pytest.raises(ValueError, match="log-probs"):
        conv.add_generated([1, 2], [0.0], [1, 1])
