"""Prompt datasets: strict JSONL/Parquet loading with file:line errors, chat rendering, resumable iteration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import require
from transformers import AutoTokenizer

from miles_hpc.data.prompts import PromptDataError, PromptIterator, PromptRecord, load_prompts, render_prompt
from miles_hpc.models.tokenizer import write_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_loads_text_and_chat_prompts(tmp_path: Path) -> None:
    rows = [
        {"prompt": "2+2=", "label": "4", "source": "gsm", "level": 1},
        {"prompt": [{"role": "user", "content": "hi"}], "label": {"any": ["json"]}},
    ]
    recs = load_prompts(write_jsonl(tmp_path / "p.jsonl", rows))
    assert recs[0] == PromptRecord(prompt_id=0, prompt="2+2=", label="4", metadata={"source": "gsm", "level": 1})
    assert recs[1].prompt_id == 1 and recs[1].prompt == [{"role": "user", "content": "hi"}]
    assert recs[1].label == {"any": ["json"]} and recs[1].metadata == {}
    # custom keys; label_key=None reads unlabelled data
    recs = load_prompts(write_jsonl(tmp_path / "q.jsonl", [{"q": "x", "a": 1}]), prompt_key="q", label_key="a")
    assert recs[0].prompt == "x" and recs[0].label == 1
    recs = load_prompts(tmp_path / "q.jsonl", prompt_key="q", label_key=None)
    assert recs[0].label is None and recs[0].metadata == {"a": 1}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"prompt": "x", "label": ', "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"question": "x", "label": "1"}, "missing prompt key 'prompt'"),
        ({"prompt": "x"}, "missing label key 'label'"),
        ({"prompt": 3, "label": "1"}, "must be a string or a list of chat messages, got int"),
        ({"prompt": "   ", "label": "1"}, "empty string"),
        ({"prompt": [], "label": "1"}, "empty message list"),
        ({"prompt": [{"role": "user"}], "label": "1"}, r"'prompt'\[0\] must be a message"),
        ("", "blank line"),
    ],
)
def test_bad_jsonl_rows_name_file_and_line(tmp_path: Path, bad: object, message: str) -> None:
    good = {"prompt": "ok", "label": "1"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, bad, good])
    with pytest.raises(PromptDataError, match=message) as e:
        load_prompts(path)
    assert str(e.value).startswith(f"{path}:3: ") and e.value.line == 3


def test_a_line_that_is_not_utf8_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok", "label": "1"}\n{"prompt": "caf\xe9", "label": "1"}\n')
    with pytest.raises(PromptDataError, match="not UTF-8: byte 0xe9 at column 16") as e:
        load_prompts(path)
    assert str(e.value).startswith(f"{path}:2: ")


def test_whole_file_errors(tmp_path: Path) -> None:
    with pytest.raises(PromptDataError, match="no such file"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(PromptDataError, match="holds no prompts"):
        load_prompts(tmp_path / "empty.jsonl")
    (tmp_path / "p.csv").write_text("prompt\n")
    with pytest.raises(PromptDataError, match="unknown format"):
        load_prompts(tmp_path / "p.csv")


def test_parquet_round_trip_and_bad_row(tmp_path: Path) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        require(False, "pyarrow")
    rows = [{"prompt": f"{i}+1=", "label": str(i + 1), "level": i} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    recs = load_prompts(tmp_path / "p.parquet")
    assert [(r.prompt_id, r.prompt, r.label, r.metadata) for r in recs] == [
        (i, r["prompt"], r["label"], {"level": r["level"]}) for i, r in enumerate(rows)
    ]
    assert recs == load_prompts(write_jsonl(tmp_path / "p.jsonl", rows))  # same records from either format
    rows[3]["prompt"] = ""
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(PromptDataError, match=r"bad\.parquet row 4: 'prompt' is an empty string"):
        load_prompts(tmp_path / "bad.parquet")
    with pytest.raises(PromptDataError, match="no column 'answer'"):
        load_prompts(tmp_path / "p.parquet", label_key="answer")


def test_render_prompt_with_and_without_template(tok) -> None:
    rec = PromptRecord(prompt_id=0, prompt="3+5=", label="8")
    ids = render_prompt(rec, tok, apply_chat_template=True, system_prompt=None)
    assert tok.decode(ids) == "<|im_start|>user\n3+5=<|im_end|>\n<|im_start|>assistant\n"
    ids = render_prompt(rec, tok, apply_chat_template=True, system_prompt="be brief")
    assert tok.decode(ids).startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n3+5=")
    assert render_prompt(rec, tok, apply_chat_template=False) == list(b"3+5=")
    chat = PromptRecord(prompt_id=1, prompt=[{"role": "system", "content": "S"}, {"role": "user", "content": "u"}])
    text = tok.decode(render_prompt(chat, tok, system_prompt="ignored: the list has its own"))
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="message list"):
        render_prompt(chat, tok, apply_chat_template=False)
    with pytest.raises(ValueError, match="system_prompt needs apply_chat_template"):
        render_prompt(rec, tok, apply_chat_template=False, system_prompt="s")


def test_render_prompt_duck_typed_tokenizer() -> None:
    class Tok:  # only apply_chat_template + __call__, no encode
        def apply_chat_template(self, messages, *, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return "|".join(m["content"] for m in messages) + ">"

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [ord(c) for c in text]}

    rec = PromptRecord(prompt_id=0, prompt="ab")
    assert render_prompt(rec, Tok(), apply_chat_template=True, system_prompt="s") == [ord(c) for c in "s|ab>"]


def _records(n: int) -> list[PromptRecord]:
    return [PromptRecord(prompt_id=i, prompt=f"p{i}") for i in range(n)]


def _ids(batch: list[PromptRecord]) -> list[int]:
    return [r.prompt_id for r in batch]


def test_iterator_epochs_are_permutations_and_deterministic() -> None:
    it = PromptIterator(_records(10), batch_size=4, seed=7, shuffle=True)
    seen = [i for _ in range(5) for i in _ids(next(it))]  # 20 = two epochs exactly
    assert sorted(seen[:10]) == sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # reshuffled per epoch
    again = PromptIterator(_records(10), batch_size=4, seed=7, shuffle=True)
    assert [i for _ in range(5) for i in _ids(next(again))] == seen
    other = PromptIterator(_records(10), batch_size=4, seed=8, shuffle=True)
    assert [i for _ in range(5) for i in _ids(next(other))] != seen
    plain = PromptIterator(_records(5), batch_size=3, seed=7, shuffle=False)
    assert [_ids(next(plain)) for _ in range(3)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]
    assert plain.state_dict()["epoch"] == 1 and plain.state_dict()["position"] == 4


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 7])
def test_iterator_resume_sees_identical_order(stop_after: int) -> None:
    ref = PromptIterator(_records(7), batch_size=3, seed=1, shuffle=True)
    expected = [_ids(next(ref)) for _ in range(10)]
    first = PromptIterator(_records(7), batch_size=3, seed=1, shuffle=True)
    got = [_ids(next(first)) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as JSON
    resumed = PromptIterator(_records(7), batch_size=3, seed=1, shuffle=True)
    resumed.load_state_dict(state)
    got += [_ids(next(resumed)) for _ in range(10 - stop_after)]
    assert got == expected


def test_iterator_refuses_foreign_state() -> None:
    it = PromptIterator(_records(7), batch_size=3, seed=1)
    with pytest.raises(ValueError, match="num_records=8"):
        it.load_state_dict(PromptIterator(_records(8), batch_size=3, seed=1).state_dict())
    with pytest.raises(ValueError, match="seed=2"):
        it.load_state_dict(PromptIterator(_records(7), batch_size=3, seed=2).state_dict())
    with pytest.raises(ValueError, match="out of range"):
        it.load_state_dict({"epoch": 0, "position": 7})
