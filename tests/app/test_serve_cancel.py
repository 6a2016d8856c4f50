"""``cxlalloc serve``: a client that goes away cancels its request in transformers'
continuous-batching manager (streamed and not); SIGTERM's drain has a deadline
(``--drain-timeout``) after which the requests still running are cancelled and the
server exits 3; every 4xx is in OpenAI's error form.  Driven over HTTP on 127.0.0.1
with the real ``openai`` client and raw sockets, against a server in a subprocess."""

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest

from tests.app.test_serve import _get, _metrics, _need_serving, _sample, _start, _stop, _tiny_model_dir

LONG = 1500  # output tokens of a request that runs for tens of seconds on this model (~15 ms a token on a CPU)
# a slower tiny Llama than test_serve's: a request of LONG tokens outlasts every wait below many times over
SIZES = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4)
PROMPT = "rain sun moon"
NO_EOS = 1_000_000


def _slow_model(tmp_path_factory, name):
    d = str(tmp_path_factory.mktemp(name))
    _tiny_model_dir(d, **SIZES)
    # no end-of-sequence token the model can produce (an id past its vocabulary): every request runs to max_tokens
    with open(os.path.join(d, "generation_config.json")) as f:
        gen = json.load(f)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump(dict(gen, eos_token_id=NO_EOS), f)
    return d


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(port, model dir, process, log path) of a server with a 2 s drain deadline."""
    _need_serving()
    pytest.importorskip("prometheus_client")
    d = _slow_model(tmp_path_factory, "slow-chat")
    path = os.path.join(d, "server.log")
    proc, port, log = _start([d, "--device", "cpu", "--device-limit", "8MiB", "--host-limit", "256MiB",
                              "--cb-block-size", "16", "--cb-num-blocks", "160", "--cb-max-batch-tokens", "256",
                              "--drain-timeout", "2"], path)
    try:
        yield port, d, proc, path
    finally:
        _stop(proc, log)


def _send_raw(port, body):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def test_without_continuous_batching_a_disconnected_generate_stops_at_its_next_token(tmp_path_factory):
    """``--no-continuous-batching``: a non-streamed 1,500-token ``generate()`` whose client disconnects stops at
    its next token (counted), so the next request, queued behind it on the one inference thread, is answered
    in a fraction of the time the rest of the long one would take; nothing is logged as an error (transformers
    5.24 ran it to its end, then logged an InvalidStateError)."""
    _need_serving()
    pytest.importorskip("prometheus_client")
    d = _slow_model(tmp_path_factory, "slow-generate")
    path = os.path.join(d, "server.log")
    proc, port, log = _start([d, "--device", "cpu", "--device-limit", "8MiB", "--host-limit", "256MiB",
                              "--no-continuous-batching"], path)
    try:
        # user trial: without continuous batching a huge max_tokens was a 500 (a 28 GiB KV cache asked for) and a
        # prompt over the context was answered with junk: both are the 400 the default mode gives, streamed or not
        huge = " ".join(["harbour tide station report"] * 600)  # ~2,400 tokens: over the model's 2,048 positions
        for body, param in (({"prompt": PROMPT, "max_tokens": 1_000_000_000}, "max_tokens"),
                            ({"prompt": huge, "max_tokens": 4}, "prompt"),
                            ({"prompt": huge, "max_tokens": 4, "stream": True}, "prompt"),
                            ({"messages": [{"role": "user", "content": huge}], "max_tokens": 4}, "messages")):
            route = "chat/completions" if "messages" in body else "completions"
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/{route}", data=json.dumps(
                dict(body, model=d)).encode(), headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=60)
            err = json.loads(e.value.read())["error"]
            assert e.value.code == 400 and err["param"] == param, err
            assert "more than the model's context (max_position_embeddings 2048)" in err["message"], err
        # transformers' StopStringCriteria cannot read this word-level tokenizer: a 500 from generate() before
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(
            {"model": d, "prompt": PROMPT, "max_tokens": 4, "stop": ["rain"]}).encode(),
            headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        err = json.loads(e.value.read())["error"]
        assert e.value.code == 400 and err["param"] == "stop" and "cannot apply stop strings" in err["message"], err
        t = time.time()
        _answered(port, d, 100)
        per_100 = time.time() - t  # the time of 100 tokens here
        before = _metrics(port)
        s = _send_raw(port, json.dumps({"model": d, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0}).encode())
        _wait(lambda: _sample(_metrics(port), "cxlalloc_serve_requests_in_flight") == 1, 60, "the long request")
        time.sleep(1.0)
        s.close()
        t = time.time()
        _answered(port, d, 3)
        waited = time.time() - t
        assert waited < 5 * per_100, (waited, per_100)  # not the ~14 x per_100 left of the long request
        after = _metrics(port)
        engine = "cxlalloc_serve_engine_cancelled_requests_total"
        assert _sample(after, engine, engine="generate") - _sample(before, engine, engine="generate") == 1
        assert _sample(after, "cxlalloc_serve_cancelled_requests_total", reason="disconnect") - _sample(
            before, "cxlalloc_serve_cancelled_requests_total", reason="disconnect") == 1
    finally:
        _stop(proc, log)
    with open(path) as f:
        text = f.read()
    assert "Traceback" not in text and "InvalidStateError" not in text, text[-3000:]


def _answered(port, d, n):
    body = json.dumps({"model": d, "prompt": PROMPT, "max_tokens": n, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert json.loads(r.read())["usage"]["completion_tokens"] == n


def _steps(port):
    st = next(iter(_get(f"http://127.0.0.1:{port}/v1/cxlalloc/stats", timeout=10).values()))
    return st["hf"]["continuous_batching"]["counters"]["steps"]


def _wait(pred, timeout, what):
    deadline = time.time() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.time() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def _running(port, steps_before, n=5):
    """Wait until the continuous-batching worker holds one request and has run ``n`` steps of it."""
    _wait(lambda: _sample(_metrics(port), "cxlalloc_serve_cb_requests") == 1 and _steps(port) >= steps_before + n,
          120, "the long request to be running")


def _cancelled_and_idle(port, before, reason):
    """The request was cancelled for ``reason`` and in the manager, the scheduler emptied, and no step runs
    any more; returns the steps taken meanwhile."""
    _wait(lambda: _sample(_metrics(port), "cxlalloc_serve_cb_requests") == 0, 60, "the scheduler to empty")
    after = _metrics(port)
    assert _sample(after, "cxlalloc_serve_cancelled_requests_total", reason=reason) - _sample(
        before, "cxlalloc_serve_cancelled_requests_total", reason=reason) == 1
    engine = "cxlalloc_serve_engine_cancelled_requests_total"
    assert _sample(after, engine, engine="continuous_batching") - _sample(
        before, engine, engine="continuous_batching") == 1
    s1 = _steps(port)
    time.sleep(1.0)
    assert _steps(port) == s1, "the worker still steps after the cancellation"
    return s1


def _answered_promptly(port, d):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0)
    t = time.time()
    r = client.chat.completions.create(model=d, max_tokens=4, temperature=0,
                                       messages=[{"role": "user", "content": "rain sun moon"}])
    assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("length", "stop")
    return time.time() - t


def test_a_non_streamed_request_whose_client_disconnects_is_cancelled(server):
    """A non-streamed completion of 1,500 tokens; the client closes its socket after a few steps: the request is
    cancelled in the continuous-batching manager (it leaves the scheduler, the worker stops stepping, far fewer
    steps than 1,500), counted, and the next request is answered at once.  (transformers 5.24 alone: the
    request ran to its 1,500th token.)"""
    port, d, proc, _ = server
    before, s0 = _metrics(port), _steps(port)
    body = json.dumps({"model": d, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0}).encode()
    with _send_raw(port, body):
        _running(port, s0)
    s1 = _cancelled_and_idle(port, before, "disconnect")
    assert s1 - s0 < LONG // 2, (s0, s1)
    _answered_promptly(port, d)
    assert _sample(_metrics(port), "cxlalloc_serve_requests_total", route="/v1/completions", status=499) - _sample(
        before, "cxlalloc_serve_requests_total", route="/v1/completions", status=499) == 1


def test_a_streamed_request_whose_client_closes_the_stream_is_cancelled(server):
    """The ``openai`` client streams a completion of 1,500 tokens and closes the stream after three chunks: cancelled
    in the manager the same way, and the next request is answered."""
    import openai

    port, d, proc, _ = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0)
    before, s0 = _metrics(port), _steps(port)
    stream = client.completions.create(model=d, stream=True, max_tokens=LONG, temperature=0, prompt=PROMPT)
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].text)
        if got == 3:
            break
    stream.close()
    s1 = _cancelled_and_idle(port, before, "disconnect")
    assert s1 - s0 < LONG // 2, (s0, s1)
    _answered_promptly(port, d)


def test_every_4xx_is_in_openai_form_and_the_client_raises_with_the_message(server):
    """A model the server does not serve: 404 ``model_not_found`` (the ``openai`` client's NotFoundError); a body
    that is not UTF-8, a field outside OpenAI's schema, an unknown route: OpenAI's error object naming what is
    wrong, never FastAPI's ``{"detail": ...}``."""
    import openai

    port, d, _, _ = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0)
    msgs = [{"role": "user", "content": "hello"}]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=msgs, max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    assert "'nope' does not exist" in e.value.message and d in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=d, messages=msgs, max_tokens=2, extra_body={"bogus_field": 1})
    assert e.value.body["param"] == "bogus_field" and "unrecognized request argument" in e.value.message

    def raw(path, data, method="POST"):
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        return e.value.code, json.loads(e.value.read())

    code, body = raw("/v1/chat/completions", b'{"model": "\xff\xfe", "messages": []}')
    assert code == 400 and set(body) == {"error"}, body
    assert body["error"]["param"] == "body" and "not UTF-8" in body["error"]["message"], body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    code, body = raw("/v1/no-such-route", b"{}")
    assert code == 404 and body["error"]["type"] == "invalid_request_error" and body["error"]["message"], body
    code, body = raw("/v1/chat/completions", None, method="GET")
    assert code == 405 and body["error"]["code"] == "method_not_allowed", body
    assert _answered_promptly(port, d) < 60


