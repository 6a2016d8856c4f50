"""Request validation for ``cxlalloc serve`` (:mod:`cxlalloc.hf.serving`): each ``/v1/chat/completions``
and ``/v1/completions`` body is checked by a pydantic model (:func:`request_models`) before transformers'
handler sees it, and every 4xx of the server is put in OpenAI's error form (:class:`InvalidRequest`,
:func:`openai_error`): ``{"error": {"message", "type", "param", "code"}}``, the field named.
"""

from __future__ import annotations

import contextvars
import re
from typing import Any, Dict, List, Literal, Optional, Union

#: the request field holding the prompt (``"messages"`` on ``/v1/chat/completions``, ``"prompt"`` on
#: ``/v1/completions``): set by the route's handler, read by the generation managers' checks to name it
PROMPT_PARAM: "contextvars.ContextVar[str]" = contextvars.ContextVar("cxlalloc_prompt_param", default="messages")
#: the request field holding the answer's length limit (``"max_tokens"``; ``"max_output_tokens"`` on
#: ``/v1/responses``): named by the same checks when the prompt fits but the prompt plus that limit does not
LENGTH_PARAM: "contextvars.ContextVar[str]" = contextvars.ContextVar("cxlalloc_length_param", default="max_tokens")


class InvalidRequest(Exception):
    """A request body refused before transformers' handler (HTTP 400).

    Attributes:
        param: the field at fault (``"max_tokens"``, ``"messages"``, ``"messages.0.role"``).
        message: one line naming the field, the value and what is allowed.
    """

    def __init__(self, param: Optional[str], message: str, status: int = 400, code: Optional[str] = "invalid_value",
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.status = status
        self.code = code
        self.kind = kind

    def body(self) -> dict:
        """OpenAI's error object (what the ``openai`` client's ``BadRequestError`` reads)."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def openai_error(exc) -> "InvalidRequest":
    """Starlette's/FastAPI's ``HTTPException`` (transformers' handlers raise it; routing raises 404 and 405; a
    body that cannot be read raises 400) as :class:`InvalidRequest`, so that every 4xx of the server has
    OpenAI's error form (``{"error": {"message", "type", "param", "code"}}``) and the ``openai`` client raises
    its ``BadRequestError``/``NotFoundError``/... with the message, never FastAPI's ``{"detail": ...}``.

    transformers' 422 "Unexpected fields in the request: {...}" becomes OpenAI's 400 for an unknown argument,
    the field named; a body that is not UTF-8 is a 400 naming ``body``.
    """
    status = int(getattr(exc, "status_code", 500))
    detail = getattr(exc, "detail", None)
    message = detail if isinstance(detail, str) else str(detail or "")
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, UnicodeDecodeError):
        return InvalidRequest("body", f"body: the request body is not UTF-8 ({cause.reason} at byte {cause.start}); "
                                      "send JSON encoded as UTF-8")
    if status == 400 and message == "There was an error parsing the body":
        return InvalidRequest("body", f"body: the request body could not be read ({cause or message})")
    if status == 422 and message.startswith("Unexpected fields in the request: "):
        fields = message.split(": ", 1)[1]
        first = fields.strip("{}").split(",")[0].strip().strip("'\"")
        return InvalidRequest(first, f"{first}: unrecognized request argument (unexpected fields {fields}); "
                                     "see the OpenAI API reference for the fields of this route",
                              code="unknown_parameter")
    code = {404: "not_found", 405: "method_not_allowed", 408: "timeout", 413: "request_too_large",
            415: "unsupported_media_type"}.get(status, "invalid_request")
    return InvalidRequest(None, message or f"HTTP {status}", status=status, code=code)


_MODELS: Dict[str, Any] = {}
MAX_STOP = 4  # OpenAI's limit on ``stop`` sequences


def request_models():
    """The pydantic models of the request bodies checked here: ``(ChatRequest, CompletionRequest,
    ResponseRequest)`` (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``).

    Built on first use (pydantic comes with the ``serve`` extra).  Only the
    fields whose values matter are declared; any other field is left to
    transformers' own check (it refuses a name outside OpenAI's schema with a
    422).  Ranges are what transformers' generation accepts (``top_p`` in
    (0, 1], ``frequency_penalty`` in (-1, 2]: it becomes
    ``repetition_penalty = 1 + frequency_penalty``, which must be > 0).  Fields
    transformers' server ignores (``n``, ``logprobs``, ``presence_penalty``,
    ``best_of``, ``echo``, ...) accept only their default value.
    """
    if _MODELS:
        return _MODELS["chat"], _MODELS["completion"], _MODELS["response"]
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

    Number = Union[StrictInt, float]

    class Message(BaseModel):
        model_config = ConfigDict(extra="allow")
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: Union[StrictStr, List[dict], None] = None

    class Sampling(BaseModel):
        model_config = ConfigDict(extra="allow")
        model: Optional[StrictStr] = None
        max_tokens: Optional[StrictInt] = Field(None, gt=0)
        temperature: Optional[Number] = Field(None, ge=0, le=2)
        top_p: Optional[Number] = Field(None, gt=0, le=1)
        frequency_penalty: Optional[Number] = Field(None, gt=-1, le=2)
        seed: Optional[StrictInt] = None
        stream: Optional[StrictBool] = None
        stop: Union[StrictStr, List[StrictStr], None] = None  # OpenAI: up to 4 sequences (checked below)
        # ignored by transformers' server: only the default is honest
        n: Optional[StrictInt] = Field(None, ge=1, le=1, description="one choice per request")
        presence_penalty: Optional[Number] = Field(None, ge=0, le=0, description="not supported: 0 only")
        user: Optional[StrictStr] = None

        @model_validator(mode="after")
        def _no_generation_config(self):
            refuse_generation_config(self.model_extra)
            return self

        @model_validator(mode="after")
        def _stop_count(self):
            if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
                raise InvalidRequest("stop", f"stop: at most {MAX_STOP} stop sequences (OpenAI's limit; got "
                                             f"{len(self.stop)})")
            if self.stop == "" or (isinstance(self.stop, list) and "" in self.stop):
                # transformers' stop strings matched it at the first token (a 1-token answer, not cut); continuous
                # batching ignored it: refused in both modes, as vLLM does
                raise InvalidRequest("stop", "stop: an empty string cannot be a stop sequence (it would match "
                                             "before the first token); send non-empty strings or no stop")
            return self

    class ChatRequest(Sampling):
        messages: List[Message] = Field(min_length=1)
        max_completion_tokens: Optional[StrictInt] = Field(None, gt=0)
        logprobs: Optional[Literal[False]] = None
        top_logprobs: Optional[Literal[0]] = None
        logit_bias: Optional[Dict[str, Number]] = None

        @model_validator(mode="after")
        def _format(self):
            fmt = (self.model_extra or {}).get("response_format")
            if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
                raise InvalidRequest("response_format", "response_format: only {'type': 'text'} is supported "
                                     f"by this server (got {fmt!r})")
            # OpenAI's rule (openai.types.chat.ChatCompletion*MessageParam): content is required on a system,
            # developer, user and tool message; an assistant message may leave it null or out only when it
            # carries tool_calls (or the deprecated function_call)
            for i, message in enumerate(self.messages):
                if message.content is None:
                    extra = message.model_extra or {}
                    if message.role == "assistant" and (extra.get("tool_calls") or extra.get("function_call")):
                        continue
                    param = f"messages.{i}.content"
                    got = "null" if "content" in message.model_fields_set else "missing"
                    why = ("an assistant message without tool_calls or function_call" if message.role == "assistant"
                           else f"a {message.role} message")
                    raise InvalidRequest(param, f"{param}: {why} needs content, a string or a list of text parts "
                                         f"(got {got}); OpenAI allows a null content only on an assistant message "
                                         "that carries tool_calls")
            # the served model is a causal LM (text only): transformers' handler drops an image/audio/file
            # part without a word and answers from the rest, so such a part is refused, named
            for i, message in enumerate(self.messages):
                for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                    kind = part.get("type")
                    if kind != "text" or not isinstance(part.get("text"), str):
                        param = f"messages.{i}.content.{j}" + (".type" if kind != "text" else ".text")
                        got = kind if kind != "text" else part.get("text")
                        raise InvalidRequest(param, f"{param}: this server serves a text-only model; a content "
                                             f"part must be {{'type': 'text', 'text': '...'}} (got {got!r})")
            return self

    class CompletionRequest(Sampling):
        prompt: StrictStr = Field(min_length=1)  # an empty prompt killed transformers' batching worker
        best_of: Optional[StrictInt] = Field(None, ge=1, le=1)
        echo: Optional[Literal[False]] = None
        logprobs: Optional[Literal[0]] = None
        suffix: Optional[StrictStr] = None

        @model_validator(mode="after")
        def _no_insertion(self):
            # OpenAI's suffix asks for an insertion (the text between prompt and suffix); transformers' handler
            # appended it to the completion as it was (a user trial got "...x"): refused, named
            if self.suffix:
                raise InvalidRequest("suffix", "suffix: insertion (text between the prompt and a suffix) is not "
                                     f"supported by this server; it completes the prompt only (got {self.suffix!r})")
            return self

    class ResponseRequest(BaseModel):
        """OpenAI's Responses API body (``/v1/responses``), as far as transformers 5.24's handler applies it."""

        model_config = ConfigDict(extra="allow")
        model: Optional[StrictStr] = None
        input: Union[StrictStr, List[dict]]
        instructions: Optional[StrictStr] = None
        max_output_tokens: Optional[StrictInt] = Field(None, gt=0)
        temperature: Optional[Number] = Field(None, ge=0, le=2)
        top_p: Optional[Number] = Field(None, gt=0, le=1)
        seed: Optional[StrictInt] = None
        stream: Optional[StrictBool] = None
        # transformers' handler ignores these (UNUSED_RESPONSE_FIELDS, a warning in its log): only what it
        # does anyway is accepted, anything else is refused, named
        previous_response_id: None = Field(None, description="this server stores no responses")
        background: Optional[Literal[False]] = None
        include: Optional[List[Any]] = Field(None, max_length=0)
        prompt: None = Field(None, description="no stored prompt templates")
        top_logprobs: Optional[Literal[0]] = None
        truncation: Optional[Literal["disabled"]] = None
        tool_choice: Optional[Literal["auto"]] = None
        max_tool_calls: None = Field(None, description="not enforced by this server")
        service_tier: Optional[Literal["auto", "default"]] = None
        user: Optional[StrictStr] = None
        store: Optional[StrictBool] = None  # accepted; nothing is stored (previous_response_id is refused)

        @model_validator(mode="after")
        def _input(self):
            refuse_generation_config(self.model_extra)
            if self.input == "" or self.input == []:
                raise InvalidRequest("input", "input: the input is empty; send a string or a list of messages")
            fmt = ((self.model_extra or {}).get("text") or {}).get("format") \
                if isinstance((self.model_extra or {}).get("text"), dict) else (self.model_extra or {}).get("text")
            if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
                raise InvalidRequest("text", "text: only the format {'type': 'text'} is supported by this server "
                                     f"(got {fmt!r})")
            items = self.input if isinstance(self.input, list) else []
            for i, item in enumerate(items):
                if not isinstance(item, dict):
                    raise InvalidRequest(f"input.{i}", f"input.{i}: an input item must be an object (got {item!r})")
                for j, part in enumerate(item.get("content") if isinstance(item.get("content"), list) else ()):
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind not in ("input_text", "output_text", "text"):
                        param = f"input.{i}.content.{j}.type"
                        raise InvalidRequest(param, f"{param}: this server serves a text-only model; a content "
                                             f"part must be input_text or output_text (got {kind!r})")
            return self

    _MODELS.update(chat=ChatRequest, completion=CompletionRequest, response=ResponseRequest)
    return ChatRequest, CompletionRequest, ResponseRequest


def prompt_texts(kind: str, body: dict) -> List[str]:
    """The text pieces of a request's prompt (``kind``: ``"chat"``, ``"completion"`` or ``"response"``): each
    message's string content or text parts, the completion's prompt, the Responses ``input`` and
    ``instructions``; what is not text is left out.  The chat template's own text is not included."""
    def parts(content) -> List[str]:
        if isinstance(content, str):
            return [content]
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)] \
            if isinstance(content, list) else []

    if kind == "completion":
        return parts(body.get("prompt"))
    if kind == "chat":
        return [t for m in body.get("messages") or () if isinstance(m, dict) for t in parts(m.get("content"))]
    inp = body.get("input")
    items = [t for m in inp if isinstance(m, dict) for t in parts(m.get("content") if "content" in m else
                                                                   m.get("output"))] \
        if isinstance(inp, list) else parts(inp)
    return items + parts(body.get("instructions"))


