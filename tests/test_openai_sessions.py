"""The OpenAI-compatible session endpoint (rollout/openai_server.py, sessions.py, tool_calls.py): tool calls parsed
in every shipped format, an agent written for the `openai` client running unchanged against it (a scripted engine
for tool calls, a real engine for the token-level record), history that is not the session's refused naming the
message, the API key enforced."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles_hpc.auth import ApiKeys
from miles_hpc.rollout.openai_server import OpenAISessionServer
from miles_hpc.rollout.responses import FinishReason, GenerateOutput, WeightVersionSpan
from miles_hpc.rollout.sessions import SessionStore
from miles_hpc.rollout.tool_calls import detect_format, parse_tool_calls

sys.path.insert(0, str(Path(__file__).parent))
from conftest import require  # noqa: E402

# ---------------------------------------------------------------- tool-call formats
ARGS = {"dir": "/data", "n": 3}


@pytest.mark.parametrize(
    "fmt,text",
    [
        ("hermes", 'I will look.\n<tool_call>\n{"name": "ls", "arguments": {"dir": "/data", "n": 3}}\n</tool_call>'),
        ("glm45", "I will look.<tool_call>ls\n<arg_key>dir</arg_key>\n<arg_value>/data</arg_value>\n"
         "<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"),
        ("deepseek_v3", "I will look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>ls\n```json\n"
         '{"dir": "/data", "n": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
        ("deepseek_v31", "I will look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>ls<｜tool▁sep｜>"
         '{"dir": "/data", "n": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
        ("kimi_k2", "I will look.<|tool_calls_section_begin|><|tool_call_begin|>functions.ls:0"
         '<|tool_call_argument_begin|>{"dir": "/data", "n": 3}<|tool_call_end|><|tool_calls_section_end|>'),
    ],
)  # fmt: skip
def test_each_format_parses_its_calls(fmt: str, text: str) -> None:
    content, calls = parse_tool_calls(text, fmt, id_prefix="c")
    assert content == "I will look."
    assert [(c.name, json.loads(c.arguments), c.id) for c in calls] == [("ls", ARGS, "c_0")]
    assert calls[0].to_openai()["function"] == {"name": "ls", "arguments": calls[0].arguments}


def test_several_calls_and_broken_blocks() -> None:
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call> and <tool_call>{"name": "b", "arguments": {"x": 1}}'
    two += "</tool_call>"
    content, calls = parse_tool_calls(two, "hermes")
    assert content == "and" and [c.name for c in calls] == ["a", "b"] and [c.id for c in calls] == ["call_0", "call_1"]
    cut = 'ok <tool_call>{"name": "a", "argum'  # cut by max_tokens: no closing tag, stays content
    assert parse_tool_calls(cut, "hermes") == (cut, [])
    bad = "<tool_call>not json</tool_call>"
    assert parse_tool_calls(bad, "hermes") == (bad, [])
    # a DeepSeek section with one good and one broken call stays whole; no call counted from it
    section = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
        "<｜tool▁call▁begin｜>b<｜tool▁sep｜>{oops<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    assert parse_tool_calls(section, "deepseek_v31") == (section, [])
    assert parse_tool_calls("plain <tool_call>", None) == ("plain <tool_call>", [])
    with pytest.raises(ValueError, match="one of hermes"):
        parse_tool_calls("x", "nope")


def test_the_format_comes_from_the_chat_template() -> None:
    assert detect_format("{{ '<tool_call>\\n' + tool_call | tojson + '\\n</tool_call>' }}") == "hermes"
    assert detect_format("<tool_call>{{ name }}<arg_key>{{ k }}</arg_key>") == "glm45"
    assert detect_format("<｜tool▁calls▁begin｜>...```json\\n") == "deepseek_v3"
    assert detect_format("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ name }}<｜tool▁sep｜>") == "deepseek_v31"
    assert detect_format("<|tool_calls_section_begin|>") == "kimi_k2"
    assert detect_format("{{ message['content'] }}") is None and detect_format(None) is None


# ---------------------------------------------------------------- a scripted engine behind the real server
@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from miles_hpc.models.presets import init_model

    return AutoTokenizer.from_pretrained(str(init_model("qwen3", "tiny", tmp_path_factory.mktemp("t") / "m", seed=0)))


class Scripted:
    """Answers each call with the next scripted text (tokenized, the stop token appended), log-prob -0.25 per id."""

    def __init__(self, tok: Any, texts: list[str]) -> None:
        self.tok, self.texts, self.prompts = tok, list(texts), []

    async def generate(self, ids: list[int], params: dict, **kw: Any) -> GenerateOutput:
        self.prompts.append(list(ids))
        out = list(self.tok(self.texts.pop(0), add_special_tokens=False)["input_ids"]) + [self.tok.eos_token_id]
        n = len(out)
        return GenerateOutput(
            rid=f"r{len(self.prompts)}",
            output_ids=out,
            prompt_tokens=len(ids),
            finish_reason=FinishReason(type="stop"),
            completion_tokens=n,
            cached_tokens=len(ids) - 3 if len(self.prompts) > 1 else 0,
            output_logprobs=[-0.25] * n,
            weight_version="4",
            weight_versions=(WeightVersionSpan(version="4", start=0, end=n),),
        )


class Served:
    """An `OpenAISessionServer` on its own event loop thread (the `openai` client is synchronous here, as most
    harnesses are)."""

    def __init__(self, store: SessionStore, keys: ApiKeys) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = OpenAISessionServer(store, model_name="tiny", keys=keys)
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.url = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def served(tok: Any) -> Iterator[tuple[Served, Scripted]]:
    engine = Scripted(
        tok, ['Looking.<tool_call>\n{"name": "ls", "arguments": {"dir": "/data"}}\n</tool_call>', "3 files."]
    )
    store = SessionStore(engine.generate, tok, tool_format="hermes", sampling={"temperature": 1.0})
    s = Served(store, ApiKeys(api_key="k-123"))
    try:
        yield s, engine
    finally:
        s.close()


TOOLS = [
    {
        "type": "function",
        "function": {"name": "ls", "description": "list", "parameters": {"type": "object", "properties": {}}},
    }
]


def _agent(client: Any, session: str) -> list[Any]:
    """An agent as written for the OpenAI client: ask, run the tool it calls, send the result back, read the
    answer (nothing here knows about token ids)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You list files."},
        {"role": "user", "content": "How many files are in /data?"},
    ]
    extra = {"extra_body": {"session_id": session}}
    first = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=64, **extra)
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "a.txt b.txt c.txt"})
    second = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=64, **extra)
    return [first, second, messages]


