"""transformers' OpenAI-compatible server (``transformers serve``) on a wrapped model.

:func:`serve` runs transformers' own serving code (``transformers.cli.serve.Serve``:
FastAPI + uvicorn, ``/v1/chat/completions`` streamed and not, ``/v1/completions``,
``/v1/models``, ``/health``; continuous batching through
``model.init_continuous_batching`` or one ``model.generate()`` at a time) with one
change: the model its ``ModelManager`` loads is passed through
:func:`cxlalloc.hf.wrap` with the given options before the first request, so
generation runs on cxlalloc's tiers and, with ``kv_store``, reuses stored
prefixes across requests as ``generate()`` does.  One route is added:
``GET /v1/cxlalloc/stats``, :func:`cxlalloc.hf.stats` of the served model as JSON.

Things transformers' server does not do are done here:

* a GGUF (``DIR:FILE.gguf``, the shipped SmolLM2's form) is loaded as a causal
  LM: transformers' ``ModelManager`` looks the class up in
  ``config.architectures[0]``, which a config read from a GGUF leaves ``None``;
* each ``/v1/chat/completions`` and ``/v1/completions`` body is validated by a
  pydantic model (:class:`ChatRequest`, :class:`CompletionRequest`) before
  transformers' handler sees it: an empty ``messages``, ``max_tokens <= 0``,
  ``n > 1``, an out-of-range ``temperature``/``top_p``/penalty, or a field this
  server would ignore (``logprobs``, ``presence_penalty``, ...) set to something
  else than its default is an HTTP 400 in OpenAI's error form
  (``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``)
  naming the field, never a 500 or a silent change; every other 4xx (a ``model``
  not served: 404 ``model_not_found``, a body that is not UTF-8, an unknown
  field, route or method) has the same form (:func:`openai_error`);
* a client that goes away cancels its request where it is computed, streamed or
  not (:class:`_DisconnectMiddleware`, :func:`guarded_cb_manager`,
  :func:`stoppable_generate_manager`); a shutdown waits ``drain_timeout`` seconds
  at most, then cancels what still runs (counted in :class:`ServeStatus`).

transformers 5.24's layout (``transformers/cli/serve.py``,
``transformers/cli/serving/model_manager.py``, ``server.py``;
docs/sources.md#transformers-serving) is required; an older transformers gets a
one-line error naming what is missing.  Needs the serving extra: ``pip install
cxlalloc[serve]`` (fastapi, uvicorn, openai).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Dict, Iterator, List, Literal, Optional, Union

STATS_ROUTE = "/v1/cxlalloc/stats"
METRICS_ROUTE = "/metrics"
DEFAULT_HEADER_TIMEOUT_S = 30.0
DEFAULT_DRAIN_TIMEOUT_S = 30.0
COMPLETION_ROUTES = ("/v1/chat/completions", "/v1/completions")


def serving_modules():
    """transformers' serving modules ``(serve, model_manager, server)``.

    Raises:
        RuntimeError: this transformers has no ``transformers.cli.serving``
            (5.24's layout), or the serving dependencies are missing.
    """
    try:
        from transformers.cli import serve as serve_mod
        from transformers.cli.serving import model_manager, server
    except ImportError as e:
        raise RuntimeError(f"cxlalloc serve: transformers' serving code could not be imported ({e}); it needs "
                           "transformers 5.24 (transformers.cli.serving)") from e
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise RuntimeError("cxlalloc serve: the serving dependencies are missing (fastapi, uvicorn, openai, pydantic); "
                           "pip install 'cxlalloc[serve]'")
    return serve_mod, model_manager, server


@contextlib.contextmanager
def _swapped(module, name: str, value) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


class _Served:
    """The models the tiered ModelManager wrapped (for the stats route)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.models: Dict[str, Any] = {}


class ServeStatus:
    """What one server cancelled and what its continuous-batching manager holds (read by ``/metrics`` and by
    ``cxlalloc serve``'s exit status).

    Attributes:
        cancelled: ``{"disconnect": n, "drain": n}``: completion requests cancelled before their answer was
            sent, because their client went away, or because ``drain_timeout`` ran out at shutdown.
        engine_cancelled: of those, the requests stopped where they were computed:
            ``"continuous_batching"``, cancelled in transformers' continuous-batching manager
            (``cancel_request``: removed from its scheduler, their blocks freed); ``"generate"``, a
            non-streamed ``model.generate()`` stopped at its next token (``--no-continuous-batching``).
        managers: the continuous-batching managers made (normally one).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = {"disconnect": 0, "drain": 0}
        self.engine_cancelled = {"continuous_batching": 0, "generate": 0}
        self.managers: List[Any] = []

    def count(self, reason: Optional[str] = None, engine: Optional[str] = None) -> None:
        """One more request cancelled for ``reason`` (``"disconnect"``/``"drain"``), or stopped in ``engine``
        (``"continuous_batching"``/``"generate"``)."""
        with self.lock:
            if engine is not None:
                self.engine_cancelled[engine] += 1
            else:
                self.cancelled[reason] += 1

    def cb_requests(self) -> int:
        """Requests the continuous-batching scheduler(s) hold now (running and waiting)."""
        n = 0
        for m in list(self.managers):
            cb = getattr(m, "_cb", None)
            sched = getattr(getattr(cb, "batch_processor", None), "scheduler", None)
            if sched is not None:
                n += len(sched.active_requests) + len(sched.waiting_requests)
        return n


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


def request_models():
    """The pydantic models of the request bodies checked here: ``(ChatRequest, CompletionRequest)``.

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
        return _MODELS["chat"], _MODELS["completion"]
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
        stop: Union[StrictStr, List[StrictStr], None] = None
        # ignored by transformers' server: only the default is honest
        n: Optional[StrictInt] = Field(None, ge=1, le=1, description="one choice per request")
        presence_penalty: Optional[Number] = Field(None, ge=0, le=0, description="not supported: 0 only")
        user: Optional[StrictStr] = None

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

    _MODELS.update(chat=ChatRequest, completion=CompletionRequest)
    return ChatRequest, CompletionRequest


def validate_request(kind: str, body: Any) -> None:
    """Check a request body against :func:`request_models` (``kind``: ``"chat"`` or ``"completion"``).

    Raises:
        InvalidRequest: the first field at fault, named, with its value and the
            allowed range (``"max_tokens: must be greater than 0 (got -1)"``).
    """
    from pydantic import ValidationError

    chat, completion = request_models()
    if not isinstance(body, dict):
        raise InvalidRequest("body", f"the request body must be a JSON object (got {type(body).__name__})")
    try:
        (chat if kind == "chat" else completion).model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        # a validator raising InvalidRequest arrives wrapped
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidRequest):
            raise cause from None
        loc = [str(x) for x in err["loc"] if not str(x).startswith(("function-", "union["))]
        param = ".".join(loc) or "body"
        msg = err["msg"][0].lower() + err["msg"][1:]
        got = "" if err["type"] == "missing" else f" (got {err.get('input')!r})"
        hint = {"n": "; this server returns one choice per request", "best_of": "; one completion per request",
                "presence_penalty": "; presence_penalty is not supported (frequency_penalty is)",
                "logprobs": "; log probabilities are not returned by this server",
                "top_logprobs": "; log probabilities are not returned by this server",
                "frequency_penalty": " (it becomes repetition_penalty = 1 + frequency_penalty)"}.get(loc[0] if loc
                                                                                                   else "", "")
        raise InvalidRequest(param, f"{param}: {msg}{got}{hint}") from None


