"""transformers' generation managers as ``cxlalloc serve`` runs them (:mod:`cxlalloc.hf.serving`): the
continuous-batching manager with its guards, cancellation and ``stop`` strings (:func:`guarded_cb_manager`), and the
one-``generate()``-at-a-time manager whose cancelled request stops at its next token
(:func:`stoppable_generate_manager`); both refuse a request over the model's context (:func:`check_context`).
"""

from __future__ import annotations

import asyncio
import copy
import threading
from typing import Optional

from cxlalloc.hf.serving_drain import ServeStatus
from cxlalloc.hf.serving_requests import LENGTH_PARAM, PROMPT_PARAM, InvalidRequest


def paged_capacity_tokens(stats: dict) -> Optional[int]:
    """Tokens the model's paged KV cache holds (``num_blocks x page_size`` of its live or last paged cache, from
    :func:`cxlalloc.hf.stats`), or None before one exists."""
    cache = ((stats.get("hf") or {}).get("continuous_batching") or {}).get("cache") or {}
    n, page = cache.get("num_blocks"), cache.get("page_size")
    return int(n) * int(page) if n and page else None


def prompt_tokens(inputs) -> int:
    """Tokens of the prompt in transformers' ``inputs`` (a list of ids with continuous batching, a ``[1, n]``
    tensor without)."""
    ids = inputs["input_ids"]
    return len(ids) if isinstance(ids, list) else int(ids.shape[-1])


def check_context(model, inputs, gen_config) -> None:
    """Refuse, before generation, a request the model cannot hold: an empty prompt (transformers' worker died on
    it), or a prompt plus ``max_tokens`` (``gen_config.max_new_tokens``) over the model's context
    (``config.max_position_embeddings``; past it the answer is junk, and a huge ``max_tokens`` asked
    ``generate()`` for a KV cache of tens of GiB).  Applies with and without continuous batching.

    Raises:
        InvalidRequest: 400 naming the prompt's field (``messages``, ``prompt`` or ``input``: :data:`PROMPT_PARAM`)
            when the prompt alone fills the context, else the length field (``max_tokens``,
            ``max_completion_tokens`` or ``max_output_tokens``: :data:`LENGTH_PARAM`), with the token counts and
            the limit.
    """
    prompt, new = prompt_tokens(inputs), int(gen_config.max_new_tokens or 0)
    param, length = PROMPT_PARAM.get(), LENGTH_PARAM.get()
    if prompt == 0:
        what = "after the chat template " if param in ("messages", "input") else ""
        raise InvalidRequest(param, f"{param}: the prompt is empty {what}(0 tokens)")
    ctx = getattr(model.config, "max_position_embeddings", None)  # a transformers config field
    if isinstance(ctx, int) and prompt + new > ctx:
        param = param if prompt >= ctx else length
        raise InvalidRequest(param, f"{param}: the prompt ({prompt} tokens) plus {length} ({new}) is "
                                    f"{prompt + new} tokens, more than the model's context "
                                    f"(max_position_embeddings {ctx}); shorten the prompt or lower {length}")


#: characters of prompt text above which a request's prompt is counted in a worker thread before transformers'
#: handler tokenizes it on the event loop: tokenizing 2 MB of text held the loop 1.3 s (every other request's
#: stream stalled that long); below this, transformers' own tokenization takes ~20 ms at most (0.6 us/char here)
OFF_LOOP_PROMPT_CHARS = 32 * 1024
#: tokens a text piece may lose when the chat template puts it between its own tokens (a merge at each end)
TEMPLATE_MERGE_SLACK = 4


def refuse_prompt_over_context(model, processor, texts, param: str) -> None:
    """Count the tokens of a request's prompt text (``texts``: its pieces, :func:`serving_requests.prompt_texts`)
    and refuse it when even that lower bound fills the model's context.  Meant for a worker thread
    (``asyncio.to_thread``): the tokenizer (HF tokenizers, Rust) lets the event loop run meanwhile (the loop's
    longest pause was 40-50 ms while 2 MB were counted, against 1.3 s when transformers' handler tokenized
    them on it).  A prompt under the bound is left to transformers' handler and :func:`check_context`.

    Args:
        model: the served model (``config.max_position_embeddings``: its context in tokens).
        processor: its tokenizer or processor (``.tokenizer``).
        texts: the prompt's text pieces (str).
        param: the request field the 400 names (``messages``, ``prompt``, ``input``).

    Raises:
        InvalidRequest: 400 naming ``param``: the pieces' tokens, less :data:`TEMPLATE_MERGE_SLACK` per piece,
            are the model's context or more.
    """
    ctx = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(ctx, int):
        return
    tok = getattr(processor, "tokenizer", processor)
    counted = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
    at_least = counted - TEMPLATE_MERGE_SLACK * len(texts)
    if at_least >= ctx:
        raise InvalidRequest(param, f"{param}: the prompt is at least {at_least} tokens, more than the model's "
                                    f"context (max_position_embeddings {ctx}); shorten the prompt")