@pytest.mark.process
def test_an_openai_client_agent_runs_unchanged(served: tuple[Served, Scripted], tok: Any) -> None:
    require(__import__("importlib").util.find_spec("openai") is not None, "the openai package (dev extra)")
    import openai

    s, engine = served
    client = openai.OpenAI(base_url=s.url, api_key="k-123")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    first, second, messages = _agent(client, "ep-1")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Looking."
    assert choice.message.tool_calls[0].function.name == "ls"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"dir": "/data"}
    assert second.choices[0].message.content == "3 files." and second.choices[0].finish_reason == "stop"
    assert second.usage.prompt_tokens == len(engine.prompts[1]) and second.usage.prompt_tokens_details.cached_tokens
    # TITO: the second call sent the first call's ids unchanged, the tool message appended as the template's suffix
    assert engine.prompts[1][: len(engine.prompts[0])] == engine.prompts[0]
    sample = s.server.store.take_sample("ep-1", prompt_id=7, reward=1.0)
    generated = [t for t, m in zip(sample.tokens, sample.loss_mask) if m]
    assert tok.decode(generated).count("<|im_end|>") == 2 and "3 files." in tok.decode(generated)
    assert sample.tokens[: len(engine.prompts[1])] == engine.prompts[1]
    assert [lp for lp, m in zip(sample.rollout_logprobs, sample.loss_mask) if m] == [-0.25] * len(generated)
    assert {v for v, m in zip(sample.policy_version, sample.loss_mask) if m} == {4}
    assert sample.reward == 1.0 and sample.metadata["session_id"] == "ep-1"


