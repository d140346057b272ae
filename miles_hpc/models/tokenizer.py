"""A byte-level tokenizer built locally (no hub), saved in the HF format ``AutoTokenizer`` loads offline.

Invariants:
- Ids 0..255 are the 256 bytes (id == byte value), so any UTF-8 text round-trips and ids are easy to read.
- Special tokens follow at 256.. in ``SPECIAL_TOKENS`` order; ``<|im_end|>`` is the end-of-turn (eos) token and
  ``<|endoftext|>`` the padding token, as in ChatML-style models.
- The chat template is ChatML (``<|im_start|>role\\n...<|im_end|>\\n``), stored in ``tokenizer_config.json``.
  Rendering is append-only: a conversation's rendering is a prefix of the rendering with one more message, which
  TITO (token-in token-out) relies on when it tokenizes only the suffix of a new message.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
)
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
NUM_BYTE_TOKENS = 256

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def byte_to_unicode() -> dict[int, str]:
    """The reversible byte -> printable character table of byte-level BPE (GPT-2 convention).

    Printable Latin-1 bytes map to themselves; the others are shifted to code points from 256 up, so the
    vocabulary holds no whitespace or control characters.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {}
    shift = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def special_token_id(token: str) -> int:
    return NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(token)


def build_tokenizer_json() -> str:
    """Serialized ``tokenizers.Tokenizer``: byte-level BPE with no merges (one token per byte) + special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no GPT-2 word splitting; with no merges it would only cost time.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    for t in SPECIAL_TOKENS:  # the ids are part of the format: check, do not assume
        assert tok.token_to_id(t) == special_token_id(t), t
    return tok.to_str()


def write_tokenizer(out_dir: str | Path, model_max_length: int = 2048) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(build_tokenizer_json())
    added = {
        str(special_token_id(t)): {
            "content": t,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
