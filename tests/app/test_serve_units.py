"""Pure parts of ``cxlalloc serve`` without a server: the stop filter of a streamed answer
(:class:`cxlalloc.hf.serving_managers.StopTrimQueue`), the prompt's text pieces and the off-loop
context count (:func:`cxlalloc.hf.serving_requests.prompt_texts`,
:func:`cxlalloc.hf.serving_managers.refuse_prompt_over_context`), the Responses API body checks."""

import asyncio

import pytest

from cxlalloc.hf.serving_managers import StopTrimQueue, refuse_prompt_over_context
from cxlalloc.hf.serving_requests import InvalidRequest, prompt_texts, validate_request


def _drain(inner: asyncio.Queue) -> list:
    out = []
    while not inner.empty():
        out.append(inner.get_nowait())
    return out


def test_the_stop_is_seen_when_the_streamer_writes_the_token_that_completes_it():
    """Write side: the stop string is found as the streamer puts each piece, before any reader reads
    (a handler behind the worker used to see it tokens late); text that could begin the stop is held
    back, the stop and what follows never reach the reader, the end (None) passes through."""
    inner, calls = asyncio.Queue(), []
    q = StopTrimQueue(inner, ["Paris"], on_stop=lambda: calls.append(len(_seen)))
    _seen = []
    q.put_nowait("The capital is Pa")
    _seen += _drain(inner)
    assert _seen == ["The capital is "] and calls == []  # "Pa" may begin the stop: held
    q.put_nowait("ris. It is")
    assert calls == [1]  # seen at the token that completed it, with no reader
    q.put_nowait(" big.")
    q.put_nowait(None)
    _seen += _drain(inner)
    assert _seen == ["The capital is ", None] and calls == [1]


def test_held_back_text_is_released_when_it_cannot_begin_the_stop():
    inner = asyncio.Queue()
    q = StopTrimQueue(inner, ["STOP", "\n\n"])
    for piece in ("ST", "ar", "\n", "x", None):
        q.put_nowait(piece)
    assert "".join(p for p in _drain(inner) if p) == "STar\nx"


@pytest.mark.parametrize("kind, body, texts", [
    ("chat", {"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": [
        {"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}, {"role": "assistant", "content": None}]},
     ["a", "b", "c"]),
    ("completion", {"prompt": "p"}, ["p"]),
    ("response", {"input": "i", "instructions": "s"}, ["i", "s"]),
    ("response", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]},
                            {"type": "function_call_output", "call_id": "c", "output": "y"}]}, ["x", "y"]),
])
def test_prompt_texts_are_every_text_piece_of_the_prompt(kind, body, texts):
    assert prompt_texts(kind, body) == texts


class _Tok:
    """A whitespace tokenizer standing in for the served model's (HF tokenizers' call signature)."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(range(len(text.split())))}


class _Model:
    class config:
        max_position_embeddings = 100


def test_a_prompt_whose_text_alone_fills_the_context_is_refused_naming_the_field():
    refuse_prompt_over_context(_Model, _Tok(), ["w " * 100], "messages")  # 100 - slack 4 < 100: left to the handler
    with pytest.raises(InvalidRequest) as e:
        refuse_prompt_over_context(_Model, _Tok(), ["w " * 60, "w " * 60], "input")
    assert e.value.param == "input" and e.value.message.startswith("input: the prompt is at least 112 tokens")


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "tool_choice": "none"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "text"),
    ({"input": "hi", "generation_config": "{}"}, "generation_config"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type"),
])
def test_responses_bodies_refused_name_the_field(body, param):
    pytest.importorskip("pydantic")
    with pytest.raises(InvalidRequest) as e:
        validate_request("response", body)
    assert e.value.param == param and e.value.message.startswith(param + ":"), e.value.message


def test_responses_bodies_accepted():
    pytest.importorskip("pydantic")
    for body in ({"input": "hi"}, {"input": "hi", "stream": True, "max_output_tokens": 5, "store": False},
                 {"input": [{"role": "user", "content": "hi"}], "instructions": "be brief", "user": "u"},
                 {"input": "hi", "text": {"format": {"type": "text"}}, "tool_choice": "auto"}):
        validate_request("response", body)
