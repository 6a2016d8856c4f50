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
  pydantic model (:func:`cxlalloc.hf.serving_requests.request_models`) before
  transformers' handler sees it: an empty ``messages``, ``max_tokens <= 0``,
  ``n > 1``, an out-of-range ``temperature``/``top_p``/penalty, or a field this
  server would ignore (``logprobs``, ``presence_penalty``, ...) set to something
  else than its default, or more than 4 ``stop`` strings is an HTTP 400 in OpenAI's error form
  (``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``)
  naming the field, never a 500 or a silent change; every other 4xx (a ``model``
  not served: 404 ``model_not_found``, a body that is not UTF-8, an unknown
  field, route or method) has the same form (:func:`openai_error`);
* ``/v1/responses`` is answered whole unless ``stream`` is true (OpenAI's default) and is checked like
  the others; transformers' ``/reset``, ``/load_model`` (any client could unload the model, or load
  another), ``/v1/systemone`` and ``/v1/audio/transcriptions`` are a 404 naming why
  (:data:`REFUSED_ROUTES`);
* a prompt of more than ``OFF_LOOP_PROMPT_CHARS`` characters is counted in a worker thread first, and
  refused there when it fills the context, so its tokenization does not hold the event loop;
* a client that goes away cancels its request where it is computed, streamed or
  not (:class:`cxlalloc.hf.serving_drain.DisconnectMiddleware`,
  :mod:`cxlalloc.hf.serving_managers`); a shutdown waits ``drain_timeout`` seconds
  at most, then cancels what still runs (counted in
  :class:`cxlalloc.hf.serving_drain.ServeStatus`).

transformers 5.24's layout (``transformers/cli/serve.py``,
``transformers/cli/serving/model_manager.py``, ``server.py``;
docs/sources.md#transformers-serving) is required; an older transformers gets a
one-line error naming what is missing.  Needs cxlalloc's ``serve`` extra (fastapi, uvicorn, openai;
:func:`cxlalloc.extras.install_hint` names its packages).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Dict, Iterator, Optional

from cxlalloc.extras import install_hint
from cxlalloc.hf.serving_drain import DRAIN_TASK_WAIT_S, FORCE_QUIT_CANCEL, DisconnectMiddleware, ServeStatus
from cxlalloc.hf.serving_http import header_timeout_protocol
from cxlalloc.hf.serving_managers import (OFF_LOOP_PROMPT_CHARS, guarded_cb_manager, refuse_prompt_over_context,
                                          stoppable_generate_manager)
from cxlalloc.hf.serving_metrics import add_metrics
from cxlalloc.hf.serving_requests import (LENGTH_PARAM, PROMPT_PARAM, InvalidRequest, openai_error, prompt_texts,
                                          request_models, validate_request)

