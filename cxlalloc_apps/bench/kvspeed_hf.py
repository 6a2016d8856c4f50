"""The kvspeed benchmark's model arms (:mod:`.kvspeed`): a 20-turn chat on the wrapped model against a
by-hand ``DynamicCache`` (``chat``) and prefix hits against transformers' deepcopy recipe (``prefix``),
arms interleaved by :mod:`.method`."""

from __future__ import annotations

import copy
import time

MiB = 1 << 20
CHAT_TURNS = 20
CHAT_USER_TOKENS = 24
CHAT_ANSWER_TOKENS = 8
PREFIX_TOKENS = 1024
QUESTION_TOKENS = 16


def _model():
    import torch

    from cxlalloc_apps.bench.reuse import _cpu_model

    torch.manual_seed(0)
    return _cpu_model()


class _FirstLogits:
    def __init__(self):
        self.t = None

    def __call__(self, input_ids, scores):
        if self.t is None:
            self.t = time.perf_counter()
        return scores


def _wrap(base, **opts):
    """A copy of ``base`` wrapped with KV reuse (tiers sized as the reuse benchmark does on the CPU)."""
    import cxlalloc.hf as hf

    m = copy.deepcopy(base)
    wb = sum(p.numel() * p.element_size() for p in m.parameters())
    return hf.wrap(m, kv_store=True, device_limit=wb + 512 * MiB, host_limit=1 << 30, **opts)


def _timed_generate(model, **kw):
    """(output, ms to the first logits)."""
    import torch
    from transformers import LogitsProcessorList

    stamp = _FirstLogits()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(logits_processor=LogitsProcessorList([stamp]), do_sample=False, pad_token_id=0, **kw)
    return out, (stamp.t - t0) * 1e3


CHAT_GOAL = 1.1     # wrapped prefill / by-hand DynamicCache prefill (issue 33)
PREFIX_GOAL = 1.0   # wrapped hit TTFT / transformers' deepcopy recipe (issue 33)


def _rounds(ctx, full: int) -> int:
    from cxlalloc_apps.bench.method import MIN_ROUNDS

    return MIN_ROUNDS if ctx.quick else full


def part_chat(ctx, w, work: str) -> None:
    """A 20-turn chat per round and arm (new user turns each round, the same for every arm of a round);
    the sample is the conversation's summed prefill; arms interleaved by cxlalloc_apps/bench/method.py."""
    import torch
    from transformers import DynamicCache

    import cxlalloc.hf as hf
    from cxlalloc_apps.bench import method

    base, name = _model()
    vocab = int(base.config.vocab_size)
    turns = 8 if ctx.quick else CHAT_TURNS
    models = {"by_hand_dynamic_cache": base, "wrapped_kv_store": _wrap(base),
              "wrapped_blocks_only": _wrap(base, kv_conversation_limit=0),
              "wrapped_full_fingerprint": _wrap(base, kv_store_fingerprint="full")}
    calls = {a: 0 for a in models}
    per_turn = {a: [] for a in models}
    hits = {a: [] for a in models}
    finals = {}

    def conversation(arm):
        k = calls[arm]
        calls[arm] += 1
        g = torch.Generator().manual_seed(1000 + k)  # round k: the same turns for every arm
        hist = torch.randint(3, vocab, (1, 64), generator=g)
        user = [torch.randint(3, vocab, (1, CHAT_USER_TOKENS), generator=g) for _ in range(turns)]
        m = models[arm]
        cache = DynamicCache(config=base.config) if arm == "by_hand_dynamic_cache" else None
        kw = dict(max_new_tokens=CHAT_ANSWER_TOKENS, min_new_tokens=CHAT_ANSWER_TOKENS)
        ms_turns, hit_turns = [], []
        for t in range(turns):
            ids = torch.cat([hist, user[t]], 1)
            if cache is not None:
                out, ms = _timed_generate(m, input_ids=ids, **{hf.cache_kwarg(m): cache}, **kw)
            else:
                out, ms = _timed_generate(m, input_ids=ids, **kw)
                hit_turns.append(hf.stats(m)["hf"]["reuse"]["last"]["hit_tokens"])
            ms_turns.append(round(ms, 3))
            hist = out
        per_turn[arm].append(ms_turns)
        hits[arm].append(hit_turns)
        finals.setdefault(k, {})[arm] = hist
        return sum(ms_turns)

    cmp = method.interleave({a: (lambda a=a: conversation(a)) for a in models}, _rounds(ctx, 5), warmup=1)
    equal = all(torch.equal(f["by_hand_dynamic_cache"], f[a]) for f in finals.values() for a in f)
    ref = "by_hand_dynamic_cache"
    ratios = [(a, ref) for a in models if a != ref]
    g0 = torch.randint(3, vocab, (1, 64 + CHAT_USER_TOKENS), generator=torch.Generator().manual_seed(1))
    noise = method.noise_floor(lambda: _timed_generate(base, input_ids=g0, max_new_tokens=1)[1])
    wrapped = cmp.ratio("wrapped_kv_store", ref)
    timed = {a: v[1:] for a, v in per_turn.items()}  # the warm-up round is not a sample
    w.add({"part": "chat", "model": name, "turns": turns, "user_tokens_per_turn": CHAT_USER_TOKENS,
           "answer_tokens_per_turn": CHAT_ANSWER_TOKENS, "final_tokens": int(64 + turns * (CHAT_USER_TOKENS
                                                                                             + CHAT_ANSWER_TOKENS)),
           "comparison": cmp.as_dict(ratios), "unit": "ms (a conversation's summed prefill)",
           "prefill_ms_total_median": {a: round(cmp.spread(a).median, 1) for a in models},
           "ratio_wrapped_over_by_hand": round(wrapped.median, 3),
           "goal": method.goal_record("chat: wrapped / by-hand DynamicCache prefill", wrapped, CHAT_GOAL),
           "noise_floor_ratio": noise.as_dict(), "ttft_ms_per_turn": timed, "hit_tokens_per_turn": hits,
           "tokens_equal": bool(equal),
           "reuse_counters": hf.stats(models["wrapped_kv_store"])["hf"]["reuse"]["counters"],
           "method": "each round runs one 20-turn conversation per arm (new user turns each round, the same for "
                     "every arm of that round), the arms interleaved in rotated order (method.py); by hand = the "
                     "unwrapped model with one transformers DynamicCache passed to every generate(); wrapped = "
                     "hf.wrap(kv_store=True) (defaults: the last conversation's cache continues, "
                     "kv_store_fingerprint='guarded'); blocks only = kv_conversation_limit=0; full fingerprint = "
                     "kv_store_fingerprint='full'; sample = summed ms from each generate() call to its first "
                     "logits (a logits processor stamps it); noise floor = an A/A ratio of a 1-token generate()"})
    for a, m in models.items():
        if a != ref:
            hf.unwrap(m)