def _load_causal_lm(manager, model_id_and_revision: str, gguf_file: str, tqdm_class=None):
    """A GGUF loaded as transformers' ``ModelManager._load_model`` would, with
    the class from ``AutoModelForCausalLM`` (a GGUF's config has no
    ``architectures``)."""
    from transformers import AutoModelForCausalLM
    from transformers.cli.serving.utils import split_revision

    model_id, revision = split_revision(model_id_and_revision)
    kwargs = {"revision": revision, "attn_implementation": manager.attn_implementation, "dtype": manager.dtype,
              "device_map": manager.device, "trust_remote_code": manager.trust_remote_code, "gguf_file": gguf_file}
    if tqdm_class is not None:
        kwargs["tqdm_class"] = tqdm_class
    return AutoModelForCausalLM.from_pretrained(model_id, **kwargs)


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, continuous_batching: bool = True,
          wrap_options: Optional[dict] = None, cb_options: Optional[dict] = None, device: str = "auto",
          log_level: str = "warning", default_seed: Optional[int] = None, non_blocking: bool = False,
          header_timeout: float = DEFAULT_HEADER_TIMEOUT_S, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
          status: Optional[ServeStatus] = None):
    """Serve ``model`` over HTTP with transformers' OpenAI-compatible server,
    its KV cache in cxlalloc's tiers.

    Args:
        model: a local model directory, or ``DIR:FILE.gguf`` (transformers'
            ``force_model`` syntax; SmolLM2's GGUF, say).  Loaded once, at start.
        host, port: where uvicorn listens.
        continuous_batching: transformers' continuous batching (paged cache,
            many requests in flight; ``--continuous-batching``); False: one
            ``model.generate()`` at a time.
        wrap_options: :func:`cxlalloc.hf.wrap` keyword arguments
            (``device_limit``, ``host_limit``, ``kv_store``, ...).
        cb_options: ``transformers.ContinuousBatchingConfig`` fields
            (``block_size``, ``num_blocks``, ``max_batch_tokens``, ...).
        device: transformers' ``--device`` (``"auto"``, ``"cpu"``, ``"cuda:0"``).
        log_level: uvicorn/transformers log level.
        default_seed: torch seed set once at start (seeded sampling).
        non_blocking: start the server in a background thread and return the
            ``Serve`` object (``.kill_server()`` stops it); else block until
            the server exits.
        header_timeout: seconds a connection may take to send a request head
            (:func:`header_timeout_protocol`; 408 and closed after it).
        drain_timeout: seconds a shutdown (SIGTERM, SIGINT) waits for the
            requests in flight; then they are cancelled (in the continuous-batching
            manager too) and the server stops.  ``status.cancelled["drain"]``
            counts them.
        status: a :class:`ServeStatus` to fill (cancelled requests, the
            continuous-batching scheduler); a new one when None.

    Returns:
        transformers' ``Serve`` instance (when ``non_blocking``; else after it exits).

    Raises:
        RuntimeError: transformers' serving code or its dependencies are missing.
        ValueError: a bad wrap option (naming it), from :func:`cxlalloc.hf.wrap`.
    """
    import cxlalloc.hf as hf

    serve_mod, model_manager, server = serving_modules()
    from transformers.cli.serving import chat_completion as chat_mod, completion as completion_mod

    request_models()
    status = status if status is not None else ServeStatus()
    opts = dict(wrap_options or {})
    served = _Served()
    base_manager = model_manager.ModelManager
    base_build = server.build_server

    class TieredModelManager(base_manager):
        """transformers' ModelManager whose loaded models are wrapped."""

        def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
            if gguf_file is not None:
                loaded = _load_causal_lm(self, model_id_and_revision, gguf_file, tqdm_class)
            else:
                loaded = super()._load_model(model_id_and_revision, tqdm_class=tqdm_class,
                                             progress_callback=progress_callback)
            loaded = hf.wrap(loaded, **opts)
            with served.lock:
                served.models[model_id_and_revision] = loaded
            return loaded

    def check_model(manager, body) -> None:
        forced, requested = manager.force_model, body.get("model")
        if forced is not None and requested is not None and requested != forced:
            raise InvalidRequest("model", f"model: {requested!r} does not exist on this server; it serves "
                                          f"{forced!r} only (GET /v1/models)", status=404, code="model_not_found")

    class CheckedChat(chat_mod.ChatCompletionHandler):
        """transformers' chat handler behind :func:`validate_request`."""

        def _validate_request(self, body):
            validate_request("chat", body)
            check_model(self.model_manager, body)
            super()._validate_request(body)

    class CheckedCompletion(completion_mod.CompletionHandler):
        """transformers' completion handler behind :func:`validate_request`."""

        def _validate_request(self, body):
            validate_request("completion", body)
            check_model(self.model_manager, body)
            super()._validate_request(body)

    def build_server(*args, **kwargs):
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse

        app = base_build(*args, **kwargs)

        from starlette.exceptions import HTTPException as StarletteHTTPException

        @app.exception_handler(InvalidRequest)
        async def _invalid(_request, exc: InvalidRequest):
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(_request, exc):
            err = openai_error(exc)
            return JSONResponse(err.body(), status_code=err.status, headers=getattr(exc, "headers", None))

        @app.exception_handler(RequestValidationError)
        async def _unreadable(_request, exc: RequestValidationError):
            # FastAPI's own check of the body (not JSON, not an object): OpenAI's 400 form, not a 422 list
            err = (exc.errors() or [{}])[0]
            ctype = _request.headers.get("content-type", "")
            if ctype and ctype.split(";")[0].strip().lower() != "application/json":
                # FastAPI reads a body as JSON only under a JSON Content-Type (curl -d sends a form's)
                return JSONResponse(InvalidRequest("body", f"body: the request's Content-Type is {ctype!r}; send "
                                                   "the JSON body with Content-Type: application/json").body(),
                                    status_code=400)
            what = {"json_invalid": "is not valid JSON", "dict_type": "must be a JSON object",
                    "missing": "is missing"}.get(err.get("type"), err.get("msg", "is invalid"))
            ctx = (err.get("ctx") or {}).get("error")
            return JSONResponse(InvalidRequest("body", f"body: the request body {what}"
                                               + (f" ({ctx})" if ctx else "")).body(), status_code=400)

        @app.get(STATS_ROUTE)
        def cxlalloc_stats():
            with served.lock:
                models = dict(served.models)
            return {name: _jsonable(hf.stats(m)) for name, m in models.items()}

        app.add_middleware(_DisconnectMiddleware, status=status)  # inside the metrics middleware: a cancelled request is counted
        _add_metrics(app, served, hf.stats, status)
        return app

    import uvicorn

    protocol = header_timeout_protocol(float(header_timeout))
    base_config = uvicorn.Config

    def config(app, **kwargs):  # transformers' Serve builds uvicorn.Config(app, host=, port=, log_level=)
        # uvicorn's graceful shutdown waits for the requests in flight at most drain_timeout seconds, then cancels
        # their tasks (guarded_cb_manager cancels them in the continuous-batching manager, counted as "drain")
        return base_config(app, http=protocol, timeout_graceful_shutdown=drain_timeout, **kwargs)

    cb = {k: v for k, v in (cb_options or {}).items() if v is not None}
    # transformers makes its continuous-batching manager lazily, at the first request, by this module name:
    # the guarded one stays in place for the server's life (the swaps above matter only while it is built).
    from transformers.cli.serving import utils as serving_utils

    base_cb = getattr(serving_utils.CBGenerateManager, "cxlalloc_base", serving_utils.CBGenerateManager)
    serving_utils.CBGenerateManager = guarded_cb_manager(base_cb, hf.stats, status)
    serving_utils.CBGenerateManager.cxlalloc_base = base_cb
    base_gen = getattr(serving_utils.GenerateManager, "cxlalloc_base", serving_utils.GenerateManager)
    serving_utils.GenerateManager = stoppable_generate_manager(base_gen, status)
    serving_utils.GenerateManager.cxlalloc_base = base_gen
    with _swapped(uvicorn, "Config", config), _swapped(model_manager, "ModelManager", TieredModelManager), _swapped(server, "build_server", build_server), \
            _swapped(chat_mod, "ChatCompletionHandler", CheckedChat), \
            _swapped(completion_mod, "CompletionHandler", CheckedCompletion):
        running = serve_mod.Serve(force_model=model, continuous_batching=continuous_batching, device=device,
                                  host=host, port=port, log_level=log_level, default_seed=default_seed,
                                  cb_block_size=cb.get("block_size"), cb_num_blocks=cb.get("num_blocks"),
                                  cb_max_batch_tokens=cb.get("max_batch_tokens"), non_blocking=non_blocking)
    if not non_blocking:
        # uvicorn has drained and stopped; transformers' lifespan unloads the models but leaves the continuous
        # batching worker thread running (only kill_server() stops it), which would keep the process alive
        state = getattr(running, "_generation_state", None)
        if state is not None:
            state.shutdown()
    return running