def check_stop_strings(processor, gen_config) -> None:
    """Build transformers' ``StopStringCriteria`` for ``gen_config.stop_strings`` before ``generate()`` does:
    it cannot read some tokenizers' vocabularies (a word-level one: "substring not found"), which was an HTTP 500
    from inside ``generate()``.  Its result is cached by transformers per tokenizer and stop strings.

    Raises:
        InvalidRequest: 400 naming ``stop`` when this model's tokenizer cannot apply stop strings.
    """
    stop = getattr(gen_config, "stop_strings", None)
    if not stop:
        return
    from transformers import StopStringCriteria

    try:
        StopStringCriteria(tokenizer=getattr(processor, "tokenizer", processor), stop_strings=stop)
    except ValueError as e:
        raise InvalidRequest("stop", f"stop: this model's tokenizer cannot apply stop strings (transformers' "
                                     f"StopStringCriteria: {e}); send the request without stop",
                             code="unsupported_value") from None


def cut_at_stop(text: str, stop) -> str:
    """``text`` up to (without) the first of the ``stop`` strings in it (OpenAI's rule: the stop sequence is not
    returned); ``text`` itself when none is in it."""
    cuts = [text.find(s) for s in ([stop] if isinstance(stop, str) else stop or ()) if s and s in text]
    return text[:min(cuts)] if cuts else text


def end_as_stopped(gen_config) -> None:
    """Mark a request whose answer ended at a stop string so transformers' handler reports ``finish_reason``
    "stop" (OpenAI's: the stop sequence was reached) even when the stop completed on the ``max_tokens``-th token:
    transformers 5.24 says "length" whenever the tokens reach ``gen_config.max_new_tokens``, which it reads only
    for that after the answer's end.  ``gen_config`` is the request's own copy (transformers' handler builds one
    per request; the worker's shared config never is a request's with stop strings, see ``init_cb``), and the
    token limit was already handed to the generation, so clearing it changes nothing else."""
    gen_config.max_new_tokens = None


class StopTrimQueue:
    """The streamed answer's text queue (transformers' streamer fills ``inner`` with text pieces, then None) with
    the first stop string and what follows it left out: text that could still begin a stop string is held back
    until it cannot.  Read side: ``get``/``get_nowait`` as ``asyncio.Queue``'s (transformers' SSE generators use
    these two).  Write side: ``put_nowait`` filters each piece as the streamer puts it, into ``inner``, which the
    reader then reads itself: the stop is seen at the token that completes it, however far behind the reader is.
    Items that are not plain text (tool calls, errors, the end) pass through."""

    def __init__(self, inner: asyncio.Queue, stop, on_stop=None) -> None:
        self.inner, self.stops = inner, [s for s in ([stop] if isinstance(stop, str) else stop) if s]
        self.pending, self.stopped, self.ready = "", False, []
        self.on_stop = on_stop  # called once, when the first stop string is seen (continuous batching ends there)

    def _take(self, item) -> None:
        if type(item) is not str:  # None (the end), an error, a tool call, reasoning text: flush, pass on
            if self.pending and not self.stopped:
                self.ready.append(self.pending)
            self.pending = ""
            self.ready.append(item)
            return
        if self.stopped:
            return
        text = self.pending + item
        cut = cut_at_stop(text, self.stops)
        if len(cut) < len(text):
            self.stopped, self.pending = True, ""
            if cut:
                self.ready.append(cut)
            if self.on_stop is not None:
                self.on_stop()
            return
        hold = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        self.pending = text[len(text) - hold:] if hold else ""
        if len(text) > hold:
            self.ready.append(text[:len(text) - hold])

    def put_nowait(self, item) -> None:
        """Filter ``item`` (a text piece, or anything else: passed on) into ``inner`` (write side)."""
        self._take(item)
        while self.ready:
            self.inner.put_nowait(self.ready.pop(0))

    async def get(self):
        while not self.ready:
            self._take(await self.inner.get())
        return self.ready.pop(0)

    def get_nowait(self):
        while not self.ready:
            self._take(self.inner.get_nowait())  # raises asyncio.QueueEmpty when nothing is there
        return self.ready.pop(0)