def part_prefix(ctx, w, work: str) -> None:
    """Hits on a shared 1,024-token document, one new question per round and arm, against transformers'
    deepcopy recipe; arms interleaved by cxlalloc_apps/bench/method.py."""
    import torch
    from transformers import DynamicCache

    import cxlalloc.hf as hf
    from cxlalloc_apps.bench import method

    base, name = _model()
    vocab = int(base.config.vocab_size)
    rounds = _rounds(ctx, 9)
    g = torch.Generator().manual_seed(7)
    doc = torch.randint(3, vocab, (1, PREFIX_TOKENS), generator=g)
    qs = [torch.randint(3, vocab, (1, QUESTION_TOKENS), generator=g) for _ in range(rounds + 2)]
    prefix = DynamicCache(config=base.config)
    with torch.no_grad():
        base(doc, use_cache=True, **{hf.cache_kwarg(base): prefix})
    wrapped = {"wrapped_kv_store": _wrap(base), "wrapped_blocks_only": _wrap(base, kv_conversation_limit=0),
               "wrapped_full_fingerprint": _wrap(base, kv_store_fingerprint="full")}
    for m in wrapped.values():  # the first request stores the document's blocks
        _timed_generate(m, input_ids=torch.cat([doc, qs[0]], 1), max_new_tokens=1)
    calls = {a: 0 for a in ("deepcopy_recipe", "recompute", *wrapped)}
    outs, hit = {}, {a: [] for a in wrapped}

    def request(arm):
        k = calls[arm]
        calls[arm] += 1
        ids = torch.cat([doc, qs[1 + k]], 1)
        if arm == "deepcopy_recipe":
            t0 = time.perf_counter()
            c = copy.deepcopy(prefix)
            dc_ms = (time.perf_counter() - t0) * 1e3
            out, ms = _timed_generate(base, input_ids=ids, **{hf.cache_kwarg(base): c}, max_new_tokens=1)
            ms += dc_ms
        elif arm == "recompute":
            out, ms = _timed_generate(base, input_ids=ids, max_new_tokens=1)
        else:
            out, ms = _timed_generate(wrapped[arm], input_ids=ids, max_new_tokens=1)
            hit[arm].append(hf.stats(wrapped[arm])["hf"]["reuse"]["last"]["hit_tokens"])
        outs.setdefault(k, {})[arm] = out
        return ms

    cmp = method.interleave({a: (lambda a=a: request(a)) for a in calls}, rounds, warmup=1)
    equal = all(torch.equal(o["deepcopy_recipe"], o[a]) for o in outs.values() for a in o)
    ref = "deepcopy_recipe"
    ratios = [(a, ref) for a in calls if a != ref]

    def recipe_once():
        c = copy.deepcopy(prefix)
        return _timed_generate(base, input_ids=torch.cat([doc, qs[0]], 1), **{hf.cache_kwarg(base): c},
                               max_new_tokens=1)[1]

    noise = method.noise_floor(recipe_once)
    r = cmp.ratio("wrapped_kv_store", ref)
    w.add({"part": "prefix", "model": name, "prefix_tokens": PREFIX_TOKENS, "question_tokens": QUESTION_TOKENS,
           "comparison": cmp.as_dict(ratios), "unit": "ms (TTFT)",
           "ttft_ms_median": {a: round(cmp.spread(a).median, 2) for a in calls}, "hit_tokens": hit,
           "ratio_wrapped_over_recipe": round(r.median, 3),
           "goal": method.goal_record("prefix hits: wrapped / transformers' deepcopy recipe TTFT", r, PREFIX_GOAL),
           "noise_floor_ratio": noise.as_dict(), "tokens_equal": bool(equal),
           "method": "a 1,024-token document prefilled once into a DynamicCache; each round sends one request "
                     "(document + a new 16-token question) to every arm, interleaved in rotated order "
                     "(method.py): recipe = copy.deepcopy of that cache + generate() of the unwrapped model "
                     "(time of both); wrapped = hf.wrap(kv_store=True) (the previous request's cache continues, "
                     "cropped to the document); blocks only = kv_conversation_limit=0 (the document's blocks "
                     "loaded from the in-process store); full fingerprint = kv_store_fingerprint='full'; "
                     "recompute = the unwrapped model without a cache; TTFT to the first logits; noise floor = "
                     "an A/A ratio of the recipe"})
    for m in wrapped.values():
        hf.unwrap(m)