def paged_capacity_tokens(stats: dict) -> Optional[int]:
    """Tokens the model's paged KV cache holds (``num_blocks x page_size`` of its live or last paged cache, from
    :func:`cxlalloc.hf.stats`), or None before one exists."""
    cache = ((stats.get("hf") or {}).get("continuous_batching") or {}).get("cache") or {}
    n, page = cache.get("num_blocks"), cache.get("page_size")
    return int(n) * int(page) if n and page else None


def guarded_cb_manager(base, stats, status: Optional[ServeStatus] = None):
    """transformers' ``CBGenerateManager`` with two guards (issue 29, item 3: one request used to kill the
    continuous-batching worker for good, every later request a 503 "CB worker is dead") and cancellation:

    * a request whose prompt plus ``max_tokens`` cannot fit the paged KV cache is refused with a 400 naming
      the limit (:class:`InvalidRequest`), before it reaches the worker;
    * a worker that died anyway is replaced by a new one at the next request (logged, counted in
      ``restarts``); requests in flight when it died get transformers' own error;
    * a request whose handler is cancelled (its client went away: :class:`_DisconnectMiddleware`; or the drain
      deadline ran out) is cancelled in transformers' ``ContinuousBatchingManager`` (``cancel_request``: its
      blocks freed, it leaves the scheduler at the worker's next step) and counted in
      ``status.engine_cancelled``.
      transformers 5.24 does this for a streamed request only (its SSE generator's ``streamer.cancel()``);
      a non-streamed request ran to its end.
    """

    class GuardedCBManager(base):
        restarts = 0

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if status is not None:
                status.managers.append(self)

        def _cancel(self, request_id: str) -> None:
            """Cancel ``request_id`` in the continuous-batching manager, drop its result handler, count it."""
            cb = self._cb
            if cb is None:
                return
            cb.cancel_request(request_id)
            router = getattr(cb, "output_router", None)
            if router is not None:
                with router._lock:
                    router.result_handlers.pop(request_id, None)
            if status is not None:
                status.count(engine="continuous_batching")

        def init_cb(self, model, gen_config) -> None:
            self._model, self._gen_config = model, gen_config
            super().init_cb(model, gen_config)

        def _check_alive(self, request_id: str) -> None:
            cb = self._cb
            if cb is not None and cb.background_thread_status.fatal_error is not None:
                import logging

                logging.getLogger("cxlalloc.serve").warning(
                    "cxlalloc serve: the continuous-batching worker died (%s); starting a new one",
                    cb.background_thread_status.fatal_error)
                try:
                    cb.stop(block=False)
                except Exception:  # the dead worker's own clean-up: nothing more to save
                    pass
                self._cb = None
                type(self).restarts += 1
                super().init_cb(self._model, self._gen_config)
            super()._check_alive(request_id)

        def _check_fits(self, model, inputs, gen_config) -> None:
            cap = paged_capacity_tokens(stats(model))
            prompt = len(inputs["input_ids"])
            new = int(gen_config.max_new_tokens or 0)
            if prompt == 0:  # transformers' worker dies on a request of no token ("cannot reshape ... 0 elements")
                raise InvalidRequest("messages", "messages: the prompt is empty after the chat template (0 tokens)")
            ctx = getattr(model.config, "max_position_embeddings", None)  # a transformers config field
            if isinstance(ctx, int) and prompt + new > ctx:
                param = "messages" if prompt >= ctx else "max_tokens"
                raise InvalidRequest(param, f"{param}: the prompt ({prompt} tokens) plus max_tokens ({new}) is "
                                            f"{prompt + new} tokens, more than the model's context "
                                            f"(max_position_embeddings {ctx}); shorten the prompt or lower max_tokens")
            if cap is not None and prompt + new > cap:
                param = "messages" if prompt >= cap else "max_tokens"
                raise InvalidRequest(param, f"{param}: the prompt ({prompt} tokens) plus max_tokens ({new}) "
                                            f"needs {prompt + new} tokens of KV, more than the paged KV cache "
                                            f"holds ({cap} tokens: --cb-num-blocks x --cb-block-size); shorten "
                                            "the prompt or lower max_tokens")

        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            self._check_fits(model, inputs, gen_config)
            queue, streamer = super().generate_streaming(model, processor, inputs, gen_config, request_id,
                                                         response_parser=response_parser)
            # transformers' SSE generator calls streamer.cancel() when the response is cancelled; cancel once,
            # and only a request still running (not one whose last token was already delivered)
            state = {"ended": False, "cancelled": False}
            base_end = streamer.end

            def end() -> None:
                state["ended"] = True
                base_end()

            def cancel() -> None:
                if not state["ended"] and not state["cancelled"]:
                    state["cancelled"] = True
                    self._cancel(request_id)

            streamer.end, streamer.cancel = end, cancel
            return queue, streamer

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            self._check_fits(model, inputs, gen_config)
            try:
                return await super().generate_non_streaming(model, processor, inputs, gen_config, request_id)
            except asyncio.CancelledError:  # the client went away, or the drain deadline ran out
                self._cancel(request_id)
                raise

    return GuardedCBManager


