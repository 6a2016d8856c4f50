"""The trace of ``bench --only serve`` (:mod:`.serve`): its parameters, its text, one closed-loop replay over HTTP
and a round's figures.

The trace (seeded; issue 28's shape by default): ``concurrency`` session slots, closed loop (a slot starts its next
session when its last one ends), for ``window_s`` seconds.  A session picks one of ``system_prompts`` shared system
prompts (``system_words`` tokens each) and, with probability ``rag_fraction`` (a RAG session), one of ``documents``
shared documents (``doc_tokens`` = ``MIN-MAX`` tokens each, sizes drawn log-uniformly, seeded), both by Zipf
popularity (exponent ``zipf_s``: the k-th most popular is picked with weight 1 / k^s); a chat session has no
document.  It runs ``turns`` turns: each turn is the whole conversation so far plus a new ``user_words``-token
question (the first one after the document), streamed by the real ``openai`` client, greedy, ``max_tokens``
tokens (a short answer).  The prompt of turn k+1 extends turn k's, so prefix reuse (the document, the system
prompt, then the conversation) decides how much is prefilled again.  At the window's end no new turn starts;
turns in flight finish (drain) and are measured, but only sessions whose last turn ended inside the window count
as completed.

``--serve-trace KEY=VALUE,...`` (:func:`parse_overrides`) sets any :class:`Trace` field from the command line.
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from cxlalloc_apps.bench import method


@dataclasses.dataclass
class Trace:
    """The chat/RAG trace, the model, the budget and the rounds (tokens; blocks of ``page`` tokens; seconds)."""

    concurrency: int = 32  # issue 28: 32-128 sessions
    window_s: float = 60.0
    turns: int = 2
    system_prompts: int = 4
    system_words: int = 128
    documents: int = 16
    doc_tokens: str = "1024-8192"  # issue 28: shared documents of 1-8K tokens
    rag_fraction: float = 0.75  # sessions carrying a document (RAG); the rest are plain chats
    user_words: int = 24
    max_tokens: int = 16
    zipf_s: float = 1.1
    page: int = 16
    budget_blocks: int = 1024  # the device KV budget, in blocks (plain's num_blocks)
    host_factor: int = 4  # cxlalloc's num_blocks = host_factor x budget_blocks (the rest on the host tier)
    max_batch_tokens: int = 512
    vocab_words: int = 1000
    layers: int = 2  # the model (see serve.make_model_dir): small enough that a 4K-token prefill takes well under 1 s
    hidden: int = 64
    kv_heads: int = 2
    rounds: int = 5
    warmup: int = 1
    seed: int = 0

    def doc_range(self) -> Tuple[int, int]:
        """``doc_tokens`` as ``(min, max)``.  Raises ValueError unless it is ``MIN-MAX`` with 1 <= MIN <= MAX."""
        try:
            lo, hi = (int(x) for x in str(self.doc_tokens).split("-"))
        except ValueError:
            raise ValueError(f"doc_tokens={self.doc_tokens!r}: expected MIN-MAX tokens, e.g. 1024-8192") from None
        if not 1 <= lo <= hi:
            raise ValueError(f"doc_tokens={self.doc_tokens!r}: expected 1 <= MIN <= MAX")
        return lo, hi

    def check(self) -> "Trace":
        """Raise ValueError naming the field for a value out of range; returns self."""
        self.doc_range()
        for f in ("concurrency", "turns", "system_prompts", "system_words", "documents", "user_words", "max_tokens",
                  "page", "budget_blocks", "host_factor", "max_batch_tokens", "vocab_words", "layers", "hidden",
                  "kv_heads", "rounds"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}={getattr(self, f)}: must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup}: must be >= 0")
        if not (self.window_s > 0 and math.isfinite(self.window_s)):
            raise ValueError(f"window_s={self.window_s}: must be a positive number of seconds")
        if not 0.0 <= self.rag_fraction <= 1.0:
            raise ValueError(f"rag_fraction={self.rag_fraction}: must be in [0, 1]")
        if not (self.zipf_s >= 0 and math.isfinite(self.zipf_s)):
            raise ValueError(f"zipf_s={self.zipf_s}: must be a finite number >= 0 (0: uniform)")
        if self.hidden % 32 or self.hidden // 32 % self.kv_heads:
            raise ValueError(f"hidden={self.hidden}, kv_heads={self.kv_heads}: hidden must be a multiple of 32 "
                             "(heads of 32) and its heads a multiple of kv_heads")
        return self

    def max_prompt_tokens(self) -> int:
        """An upper bound of one request's tokens (template words included): the positions the model needs."""
        return self.system_words + self.doc_range()[1] + self.turns * (self.user_words + self.max_tokens + 8) + 16


QUICK = Trace(concurrency=2, window_s=4.0, turns=2, system_prompts=2, system_words=16, documents=2,
              doc_tokens="512-1024", rag_fraction=0.5, user_words=6, max_tokens=4, budget_blocks=128,
              max_batch_tokens=256, rounds=1, warmup=0)
"""``--quick``: a smoke run (one round, 2 slots for 4 s); its device budget is one 2 MiB chunk of KV (128 blocks
of the model's 16 KiB), which the two documents and the chats outgrow, so cxlalloc spills."""