STATS_ROUTE = "/v1/cxlalloc/stats"
DEFAULT_HEADER_TIMEOUT_S = 30.0
DEFAULT_DRAIN_TIMEOUT_S = 30.0


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
    from transformers.cli.serving import utils as serving_utils

    missing = [n for n in ("CBGenerateManager", "GenerateManager") if not hasattr(serving_utils, n)]
    if missing:  # 5.25 renamed them (CBGenerateRunner, ...): the managers cxlalloc serve wraps are not there
        import transformers

        raise RuntimeError(f"cxlalloc serve: transformers {transformers.__version__} has no "
                           f"transformers.cli.serving.utils.{missing[0]}, which cxlalloc serve wraps; it is tested "
                           "with transformers 5.24 (pip install 'transformers==5.24.0')")
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise RuntimeError("cxlalloc serve: the serving dependencies are missing (fastapi, uvicorn, openai, pydantic); "
                           + install_hint("serve"))
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
            (:func:`cxlalloc.hf.serving_http.header_timeout_protocol`; 408 and closed after it).
        drain_timeout: seconds a shutdown (SIGTERM, SIGINT) waits for the
            requests in flight; then they are cancelled (in the continuous-batching
            manager too) and the server stops.  ``status.cancelled["drain"]``
            counts them.  Such a force quit (also a second SIGINT: uvicorn's) answers
            each with OpenAI's error at once, hard-stops the continuous-batching
            worker and leaves the models loaded: the caller is expected to exit
            (``cxlalloc serve`` exits 3 within ``EXIT_GRACE_S``).
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
    from transformers.cli.serving import chat_completion as chat_mod, completion as completion_mod, \
        response as response_mod

    request_models()
    status = status if status is not None else ServeStatus()
    status.drain_timeout = float(drain_timeout)
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

        def shutdown(self) -> None:
            # a force quit (requests cancelled at the drain deadline, or a second SIGINT) ends the process next:
            # unloading (transformers' gc.collect() and frees, seconds on a loaded machine, the GIL held) would
            # only delay the exit
            if status.force_quit is None:
                super().shutdown()

    def check_model(manager, body) -> None:
        forced, requested = manager.force_model, body.get("model")
        if forced is not None and requested is not None and requested == _short_name(manager, forced):
            body["model"] = requested = forced  # the name transformers answered with before (DIR for DIR:FILE.gguf)
        if forced is not None and requested is not None and requested != forced:
            raise InvalidRequest("model", f"model: {requested!r} does not exist on this server; it serves "
                                          f"{forced!r} only (GET /v1/models)", status=404, code="model_not_found")

    class _ListedName:
        """Answers name the served model as ``GET /v1/models`` lists it (transformers answered a GGUF's
        ``DIR:FILE.gguf`` as ``DIR``, a hub model as ``org/model@main``)."""

        def _resolve_model(self, body):
            model_id, loaded, processor = super()._resolve_model(body)
            forced = self.model_manager.force_model
            return (forced if forced is not None else model_id), loaded, processor

    class _CountsLongPrompts:
        """A prompt of more than :data:`OFF_LOOP_PROMPT_CHARS` characters is validated, then counted in a worker
        thread, before transformers' handler tokenizes it on the event loop; one too long for the model is a 400
        from that count, so one client's huge prompt no longer stalls every other client's stream."""

        kind = "chat"

        async def handle_request(self, body, request_id):
            texts = prompt_texts(self.kind, body) if isinstance(body, dict) else []
            if sum(map(len, texts)) > OFF_LOOP_PROMPT_CHARS:
                self._validate_request(body)  # a bad field is named first, as for any request
                _, model, processor = self._resolve_model(body)
                await asyncio.to_thread(refuse_prompt_over_context, model, processor, texts, PROMPT_PARAM.get())
            return await super().handle_request(body, request_id)

    class CheckedChat(_CountsLongPrompts, _ListedName, chat_mod.ChatCompletionHandler):
        """transformers' chat handler behind :func:`validate_request`."""

        def _validate_request(self, body):
            PROMPT_PARAM.set("messages")
            LENGTH_PARAM.set("max_completion_tokens" if isinstance(body, dict) and body.get("max_tokens") is None
                             and body.get("max_completion_tokens") is not None else "max_tokens")
            validate_request("chat", body)
            check_model(self.model_manager, body)
            super()._validate_request(body)

    class CheckedCompletion(_CountsLongPrompts, _ListedName, completion_mod.CompletionHandler):
        """transformers' completion handler behind :func:`validate_request`."""

        kind = "completion"

        def _validate_request(self, body):
            PROMPT_PARAM.set("prompt")
            LENGTH_PARAM.set("max_tokens")
            validate_request("completion", body)
            check_model(self.model_manager, body)
            super()._validate_request(body)

    class CheckedResponse(_CountsLongPrompts, _ListedName, response_mod.ResponseHandler):
        """transformers' Responses API handler behind :func:`validate_request`; a body without ``stream`` is
        answered whole, as OpenAI's API does (transformers 5.24 streamed it: the ``openai`` client's
        ``responses.create()`` got an SSE stream it could not read)."""

        kind = "response"

        def _validate_request(self, body):
            PROMPT_PARAM.set("input")
            LENGTH_PARAM.set("max_output_tokens")
            validate_request("response", body)
            check_model(self.model_manager, body)
            if body.get("stream") is None:
                body["stream"] = False
            super()._validate_request(body)

    def build_server(*args, **kwargs):
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse

        app = base_build(*args, **kwargs)
        refuse_routes(app)

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

        app.add_middleware(DisconnectMiddleware, status=status)  # inside the metrics middleware: a cancelled request is counted
        add_metrics(app, served, hf.stats, status)
        return app

    import uvicorn

    protocol = header_timeout_protocol(float(header_timeout))
    base_config = uvicorn.Config
    base_server = uvicorn.Server

    class SignalledServer(base_server):
        """uvicorn's Server recording the shutdown signals it catches in ``status.signals`` (which one, and a
        second one: uvicorn's force quit)."""

        def handle_exit(self, sig, frame) -> None:
            import signal as signal_mod

            with contextlib.suppress(ValueError):
                status.signals.append(signal_mod.Signals(sig).name)
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            # uvicorn ends a failed listen (the port taken by another process while the model loaded: the CLI
            # checked it before) with sys.exit(3), the exit status cxlalloc serve gives a drain's force quit:
            # a one-line error naming the options instead (the CLI exits 2 on it, as for a busy port).
            try:
                await super().startup(sockets)
            except SystemExit as e:
                if e.code != uvicorn.config.STARTUP_FAILURE:
                    raise
                raise RuntimeError(f"--host {self.config.host} --port {self.config.port}: could not listen there "
                                   "once the model had loaded (uvicorn's error above: another process may have "
                                   "taken the port meanwhile); choose another --port") from None

        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)
            if self.force_exit:
                # uvicorn's force quit (a second SIGINT) leaves the requests running and skips the app's lifespan
                # shutdown: both would be cancelled at the event loop's end (the lifespan's CancelledError logged
                # as a traceback).  Cancel the requests here (each ends its answer in OpenAI's error form), then
                # end the lifespan as a shutdown would.
                tasks = list(self.server_state.tasks)
                for t in tasks:
                    t.cancel(msg=FORCE_QUIT_CANCEL)
                if tasks:
                    await asyncio.wait(tasks, timeout=2 * DRAIN_TASK_WAIT_S)
                await self.lifespan.shutdown()

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
    with _swapped(uvicorn, "Config", config), _swapped(uvicorn, "Server", SignalledServer), \
            _swapped(model_manager, "ModelManager", TieredModelManager), _swapped(server, "build_server", build_server), \
            _swapped(chat_mod, "ChatCompletionHandler", CheckedChat), \
            _swapped(completion_mod, "CompletionHandler", CheckedCompletion), \
            _swapped(response_mod, "ResponseHandler", CheckedResponse):
        running = serve_mod.Serve(force_model=model, continuous_batching=continuous_batching, device=device,
                                  host=host, port=port, log_level=log_level, default_seed=default_seed,
                                  cb_block_size=cb.get("block_size"), cb_num_blocks=cb.get("num_blocks"),
                                  cb_max_batch_tokens=cb.get("max_batch_tokens"), non_blocking=non_blocking)
    if not non_blocking:
        # uvicorn has drained and stopped; transformers' lifespan unloads the models but leaves the continuous
        # batching worker thread running (only kill_server() stops it), which would keep the process alive.  After a
        # force quit the worker was stopped already (ServeStatus.force_quitting) and the process exits next:
        # transformers' stop() would only add its gc.collect() and frees (seconds on a loaded machine)
        state = getattr(running, "_generation_state", None)
        if state is not None and status.force_quit is None:
            state.shutdown()
    return running