class _DisconnectMiddleware:
    """ASGI middleware: a completion request whose client goes away is cancelled.

    Starlette cancels a streamed response when the client disconnects, but not a
    non-streamed one: its handler awaits the whole generation (a 100k-character
    prompt kept the server computing for minutes after the client left).  Here
    the request body is read first, then the route runs in its own task while
    the connection is watched; an ``http.disconnect`` before the response is
    complete cancels that task (the continuous-batching manager then cancels the
    request: :func:`guarded_cb_manager`).  A cancellation of this middleware
    itself (uvicorn's drain deadline) is passed on the same way, its reason
    ``"drain"``.  With ``--no-continuous-batching`` a non-streamed request's
    ``generate()`` stops at its next token (:func:`stoppable_generate_manager`).
    """

    def __init__(self, app, status: Optional[ServeStatus] = None) -> None:
        self.app = app
        self.status = status if status is not None else ServeStatus()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in COMPLETION_ROUTES:
            return await self.app(scope, receive, send)
        body = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before its request was read: nothing was started
            body.append(message)
            if not message.get("more_body"):
                break
        gone = asyncio.Event()
        complete = [False]

        async def inner_receive():
            if body:
                return body.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        started = [False]

        async def inner_send(message):
            if message["type"] == "http.response.start":
                started[0] = True
            if message["type"] == "http.response.body" and not message.get("more_body"):
                complete[0] = True
            await send(message)

        holder = {"reason": None}
        task = asyncio.ensure_future(self.app(scope, inner_receive, inner_send))
        watcher = asyncio.ensure_future(receive())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and not complete[0]:  # the client went away with its answer unsent
                holder["reason"] = "disconnect"
                self.status.count("disconnect")
                gone.set()
                task.cancel()
            gone.set()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        except asyncio.CancelledError:  # uvicorn cancels the requests still running at the drain deadline
            if holder["reason"] is not None or task.done():
                raise
            holder["reason"] = "drain"
            self.status.count("drain")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            # the answer is ended in OpenAI's error form (a 503, or an SSE error event ending the stream), so the
            # client learns why and uvicorn logs no traceback
            await _end_drained(send, started[0], complete[0])
        finally:
            watcher.cancel()