def test_a_second_sigint_force_quits_and_says_so_not_the_drain_deadline(tmp_path_factory):
    """Ctrl-C twice (uvicorn's "CTRL+C to force quit") while a long stream runs under --drain-timeout 60: the
    server exits 3 at once, and its last line says a second SIGINT cancelled the request, not that a 60 s
    deadline passed (it said "still running after --drain-timeout 60 s" after one second).  The client's error
    event says the same (it read "drain deadline" before), and no traceback is logged (uvicorn logged the
    lifespan's CancelledError: it skips the app's shutdown on a force quit)."""
    import openai

    from cxlalloc.serve_cli import EXIT_GRACE_S

    _need_serving()
    d = _slow_model(tmp_path_factory, "force-quit")
    path = os.path.join(d, "server.log")
    proc, port, log = _start([d, "--device", "cpu", "--device-limit", "8MiB", "--host-limit", "256MiB",
                              "--cb-block-size", "16", "--cb-num-blocks", "160", "--drain-timeout", "60"], path)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
        chunks = iter(client.completions.create(model=d, stream=True, max_tokens=LONG, temperature=0, prompt=PROMPT))
        next(c for c in chunks if c.choices and c.choices[0].text)
        proc.send_signal(signal.SIGINT)
        time.sleep(1)
        t2 = time.time()
        proc.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError) as e:
            for _ in chunks:
                pass
        assert e.value.message == ("the server is force-quitting on a second SIGINT, before its drain deadline of "
                                   "60 s (--drain-timeout), and this request was still running; retry it on "
                                   "another server"), e.value.message
        assert proc.wait(timeout=30) == 3
        assert time.time() - t2 < EXIT_GRACE_S + 2.0  # the request's clean-up waited for at most 1 s, then the exit
    finally:
        _stop(proc, log)
    with open(path) as f:
        log = f.read()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert last.endswith("cxlalloc serve: stopped by a second SIGINT (force quit, before --drain-timeout 60 s): "
                         "1 request(s) still running were cancelled"), last