#: transformers 5.24's routes that ``cxlalloc serve`` does not serve, and why: each answers 404 in OpenAI's form
REFUSED_ROUTES = {
    "/reset": "it would unload the served model under every other client's requests (transformers' admin route); "
              "restart the server instead",
    "/load_model": "this server serves the one model it was started with (GET /v1/models), and a client may not "
                   "make it load (or download) another; start another cxlalloc serve for another model",
    "/v1/systemone": "transformers' typed-decision route is not part of OpenAI's API",
    "/v1/audio/transcriptions": "the served model is a text-only causal LM",
}
#: the routes ``cxlalloc serve`` answers (named in the 404 of a route it refuses)
SERVED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics",
                 STATS_ROUTE)


def refuse_routes(app) -> None:
    """Replace :data:`REFUSED_ROUTES` in transformers' FastAPI ``app`` by a 404 in OpenAI's error form naming why
    and the routes served (any method).  ``/reset`` and ``/load_model`` let any client unload the model or load
    another (a download from the Hub) under every other client; the others do not apply to the served model."""
    from starlette.routing import Route

    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in REFUSED_ROUTES]

    def refused(why: str):
        async def endpoint(request):
            raise InvalidRequest(None, f"{request.url.path}: not served by cxlalloc serve: {why}; it serves "
                                       f"{', '.join(SERVED_ROUTES)}", status=404, code="not_found")
        return endpoint

    for path, why in REFUSED_ROUTES.items():
        app.router.routes.append(Route(path, refused(why), methods=["GET", "POST", "PUT", "DELETE", "PATCH"]))


def _short_name(manager, forced: str) -> str:
    """The name transformers 5.24's handlers answered with for the served model ``forced``: its repository or
    directory without a ``:FILE.gguf``, a hub repository with ``@main`` (``ModelManager.process_model_name``);
    accepted in a request's ``model`` as the name ``GET /v1/models`` lists."""
    from transformers.cli.serving.utils import split_model_id

    return manager.process_model_name(split_model_id(forced)[0])


def _jsonable(x):
    """``x`` with tuples as lists and non-JSON leaves as strings."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)