DRAIN_MESSAGE = ("the server is shutting down and this request was still running at its drain deadline "
                 "(--drain-timeout); retry it on another server")


async def _end_drained(send, started: bool, complete: bool) -> None:
    """End a response cancelled at the drain deadline: a 503 in OpenAI's error form if nothing was sent yet,
    else an SSE ``error`` event closing the stream (the ``openai`` client raises ``APIError`` with it)."""
    import json

    err = InvalidRequest(None, DRAIN_MESSAGE, status=503, code="server_shutting_down", kind="server_error").body()
    with contextlib.suppress(Exception):  # the client may be gone too
        if not started:
            data = json.dumps(err).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": data})
        elif not complete:
            await send({"type": "http.response.body", "body": f"data: {json.dumps(err)}\n\n".encode()})


def stoppable_generate_manager(base, status: Optional[ServeStatus] = None):
    """transformers' ``GenerateManager`` (``--no-continuous-batching``: one ``model.generate()`` at a time on
    an inference thread) whose non-streamed request stops when its handler is cancelled (its client went
    away, or the drain deadline ran out): a stopping criterion ends the ``generate()`` at its next token, and
    the inference thread is free for the next request.  transformers 5.24 ran it to its end, then set the
    result of the cancelled future ("InvalidStateError" logged).  Streamed requests already stop (their
    streamer raises at the next token)."""

    class StoppableGenerateManager(base):
        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            import torch
            from transformers import StoppingCriteria, StoppingCriteriaList

            stop = threading.Event()

            class _Cancelled(StoppingCriteria):
                def __call__(self, input_ids, scores, **kwargs):
                    return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool,
                                      device=input_ids.device)

            kwargs = {**inputs, "generation_config": gen_config, "tokenizer": processor,
                      "stopping_criteria": StoppingCriteriaList([_Cancelled()])}
            if hasattr(model, "has_talker"):  # as transformers: text only
                kwargs["generation_mode"] = "text"
            future = self.async_submit(model.generate, **kwargs)
            try:
                sequences = await asyncio.shield(future)  # a cancelled handler leaves the thread's future alone
            except asyncio.CancelledError:
                stop.set()
                if status is not None:
                    status.count(engine="generate")
                raise
            input_len = inputs["input_ids"].shape[-1]
            generated_ids = sequences[0, input_len:]
            return processor.decode(generated_ids, skip_special_tokens=True), input_len, generated_ids

    return StoppableGenerateManager