def test_sigterm_drain_deadline_cancels_a_stuck_request_and_exits_3(server):
    """SIGTERM while a 1,500-token streamed completion runs (tens of seconds): after --drain-timeout 2 s the
    request is cancelled, the stream ends with OpenAI's error event (the ``openai`` client raises APIError
    saying the server is force-quitting after its 2 s drain deadline) instead of a finish_reason, and the
    process exits 3 saying so, within EXIT_GRACE_S (1 s) of the force quit's start (user trial: 1.7-6 s after the
    deadline; the bound is enforced by a timer, measured here), no traceback logged.  (Stops the module's server:
    keep this test last.)"""
    import openai

    from cxlalloc.serve_cli import EXIT_GRACE_S

    port, d, proc, path = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
    stream = client.completions.create(model=d, stream=True, max_tokens=LONG, temperature=0, prompt=PROMPT)
    chunks = iter(stream)
    next(c for c in chunks if c.choices and c.choices[0].text)
    t = time.time()
    proc.send_signal(signal.SIGTERM)
    rest = []
    with pytest.raises(openai.APIError) as e:  # the stream ends with OpenAI's error event, not a finish_reason
        for c in chunks:
            rest.append(c)
    told = time.time() - t
    assert e.value.message == ("the server is force-quitting after its drain deadline of 2 s (--drain-timeout) and "
                               "this request was still running; retry it on another server"), e.value.message
    assert not [c for c in rest if c.choices and c.choices[0].finish_reason], rest[-2:]
    assert proc.wait(timeout=60) == 3
    exited = time.time() - t
    # the deadline (2 s after the signal), uvicorn's 0.1 s before it starts waiting, then at most EXIT_GRACE_S;
    # 0.5 s more for the event loop to see the deadline and the process to be reaped on a loaded 2-core machine
    assert 2.0 <= told and exited < 2.0 + 0.1 + EXIT_GRACE_S + 0.5, (told, exited)
    with open(path) as f:
        log = f.read()
    assert "1 request(s) still running after --drain-timeout 2 s were cancelled" in log, log[-2000:]
    assert "Traceback" not in log, log[-3000:]