@pytest.mark.process
def test_history_that_is_not_the_sessions_is_refused(served: tuple[Served, Scripted]) -> None:
    require(__import__("importlib").util.find_spec("openai") is not None, "the openai package (dev extra)")
    import openai

    s, _ = served
    client = openai.OpenAI(base_url=s.url, api_key="k-123")
    msgs = [{"role": "user", "content": "How many files are in /data?"}]
    first = client.chat.completions.create(model="tiny", messages=msgs, extra_headers={"X-Session-Id": "ep-2"})
    edited = [*msgs, {**first.choices[0].message.model_dump(exclude_none=True), "content": "Something else."}]
    with pytest.raises(openai.BadRequestError, match="message 1 .*differs"):
        client.chat.completions.create(
            model="tiny",
            messages=[*edited, {"role": "user", "content": "and?"}],
            extra_headers={"X-Session-Id": "ep-2"},
        )
    forged = [*msgs, first.choices[0].message.model_dump(exclude_none=True), {"role": "assistant", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match="message 2 is an assistant message the engine did not generate"):
        client.chat.completions.create(model="tiny", messages=forged, extra_headers={"X-Session-Id": "ep-2"})
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.chat.completions.create(model="tiny", messages=msgs, n=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=s.url, api_key="wrong").models.list()
    # the refused calls left the session as it was: its history still continues
    ok = [*msgs, first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
    again = client.chat.completions.create(model="tiny", messages=ok, extra_headers={"X-Session-Id": "ep-2"})
    assert again.choices[0].message.content == "3 files."


@pytest.mark.process
def test_a_session_on_a_real_engine_records_what_generate_returns(tmp_path: Path) -> None:
    """The OpenAI client against a real engine through the router (R3 on, a tiny MoE): the recorded sample holds
    exactly the ids the harness's turns produced, the first turn's ids and log-probs are what `/generate` returns
    for the same prompt and seed, and every token but the last has its routing row."""
    require(__import__("importlib").util.find_spec("openai") is not None, "the openai package (dev extra)")
    import openai
    from test_client_engine import engine_fleet, tiny_model
    from transformers import AutoTokenizer

    from miles_hpc.rollout.client import EngineClient
    from miles_hpc.rollout.router import Router, RouterConfig

    tok = AutoTokenizer.from_pretrained(str(tiny_model()))
    with engine_fleet(tmp_path, 1, wait=True) as procs:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()

        def on_loop(coro: Any) -> Any:
            return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

        router = Router([EngineClient(f"http://127.0.0.1:{procs[0].port}")], RouterConfig(), owns_clients=True)
        on_loop(router.__aenter__())
        store = SessionStore(router.generate, tok, routed_experts=True)
        server = OpenAISessionServer(store, model_name="tiny")
        url = on_loop(server.start())
        try:
            client = openai.OpenAI(base_url=url, api_key="none")
            msgs: list[dict[str, Any]] = [{"role": "user", "content": "Say something."}]
            extra = {"extra_body": {"session_id": "s"}}
            first = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, seed=11, **extra)
            msgs += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
            second = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, seed=11, **extra)
            sample = store.take_sample("s")
            p1 = sample.prompt_len
            n1, n2 = first.usage.completion_tokens, second.usage.completion_tokens
            assert sample.loss_mask.count(1) == n1 + n2 and second.usage.prompt_tokens == p1 + n1 + (
                len(sample.tokens) - p1 - n1 - n2
            )
            direct = on_loop(
                router.generate(
                    sample.tokens[:p1],
                    {"max_new_tokens": 8, "sampling_seed": 11},
                    return_logprob=True,
                    affinity_key="s",
                )
            )
            assert direct.output_ids == sample.tokens[p1 : p1 + n1]
            assert direct.output_logprobs == pytest.approx(sample.rollout_logprobs[p1 : p1 + n1], abs=1e-4)
            assert sample.routed_experts is not None and sample.routed_experts.shape[0] == len(sample.tokens) - 1
        finally:
            on_loop(server.stop())
            on_loop(router.__aexit__(None, None, None))
            loop.call_soon_threadsafe(loop.stop)


@pytest.mark.process
def test_a_harness_for_the_openai_client_trains_in_the_loop(tmp_path: Path) -> None:
    """`rollout.agent=miles_hpc.rollout.harness:terminal_harness_agent`: the reference harness, written for the
    OpenAI client, plays the terminal task through the loop's session server in fully async mode with R3 on a tiny
    MoE; every episode becomes a multi-turn sample with its routing rows, and the run trains."""
    require(__import__("importlib").util.find_spec("openai") is not None, "the openai package (dev extra)")
    import subprocess

    from miles_hpc.data.reader import TrajectoryReader

    repo = Path(__file__).resolve().parents[1]
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "miles_hpc.cli",
        "run",
        str(repo / "configs/tiny_agent_cpu.yaml"),
        f"run_dir={run_dir}",
        "steps=2",
        "mode=fully_async",
        "model.init_arch=qwen3_moe",
        "algo.routing_replay=true",
        "rollout.agent=miles_hpc.rollout.harness:terminal_harness_agent",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(m) == 2 and all(r["rollout/turns_mean"] > 1 for r in m) and all(r["r3/coverage"] > 0.9 for r in m)
    samples = [s for f in sorted((run_dir / "trajectories").glob("*.h5")) for s in TrajectoryReader(f)]
    assert len(samples) == 2 * 2 * 2
    for s in samples:
        assert s.metadata["session_id"].startswith("ep-") and s.loss_mask[s.prompt_len :].count(0) > 0
        assert s.routed_experts is not None and s.routed_experts.shape[0] == len(s.tokens) - 1