def header_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol class with a header timeout: a connection that has
    not sent a whole request head ``seconds`` after it opened (or after its last
    response) gets ``408 Request Timeout`` and is closed, so slow or stalled
    clients (slowloris) cannot hold connections open.  uvicorn has only an idle
    keep-alive timeout, disarmed by the first byte of a request."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer = None
        _head_bytes = 0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()  # a connection that never sends a request head is closed too (silently)

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:  # bytes of a next request head
                self._head_bytes += len(data)
                if self._header_timer is None:
                    self._arm()
            super().data_received(data)

        def on_response_complete(self) -> None:
            self._disarm()  # idle between requests: uvicorn's keep-alive timeout applies
            self._head_bytes = 0
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._timed_out, self.cycle)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _timed_out(self, cycle_when_armed) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.cycle is not cycle_when_armed:
                return  # closed, or a request head arrived since
            if self._head_bytes:
                body = f"no complete request head within {seconds:g} s (--header-timeout)\n".encode()
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                     b"connection: close\r\ncontent-length: " + str(len(body)).encode()
                                     + b"\r\n\r\n" + body)
            self.transport.close()

    return HeaderTimeoutH11Protocol


def _add_metrics(app, served: _Served, stats, status: Optional[ServeStatus] = None) -> None:
    """``GET /metrics`` (:mod:`cxlalloc.hf.serving_metrics`) on ``app``; without
    prometheus_client, said once on stderr and left out."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        import sys

        print("cxlalloc serve: warning: prometheus_client is not installed; serving without /metrics "
              "(pip install 'cxlalloc[serve]')", file=sys.stderr)
        return
    from fastapi.responses import Response

    from cxlalloc.hf.serving_metrics import ServeMetrics

    def models():
        with served.lock:
            return dict(served.models)

    metrics = ServeMetrics(models, stats, status)

    class MetricsMiddleware:
        def __init__(self, inner):
            self.inner = metrics.middleware(inner)

        async def __call__(self, scope, receive, send):
            await self.inner(scope, receive, send)

    app.add_middleware(MetricsMiddleware)

    @app.get(METRICS_ROUTE)
    def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _jsonable(x):
    """``x`` with tuples as lists and non-JSON leaves as strings."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)