def parse_overrides(base: Trace, text: Optional[str]) -> Trace:
    """``base`` with the fields of ``text`` (``KEY=VALUE,...``; ``doc_tokens=MIN-MAX``) replaced, checked.
    Raises ValueError naming an unknown field (and the known ones) or a bad value."""
    t = dataclasses.replace(base)
    if not text:
        return t.check()
    fields = {f.name: f for f in dataclasses.fields(Trace)}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise ValueError(f"--serve-trace: {item!r} is not KEY=VALUE with KEY one of {', '.join(fields)}")
        kind = type(getattr(base, key))
        try:
            setattr(t, key, kind(value.strip()))
        except ValueError:
            raise ValueError(f"--serve-trace: {key}={value!r} is not a {kind.__name__}") from None
    return t.check()


def _words(rng: random.Random, n: int, vocab_words: int) -> str:
    return " ".join(f"w{rng.randrange(vocab_words)}" for _ in range(n))


class TraceText:
    """The trace's text, a function of the seed and the session number only (the same for every arm)."""

    def __init__(self, t: Trace):
        self.t = t
        rng = random.Random(t.seed)
        self.systems = [_words(rng, t.system_words, t.vocab_words) for _ in range(t.system_prompts)]
        lo, hi = t.doc_range()
        self.doc_sizes = [int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))))) for _ in range(t.documents)]
        self.docs = [_words(rng, n, t.vocab_words) for n in self.doc_sizes]
        self.system_weights = [1.0 / (k + 1) ** t.zipf_s for k in range(t.system_prompts)]
        self.doc_weights = [1.0 / (k + 1) ** t.zipf_s for k in range(t.documents)]

    def session(self, sid: int) -> Tuple[int, Optional[int], List[str]]:
        """(system prompt index, document index or None for a chat session, the ``turns`` user questions) of
        session ``sid``."""
        rng = random.Random(self.t.seed * 1_000_003 + sid + 1)
        k = rng.choices(range(self.t.system_prompts), self.system_weights)[0]
        doc = rng.choices(range(self.t.documents), self.doc_weights)[0] if rng.random() < self.t.rag_fraction else None
        return k, doc, [_words(rng, self.t.user_words, self.t.vocab_words) for _ in range(self.t.turns)]

    def first_messages(self, sid: int) -> Tuple[List[dict], List[str]]:
        """The messages before the first question (the system prompt), and the questions, the first one preceded
        by the session's document for a RAG session."""
        k, doc, questions = self.session(sid)
        if doc is not None:
            questions = [f"{self.docs[doc]} {questions[0]}"] + questions[1:]
        return [{"role": "system", "content": self.systems[k]}], questions


def replay(client, model: str, text: TraceText, t: Trace) -> Dict[str, Any]:
    """One round of the closed-loop trace against one server: every request's timings and reply, and the
    sessions completed inside the window."""
    lock = threading.Lock()
    counter = [0]
    reqs: List[dict] = []
    sessions: List[dict] = []
    errors: List[str] = []
    t0 = time.perf_counter()
    end = t0 + t.window_s

    def slot():
        while time.perf_counter() < end:
            with lock:
                sid = counter[0]
                counter[0] += 1
            messages, questions = text.first_messages(sid)
            done = True
            for turn, q in enumerate(questions):
                if time.perf_counter() >= end:
                    done = False
                    break
                messages.append({"role": "user", "content": q})
                s = time.perf_counter()
                first = last = None
                parts: List[str] = []
                try:
                    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=t.max_tokens,
                                                            temperature=0, stream=True)
                    for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            last = time.perf_counter()
                            first = first or last
                            parts.append(chunk.choices[0].delta.content)
                except Exception as e:  # recorded: a failed request is a measured outcome
                    with lock:
                        errors.append(f"session {sid} turn {turn}: {type(e).__name__}: {str(e)[:200]}")
                    done = False
                    break
                reply = "".join(parts)
                with lock:
                    reqs.append({"sid": sid, "turn": turn, "sent": s - t0, "ttft_ms": None if first is None else
                                 (first - s) * 1e3, "tpot_ms": (last - first) * 1e3 / (len(parts) - 1)
                                 if len(parts) > 1 else None, "tokens": len(parts), "end": time.perf_counter() - t0,
                                 "prompt_words": sum(len(m["content"].split()) for m in messages), "reply": reply})
                messages.append({"role": "assistant", "content": reply})
            with lock:
                sessions.append({"sid": sid, "completed": done and time.perf_counter() <= end})

    threads = [threading.Thread(target=slot, daemon=True) for _ in range(t.concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {"wall_s": time.perf_counter() - t0, "requests": reqs, "sessions": sessions, "errors": errors}


def summarize(res: Dict[str, Any], window_s: float) -> Dict[str, Any]:
    """A round's figures: sessions completed (and per minute of window), requests, TTFT p50/p99, TPOT, tokens/s,
    and the prompt words sent (what the server had to prefill or find cached)."""
    reqs = res["requests"]
    ttft = [r["ttft_ms"] for r in reqs if r["ttft_ms"] is not None]
    tpot = [r["tpot_ms"] for r in reqs if r["tpot_ms"] is not None]
    tokens = sum(r["tokens"] for r in reqs)
    done = sum(1 for s in res["sessions"] if s["completed"])
    q = method.quantile
    return {"sessions_completed": done, "sessions_per_min": round(done * 60.0 / window_s, 3),
            "sessions_started": len(res["sessions"]), "requests": len(reqs), "failed_requests": len(res["errors"]),
            "ttft_p50_ms": round(q(ttft, 0.5), 3), "ttft_p99_ms": round(q(ttft, 0.99), 3),
            "tpot_ms": round(q(tpot, 0.5), 3), "output_tokens": tokens,
            "prompt_words": sum(r.get("prompt_words", 0) for r in reqs),
            "tokens_per_s": round(tokens / res["wall_s"], 3), "wall_s": round(res["wall_s"], 3)}