def guarded_cb_manager(base, stats, status: Optional[ServeStatus] = None):
    """transformers' ``CBGenerateManager`` with two guards (issue 29, item 3: one request used to kill the
    continuous-batching worker for good, every later request a 503 "CB worker is dead") and cancellation:

    * a request whose prompt plus ``max_tokens`` cannot fit the paged KV cache is refused with a 400 naming
      the limit (:class:`InvalidRequest`), before it reaches the worker;
    * a worker that died anyway is replaced by a new one at the next request (logged, counted in
      ``restarts``); requests in flight when it died get transformers' own error;
    * a request whose handler is cancelled (its client went away:
      :class:`cxlalloc.hf.serving_drain.DisconnectMiddleware`; or the drain deadline ran out) is cancelled in transformers' ``ContinuousBatchingManager`` (``cancel_request``: its
      blocks freed, it leaves the scheduler at the worker's next step) and counted in
      ``status.engine_cancelled``.
      transformers 5.24 does this for a streamed request only (its SSE generator's ``streamer.cancel()``);
      a non-streamed request ran to its end;
    * ``stop`` strings, which transformers 5.24's paged generation does not have: the answer's text is checked
      as it is decoded (:class:`StopTrimQueue`, a non-streamed request run as a stream), and at the first stop
      string the request is cancelled in the worker (not counted as a cancellation) and the answer ends
      before it, ``finish_reason`` "stop", as OpenAI's; the worker's shared generation config never takes the
      first request's stop strings.
    """

    class GuardedCBManager(base):
        restarts = 0

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if status is not None:
                status.managers.append(self)

        def _cancel(self, request_id: str, count: bool = True) -> None:
            """Cancel ``request_id`` in the continuous-batching manager, drop its result handler; ``count``: a
            cancellation (its client went away), not a request that ended at a stop string."""
            cb = self._cb
            if cb is None:
                return
            cb.cancel_request(request_id)
            router = getattr(cb, "output_router", None)
            if router is not None:
                with router._lock:
                    router.result_handlers.pop(request_id, None)
            if status is not None and count:
                status.count(engine="continuous_batching")

        def init_cb(self, model, gen_config) -> None:
            if getattr(gen_config, "stop_strings", None):
                # The worker's shared config comes from the first request: its stop strings are that request's
                # (applied below per request), never every later request's.
                gen_config = copy.copy(gen_config)
                gen_config.stop_strings = None
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
            check_context(model, inputs, gen_config)
            cap = paged_capacity_tokens(stats(model))
            prompt, new = prompt_tokens(inputs), int(gen_config.max_new_tokens or 0)
            if cap is not None and prompt + new > cap:
                length = LENGTH_PARAM.get()
                param = PROMPT_PARAM.get() if prompt >= cap else length
                raise InvalidRequest(param, f"{param}: the prompt ({prompt} tokens) plus {length} ({new}) "
                                            f"needs {prompt + new} tokens of KV, more than the paged KV cache "
                                            f"holds ({cap} tokens: --cb-num-blocks x --cb-block-size); shorten "
                                            f"the prompt or lower {length}")

        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            self._check_fits(model, inputs, gen_config)
            queue, streamer = super().generate_streaming(model, processor, inputs, gen_config, request_id,
                                                         response_parser=response_parser)
            # transformers' SSE generator calls streamer.cancel() when the response is cancelled; cancel once,
            # and only a request still running (not one whose last token was already delivered)
            state = {"ended": False, "cancelled": False, "stop_at": None}
            base_end, base_put = streamer.end, streamer.put

            def end() -> None:
                if not state["ended"]:  # once: a stopped request's last output may still come, finished
                    state["ended"] = True
                    base_end()

            def cancel() -> None:
                if not state["ended"] and not state["cancelled"]:
                    state["cancelled"] = True
                    self._cancel(request_id)

            streamer.end, streamer.cancel = end, cancel
            stop = getattr(gen_config, "stop_strings", None)
            if not stop:
                return queue, streamer

            def stopped() -> None:
                """The answer reached a stop string: the request ends there, as OpenAI's does (its blocks freed
                in the worker at its next step), its tokens counted up to the one that completed the stop string,
                and the stream ends."""
                state["stop_at"] = streamer.total_tokens
                end_as_stopped(gen_config)
                if not state["ended"] and not state["cancelled"]:
                    state["cancelled"] = True
                    self._cancel(request_id, count=False)
                end()

            def put(output) -> None:
                """The worker's outputs, on the event loop: none after the stop (the worker may have run ahead of
                the loop, its outputs already scheduled); ``total_tokens`` ends at the stop's token."""
                if state["stop_at"] is None:
                    base_put(output)
                if state["stop_at"] is not None:
                    streamer.total_tokens = state["stop_at"]

            # the stop is checked as the streamer puts each token's text (CBStreamer's queue, transformers 5.24),
            # not when the handler reads it: a reader behind the worker saw it tokens late, with finish_reason
            # "length" and usage counting tokens past the stop
            streamer._queue = StopTrimQueue(queue, stop, on_stop=stopped)
            streamer.put = put
            return queue, streamer

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            if getattr(gen_config, "stop_strings", None):  # generate_streaming checks that it fits
                return await self._until_stop(model, processor, inputs, gen_config, request_id)
            self._check_fits(model, inputs, gen_config)
            try:
                return await super().generate_non_streaming(model, processor, inputs, gen_config, request_id)
            except asyncio.CancelledError:  # the client went away, or the drain deadline ran out
                self._cancel(request_id)
                raise

        async def _until_stop(self, model, processor, inputs, gen_config, request_id):
            """A non-streamed request with ``stop``: run as a stream, so the answer is checked as it grows and the
            request ends at the first stop string instead of running to ``max_tokens``; returns what
            transformers' ``generate_non_streaming`` does, ``(text, prompt tokens, generated token ids)``, the
            text cut before the stop string (the ids: the tokens up to the one that completed the stop string)."""
            queue, streamer = self.generate_streaming(model, processor, inputs, gen_config, request_id)
            ids: list = []
            base_put = streamer.put

            def put(output) -> None:
                base_put(output)
                ids[:] = output.generated_tokens[:streamer.total_tokens]  # cumulative, up to the stop

            streamer.put = put
            parts = []
            try:
                while True:
                    item = await queue.get()
                    if item is None:
                        break
                    if isinstance(item, str):
                        parts.append(item)
                    elif type(item).__name__ == "_StreamError":  # transformers' failed request, as its own path
                        cb = self._cb
                        if cb is not None and cb.background_thread_status.fatal_error is not None:
                            from transformers.cli.serving.utils import CBWorkerDeadError

                            raise CBWorkerDeadError(f"CB worker died during request {request_id}: {item.msg}")
                        raise RuntimeError(f"CB generation failed for {request_id}: {item.msg}")
            except asyncio.CancelledError:  # the client went away, or the drain deadline ran out
                streamer.cancel()
                raise
            return "".join(parts), prompt_tokens(inputs), list(ids)

    return GuardedCBManager



