"""The Responses API (`POST /v1/responses`) through the official `openai` client (tiny random
llama): `create` (string and item input, instructions, max_output_tokens), `.stream` (events
reassemble into the final response, equal to the non-streamed one), `.parse` with a pydantic model,
function tools (forced, streamed name first then argument deltas), `function_call_output` items with
`previous_response_id` (a bounded in-memory store; `store: false`), and 400s for what is not
supported.
"""

import json
from typing import Literal

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
from pydantic import BaseModel, ConfigDict  # noqa: E402

# the server's feature files run in CI's bench tier; one worker runs the tiny_server group (its programs compile once)
pytestmark = [pytest.mark.bench, pytest.mark.xdist_group("tiny_server")]

NAME = "tiny"
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def live():
    from server_util import tiny_server

    with tiny_server(model_name=NAME) as (url, _, _):
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_create_equals_chat(live):
    url, client = live
    r = client.responses.create(model=NAME, input="Name a river.", instructions="Be brief.", max_output_tokens=12,
                                temperature=0)
    chat = client.chat.completions.create(model=NAME, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}])
    c = chat.choices[0]
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert r.output_text == c.message.content
    assert r.status == ("incomplete" if c.finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    items = client.responses.create(model=NAME, max_output_tokens=12, temperature=0, input=[
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a river."}]}])
    assert items.output_text == r.output_text


def test_stream_reassembles_into_the_response(live):
    url, client = live
    kw = dict(model=NAME, input="Tell me about rivers.", max_output_tokens=16, temperature=0)
    plain = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    # The last event carries the final response (the SDK's get_final_response() only takes
    # response.completed; a max_output_tokens cut ends with response.incomplete, as OpenAI's).
    final = events[-1].response
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                        "response.incomplete")
    assert "response.output_text.delta" in kinds and kinds.count("response.output_item.added") == 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == plain.output_text
    assert final.status == plain.status


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Oslo"]
    days: int


def test_parse_with_a_pydantic_model(live):
    url, client = live
    r = client.responses.parse(model=NAME, input="Weather?", text_format=Weather, max_output_tokens=100,
                               temperature=1.0)
    assert isinstance(r.output_parsed, Weather), r.output_text


def _calls(response):
    return [(o.name, o.arguments, o.call_id) for o in response.output if o.type == "function_call"]


def test_forced_tool_call_streamed_and_an_agent_loop(live):
    """A forced function call (name first, then argument deltas when streamed), its result as a
    function_call_output with previous_response_id, and an answer; store false leaves nothing."""
    url, client = live
    kw = dict(model=NAME, input="What time is it?", tools=[TIME], temperature=0, max_output_tokens=60,
              tool_choice={"type": "function", "name": "get_time"})
    r = client.responses.create(**kw)
    ((name, args, call_id),) = _calls(r)
    assert name == "get_time" and json.loads(args)["zone"] in ("UTC", "CET") and r.status == "completed"
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    added = kinds.index("response.output_item.added")
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert added < kinds.index("response.function_call_arguments.delta") and len(deltas) >= 2
    assert "".join(deltas) == args and [c[:2] for c in _calls(final)] == [(name, args)]
    answer = client.responses.create(model=NAME, previous_response_id=r.id, tools=[TIME], tool_choice="none",
                                     max_output_tokens=6, temperature=0, input=[
                                         {"type": "function_call_output", "call_id": call_id, "output": "12:00"}])
    assert answer.output_text and not _calls(answer)
    base = client.responses.create(model=NAME, input="What time is it?", tools=[TIME], tool_choice="none",
                                   max_output_tokens=1)
    assert answer.usage.input_tokens > base.usage.input_tokens   # the earlier turn and the tool result
    gone = client.responses.create(**{**kw, "store": False})
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=NAME, previous_response_id=gone.id, input="and now?", max_output_tokens=2)


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
])
def test_unsupported_is_400(live, extra, param):
    url, _ = live
    r = httpx.post(f"{url}/v1/responses", json={"model": NAME, "input": "hi", **extra}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