def test_metrics_count_a_request_cut_off_before_its_answer_as_499_and_a_crash_as_500():
    """The serving metrics middleware in-process: an app that raises (Starlette answers 500) is counted 500; one
    cancelled before it answered (its client gone) 499; one that answered, its status."""
    pytest.importorskip("prometheus_client")
    import asyncio

    from prometheus_client.parser import text_string_to_metric_families

    from cxlalloc.hf.serving_metrics import ServeMetrics

    m = ServeMetrics(lambda: {}, lambda model: {})

    async def crash(scope, receive, send):
        raise RuntimeError("boom")

    async def slow(scope, receive, send):
        await asyncio.sleep(60)

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"usage": {"completion_tokens": 2}}'})

    async def sent(message):
        pass

    async def main():
        scope = {"type": "http", "path": "/v1/completions"}
        with pytest.raises(RuntimeError):
            await m.middleware(crash)(scope, None, sent)
        task = asyncio.ensure_future(m.middleware(slow)(scope, None, sent))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await m.middleware(ok)(scope, None, sent)

    asyncio.run(main())
    got = {s.labels["status"]: s.value for fam in text_string_to_metric_families(m.render().decode())
           for s in fam.samples if s.name == "cxlalloc_serve_requests_total"}
    assert got == {"500": 1.0, "499": 1.0, "200": 1.0}, got
