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

transformers 5.24's layout (``transformers/cli/serve.py``,
``transformers/cli/serving/model_manager.py``, ``server.py``;
docs/sources.md#transformers-serving) is required; an older transformers gets a
one-line error naming what is missing.  Needs the serving extra: ``pip install
cxlalloc[serve]`` (fastapi, uvicorn, openai).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, Optional

STATS_ROUTE = "/v1/cxlalloc/stats"


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


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, continuous_batching: bool = True,
          wrap_options: Optional[dict] = None, cb_options: Optional[dict] = None, device: str = "auto",
          log_level: str = "warning", default_seed: Optional[int] = None, non_blocking: bool = False):
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

    Returns:
        transformers' ``Serve`` instance (when ``non_blocking``; else after it exits).

    Raises:
        RuntimeError: transformers' serving code or its dependencies are missing.
        ValueError: a bad wrap option (naming it), from :func:`cxlalloc.hf.wrap`.
    """
    import cxlalloc.hf as hf

    serve_mod, model_manager, server = serving_modules()
    opts = dict(wrap_options or {})
    served = _Served()
    base_manager = model_manager.ModelManager
    base_build = server.build_server

    class TieredModelManager(base_manager):
        """transformers' ModelManager whose loaded models are wrapped."""

        def _load_model(self, model_id_and_revision, *args, **kwargs):
            loaded = super()._load_model(model_id_and_revision, *args, **kwargs)
            loaded = hf.wrap(loaded, **opts)
            with served.lock:
                served.models[model_id_and_revision] = loaded
            return loaded

    def build_server(*args, **kwargs):
        app = base_build(*args, **kwargs)

        @app.get(STATS_ROUTE)
        def cxlalloc_stats():
            with served.lock:
                models = dict(served.models)
            return {name: _jsonable(hf.stats(m)) for name, m in models.items()}

        return app

    cb = {k: v for k, v in (cb_options or {}).items() if v is not None}
    with _swapped(model_manager, "ModelManager", TieredModelManager), _swapped(server, "build_server", build_server):
        return serve_mod.Serve(force_model=model, continuous_batching=continuous_batching, device=device,
                               host=host, port=port, log_level=log_level, default_seed=default_seed,
                               cb_block_size=cb.get("block_size"), cb_num_blocks=cb.get("num_blocks"),
                               cb_max_batch_tokens=cb.get("max_batch_tokens"), non_blocking=non_blocking)


def _jsonable(x):
    """``x`` with tuples as lists and non-JSON leaves as strings."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)
