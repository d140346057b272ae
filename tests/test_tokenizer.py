"""The local byte-level tokenizer loads offline with transformers.AutoTokenizer and renders ChatML append-only."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from miles_hpc.models.tokenizer import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, special_token_id, write_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


def test_bytes_and_specials(tok) -> None:
    text = "héllo 12+3=15 ∑\n\t"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # id == byte value
    assert tok.decode(ids) == text
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == special_token_id(EOS_TOKEN) == 258
    assert tok.pad_token == PAD_TOKEN and tok.pad_token_id == 256
    for t in SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(t) == special_token_id(t)
        # a special token in text is one id, not its bytes
        assert tok(f"a{t}b", add_special_tokens=False)["input_ids"] == [97, special_token_id(t), 98]


def test_chatml_template_and_append_only(tok) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    longer = msgs + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
    base = tok.apply_chat_template(msgs, tokenize=False)
    assert tok.apply_chat_template(longer, tokenize=False).startswith(base)


def test_files_written(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
