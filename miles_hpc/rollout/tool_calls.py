"""Tool calls in generated text -> OpenAI `tool_calls` (stage: rollout; used by `rollout/sessions.py`). Pure
functions, no I/O.

The formats are those of the families this project ships, as their chat templates teach them (and as SGLang's
`--tool-call-parser` of the same name reads them):
- ``hermes`` (Qwen2.5 / Qwen3 / Qwen3-MoE, SGLang's ``qwen25``): ``<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>``, one block per call;
- ``glm45`` (GLM-4.5 / GLM-5, SGLang's ``glm``): ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>
  ...</tool_call>``, each value JSON when it parses as JSON, else the string;
- ``deepseek_v3`` (SGLang's ``deepseekv3``): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  \\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``;
- ``deepseek_v31`` (DeepSeek-V3.1 / V3.2, SGLang's ``deepseekv31``): ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>`` inside the same section markers;
- ``kimi_k2``: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}
  <|tool_call_end|><|tool_calls_section_end|>``.

Invariants: `parse_tool_calls` returns the text outside the call markup as the message content (stripped) and the
calls in order, each with its arguments as a JSON object string (OpenAI's type); a block that does not parse (cut
by max_tokens, arguments not JSON) is left in the content, not dropped and not guessed at. `detect_format` picks the
format from the chat template's own markers (the tokenizer config), None when it teaches none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["FORMATS", "ToolCall", "detect_format", "parse_tool_calls"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's `function.arguments`
    id: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _json_object(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _hermes(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        parsed = _json_object(args)
        return None if parsed is None else ToolCall(obj["name"], parsed)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm45(body: str) -> ToolCall | None:
    name, _, rest = body.partition("<arg_key>")
    name = name.strip()
    if not name or "\n" in name or "<" in name:
        return None
    args: dict[str, Any] = {}
    for key, value in _GLM_ARG.findall("<arg_key>" + rest if rest else ""):
        try:
            args[key.strip()] = json.loads(value)
        except ValueError:
            args[key.strip()] = value
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _deepseek_v3(body: str) -> ToolCall | None:
    m = re.fullmatch(r"\s*function<｜tool▁sep｜>([^\n]+)\n```json\n(.*)\n```\s*", body, re.DOTALL)
    args = _json_object(m.group(2)) if m else None
    return None if m is None or args is None else ToolCall(m.group(1).strip(), args)


def _deepseek_v31(body: str) -> ToolCall | None:
    name, sep, rest = body.partition("<｜tool▁sep｜>")
    args = _json_object(rest) if sep else None
    return None if args is None or not name.strip() else ToolCall(name.strip(), args)


def _kimi_k2(body: str) -> ToolCall | None:
    head, sep, rest = body.partition("<|tool_call_argument_begin|>")
    m = re.fullmatch(r"\s*(?:functions\.)?([^:\s]+)(?::\d+)?\s*", head)
    args = _json_object(rest) if sep else None
    return None if m is None or args is None else ToolCall(m.group(1), args)


_DS_CALL = r"<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>"
# format -> (section regex or None, call regex inside it, parse one call's body)
FORMATS: dict[str, tuple[str | None, str, Any]] = {
    "hermes": (None, r"<tool_call>(.*?)</tool_call>", _hermes),
    "glm45": (None, r"<tool_call>(.*?)</tool_call>", _glm45),
    "deepseek_v3": (r"<｜tool▁calls▁begin｜>(.*?)<｜tool▁calls▁end｜>", _DS_CALL, _deepseek_v3),
    "deepseek_v31": (r"<｜tool▁calls▁begin｜>(.*?)<｜tool▁calls▁end｜>", _DS_CALL, _deepseek_v31),
    "kimi_k2": (
        r"<\|tool_calls_section_begin\|>(.*?)<\|tool_calls_section_end\|>",
        r"<\|tool_call_begin\|>(.*?)<\|tool_call_end\|>",
        _kimi_k2,
    ),
}


def detect_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches (its markers), None when it renders no tool calls."""
    t = chat_template or ""
    if "<|tool_calls_section_begin|>" in t:
        return "kimi_k2"
    if "<｜tool▁calls▁begin｜>" in t:
        return "deepseek_v3" if "```json" in t else "deepseek_v31"
    if "<arg_key>" in t:
        return "glm45"
    if "<tool_call>" in t:
        return "hermes"
    return None


def parse_tool_calls(text: str, fmt: str | None, *, id_prefix: str = "call") -> tuple[str, list[ToolCall]]:
    """(content, calls) of an assistant message in format `fmt` (None: no parsing). Calls get ids
    ``{id_prefix}_{index}``; blocks that do not parse stay in the content."""
    if fmt is None:
        return text, []
    if fmt not in FORMATS:
        raise ValueError(f"tool-call format {fmt!r}: one of {', '.join(FORMATS)}")
    section, call, parse = FORMATS[fmt]
    calls: list[ToolCall] = []

    def take(m: re.Match[str]) -> str:
        got = parse(m.group(1))
        if got is None:
            return m.group(0)
        calls.append(ToolCall(got.name, got.arguments, f"{id_prefix}_{len(calls)}"))
        return ""

    if section is None:
        content = re.sub(call, take, text, flags=re.DOTALL)
    else:

        def take_section(m: re.Match[str]) -> str:
            before = len(calls)
            rest = re.sub(call, take, m.group(1), flags=re.DOTALL)
            if rest.strip():  # a block in it did not parse: the section stays whole, none of its calls counted
                del calls[before:]
                return m.group(0)
            return ""

        content = re.sub(section, take_section, text, flags=re.DOTALL)
    return content.strip(), calls