def refuse_generation_config(extra: Optional[dict]) -> None:
    """Refuse transformers' ``generation_config`` request field (a JSON ``GenerationConfig`` that replaces the
    served model's whole generation config: its EOS tokens, ``max_new_tokens`` 20, beams and return sequences
    that the server's answers cannot carry; bad JSON was a plain-text HTTP 500).  Not part of OpenAI's API.

    Raises:
        InvalidRequest: 400 naming ``generation_config`` when the field is present and not null.
    """
    if (extra or {}).get("generation_config") is not None:
        raise InvalidRequest("generation_config", "generation_config: not accepted by this server (transformers' "
                             "field replaces the served model's whole generation config, its EOS tokens included); "
                             "use the route's OpenAI fields (max_tokens or max_output_tokens, temperature, top_p, seed, ...)")


# pydantic's names of union members in an error's loc ("int", "float", "str", "list[dict[any,any]]")
_UNION_TAG = re.compile(r"^(int|float|str|bool|bytes|none|(list|dict|literal|tuple|set)\[.*\])$")
_KIND = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean", "list": "a list",
         "dict": "an object", "literal": "one of the allowed values"}


def validate_request(kind: str, body: Any) -> None:
    """Check a request body against :func:`request_models` (``kind``: ``"chat"``, ``"completion"`` or
    ``"response"``).

    Raises:
        InvalidRequest: the first field at fault, named, with its value and the
            allowed range (``"max_tokens: must be greater than 0 (got -1)"``).
    """
    from pydantic import ValidationError

    models = dict(zip(("chat", "completion", "response"), request_models()))
    if not isinstance(body, dict):
        raise InvalidRequest("body", f"the request body must be a JSON object (got {type(body).__name__})")
    try:
        models[kind].model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        # a validator raising InvalidRequest arrives wrapped
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidRequest):
            raise cause from None
        loc = [str(x) for x in err["loc"] if not str(x).startswith(("function-", "union["))]
        tag = next((i for i, x in enumerate(loc) if _UNION_TAG.match(x)), None)
        if tag is not None:
            # a union field (temperature: int or float; content: a string or a list of parts): pydantic names
            # each member it tried in the loc ("temperature.int"); the field alone is named, with every member
            prefix = [str(x) for x in err["loc"]][:len(err["loc"]) - len(loc) + tag]
            members = [str(x["loc"][len(prefix)]) for x in e.errors(include_url=False)
                       if [str(y) for y in x["loc"]][:len(prefix)] == prefix and len(x["loc"]) > len(prefix)]
            loc = loc[:tag]
            kinds = list(dict.fromkeys(_KIND.get(m.split("[")[0], m) for m in members))
            if "a number" in kinds and "an integer" in kinds:  # int or float: a number
                kinds.remove("an integer")
            msg = "must be " + " or ".join(kinds)
        else:
            msg = err["msg"][0].lower() + err["msg"][1:]
        param = ".".join(loc) or "body"
        got = "" if err["type"] == "missing" else f" (got {err.get('input')!r})"
        hint = {"n": "; this server returns one choice per request", "best_of": "; one completion per request",
                "presence_penalty": "; presence_penalty is not supported (frequency_penalty is)",
                "logprobs": "; log probabilities are not returned by this server",
                "top_logprobs": "; log probabilities are not returned by this server",
                "frequency_penalty": " (it becomes repetition_penalty = 1 + frequency_penalty)",
                # /v1/responses: what transformers' handler would have ignored
                "previous_response_id": "; this server stores no responses: send the whole conversation in input",
                "background": "; background responses are not supported",
                "include": "; this server includes nothing extra in its responses",
                "prompt": "; stored prompt templates are not supported: send the text in input",
                "truncation": "; a prompt over the model's context is refused, not truncated",
                "tool_choice": "; the model chooses whether to call a tool (auto) on this server",
                "max_tool_calls": "; not enforced by this server",
                "service_tier": "; this server has one tier"}.get(loc[0] if loc else "", "")
        raise InvalidRequest(param, f"{param}: {msg}{got}{hint}") from None

