"""A start-of-run check of the model stage: load the checkpoint and tokenizer, run a forward pass, greedy-decode.

It catches a broken checkpoint or tokenizer before any engine or trainer starts, with a one-line report.
"""

from __future__ import annotations

from pathlib import Path

import torch


def model_smoke_check(model_dir: Path, dtype: str = "float32", new_tokens: int = 8) -> str:
    from transformers import AutoTokenizer

    from miles_hpc.models import load_pretrained

    model = load_pretrained(model_dir, dtype=getattr(torch, dtype))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = tok.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        # Full recompute per token: this is a check, not the engine (which keeps a KV cache).
        for _ in range(new_tokens):
            logits = model(ids)
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    n_params = sum(p.numel() for p in model.parameters())
    text = tok.decode(ids[0, -new_tokens:].tolist())
    return f"model ok: {n_params / 1e6:.2f}M params, logits {list(logits.shape)}, greedy continuation {text!r}"