def stoppable_generate_manager(base, status: Optional[ServeStatus] = None):
    """transformers' ``GenerateManager`` (``--no-continuous-batching``: one ``model.generate()`` at a time on
    an inference thread) whose non-streamed request stops when its handler is cancelled (its client went
    away, or the drain deadline ran out): a stopping criterion ends the ``generate()`` at its next token, and
    the inference thread is free for the next request.  transformers 5.24 ran it to its end, then set the
    result of the cancelled future ("InvalidStateError" logged).  Streamed requests already stop (their
    streamer raises at the next token)."""

    class StoppableGenerateManager(base):
        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            check_context(model, inputs, gen_config)
            check_stop_strings(processor, gen_config)
            queue, streamer = super().generate_streaming(model, processor, inputs, gen_config, request_id,
                                                         response_parser=response_parser)
            stop = getattr(gen_config, "stop_strings", None)
            return (StopTrimQueue(queue, stop, on_stop=lambda: end_as_stopped(gen_config)) if stop else queue), \
                streamer

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            check_context(model, inputs, gen_config)
            check_stop_strings(processor, gen_config)
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
            text = processor.decode(generated_ids, skip_special_tokens=True)
            cut = cut_at_stop(text, getattr(gen_config, "stop_strings", None))
            if len(cut) < len(text):
                end_as_stopped(gen_config)
            return cut, input_len, generated_ids

    return StoppableGenerateManager

