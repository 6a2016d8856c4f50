"""The Cache API oracle: the same calls on a stock ``DynamicCache`` and on a
``CxlCache`` give the same results (transformers' own cache is the reference),
for a full-attention model (llama), sliding-window + full hybrids (qwen2 with
``max_window_layers``: full layers first; gemma2: interleaved) and a linear-attention + full hybrid (lfm2: short-conv
layers, transformers' ``LinearAttentionLayer``).  Also: every index argument
type, crop's rules and atomicity, tensors kept by the caller, forwards with
grad, and assisted decoding with wrapped main/assistant models."""

import copy

import numpy as np
import pytest

from tests.helpers.hf_util import MiB, gen, tiny_llama, tiny_qwen2_sliding, torch

import cxlalloc.hf as hf
from cxlalloc.hf import CxlCache, CxlKVLayer, cache_kwarg
from cxlalloc.hf.indices import batch_rows
from cxlalloc.hf.pool import GRAD_ACROSS_FORWARDS
from cxlalloc.hf.compat import POSITIVE_CROP_RAISES
from transformers import DynamicCache


def tiny_lfm2(attn="sdpa", seed=0):
    """Layers [conv, full, conv, full]: transformers' LinearAttentionLayer + DynamicLayer."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(seed)
    cfg = Lfm2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512,
                     layer_types=["conv", "full_attention", "conv", "full_attention"])
    m = Lfm2ForCausalLM(cfg).eval()
    m.config._attn_implementation = attn
    return m


def tiny_gemma2(attn="eager", seed=0):  # gemma2 soft-caps attention logits: sdpa refuses
    """Layers [sliding(5), full, sliding(5), full]: interleaved, the full layers share one store."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    cfg = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=512,
                       sliding_window=5, layer_types=["sliding_attention", "full_attention"] * 2)
    m = Gemma2ForCausalLM(cfg).eval()
    m.config._attn_implementation = attn
    return m


MODELS = {"llama": tiny_llama, "qwen2-sliding": tiny_qwen2_sliding, "gemma2": tiny_gemma2, "lfm2": tiny_lfm2}


@pytest.fixture(autouse=True)
def _quiet_conv_fallback():
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)


def wrap(model, **kw):
    kw.setdefault("device_limit", 64 * MiB)
    kw.setdefault("host_limit", 256 * MiB)
    return hf.wrap(model, **kw)


# ---------------------------------------------------------------- the oracle

class Pair:
    """A DynamicCache and a CxlCache driven by the same forwards and calls."""

    def __init__(self, model):
        if not hf.is_wrapped(model):
            wrap(model)
        self.m = model
        self.kw = cache_kwarg(model)
        self.ref = DynamicCache(config=model.config)
        self.cxl = CxlCache(config=model.config, allocator=hf.allocator(model))
        self.ids = None

    def forward(self, ids):
        """One forward of ``ids`` (B, q) on both caches; returns both logits."""
        out = []
        for c in (self.ref, self.cxl):
            past = c.get_seq_length()
            pos = torch.arange(past, past + ids.shape[1]).expand(ids.shape[0], -1)
            with torch.no_grad():
                out.append(self.m(input_ids=ids, position_ids=pos, use_cache=True, **{self.kw: c}).logits)
        assert torch.equal(out[0], out[1]), "logits differ"
        return out

    def step(self, batch=None):
        b = batch if batch is not None else self.batch()
        return self.forward(torch.arange(5, 5 + b).view(b, 1))

    def batch(self):
        return self.ref.layers[[i for i, s in enumerate(self.ref.is_linear) if not s][0]].keys.shape[0]

    def call(self, name, *args):
        """``name(*args)`` on both; the same result or the same exception type
        (messages: where a test asserts them)."""
        res = []
        for c in (self.ref, self.cxl):
            try:
                res.append(("ok", getattr(c, name)(*args)))
            except Exception as e:  # noqa: BLE001 - compared below
                res.append((type(e), str(e)))
        assert res[0][0] == res[1][0], f"{name}{args}: DynamicCache {res[0]} vs CxlCache {res[1]}"
        if res[0][0] == "ok":
            assert res[0][1] == res[1][1], f"{name}{args} returned {res[0][1]} vs {res[1][1]}"
        return res[0]

    def assert_same(self):
        assert_same_state(self.ref, self.cxl)


def state(cache):
    """Everything the Cache API reports, as plain values (tensors cloned)."""
    n = len(cache.layers)
    attn = [i for i, lin in enumerate(cache.is_linear) if not lin]
    d = {
        "len": len(cache), "n_layers": n, "seq": [cache.get_seq_length(i) for i in attn],
        "seq0": cache.get_seq_length(), "max": [cache.get_max_length(i) for i in range(n)],
        "max_all": cache.get_max_length(), "mask": [cache.get_mask_sizes(q, i) for q in (1, 4) for i in attn],
        "compileable": cache.is_compileable, "croppable": cache.is_croppable, "sliding": cache.is_sliding,
        "linear": cache.is_linear, "dummy": cache.is_dummy, "initialized": cache.is_initialized,
        "batch_size": cache.batch_size, "recording": [cache.is_recording_past(i) for i in range(n)],
        "query_offset": cache.get_query_offset(),
    }
    if any(cache.is_linear):
        d["has_previous_state"] = cache.has_previous_state()
    kv = []
    for i, layer in enumerate(cache.layers):
        if cache.is_linear[i]:
            kv.append(tuple(None if t is None else t.clone() for t in layer.conv_states.values()))
        elif layer.is_initialized and layer.get_seq_length() > 0:
            kv.append((layer.keys.clone(), layer.values.clone()))
        else:
            kv.append(None)
    d["kv"] = kv
    try:  # DynamicCache.__iter__ raises AttributeError for linear-attention layers (no .keys): the same here
        d["iter"] = [tuple(None if t is None else t.clone() for t in item) for item in cache]
    except AttributeError as e:
        d["iter"], d["iter_error"] = [], str(e)
    return d


def assert_same_state(ref, cxl):
    a, b = state(ref), state(cxl)
    for k in a:
        if k in ("kv", "iter"):
            continue
        assert a[k] == b[k], f"{k}: DynamicCache {a[k]} vs CxlCache {b[k]}"
    for name in ("kv", "iter"):
        for i, (x, y) in enumerate(zip(a[name], b[name])):
            if x is None or y is None:
                assert (x is None or all(t is None or t.numel() == 0 for t in x)) and \
                       (y is None or all(t is None or t.numel() == 0 for t in y)), f"{name} layer {i}"
                continue
            assert len(x) == len(y), f"{name} layer {i}"
            for s, t in zip(x, y):
                assert (s is None) == (t is None), f"{name} layer {i}"
                if s is not None:
                    assert s.shape == t.shape and torch.equal(s, t), f"{name} layer {i}: tensors differ"


def assert_state_equal(a, b):
    """Two state() snapshots of one cache are the same (nothing changed)."""
    for k in a:
        if k in ("kv", "iter"):
            for x, y in zip(a[k], b[k]):
                assert (x is None) == (y is None)
                if x is not None:
                    assert all((s is None and t is None) or torch.equal(s, t) for s, t in zip(x, y))
        else:
            assert a[k] == b[k], k


def prefilled(model, batch=3, length=9):
    p = Pair(model)
    g = torch.Generator().manual_seed(3)
    p.forward(torch.randint(3, 1000, (batch, length), generator=g))
    return p


INDEX_KINDS = {
    "tensor-long": lambda rows: torch.tensor(rows, dtype=torch.long),
    "tensor-int32": lambda rows: torch.tensor(rows, dtype=torch.int32),
    "list": list,
    "tuple": tuple,
    "numpy": lambda rows: np.array(rows),
}


# ---------------------------------------------------------------- API oracle tests

@pytest.mark.parametrize("name", list(MODELS))
def test_update_and_queries_match_dynamic_cache(fresh_sim, name):
    p = Pair(MODELS[name]())
    p.assert_same()  # empty
    for c in (p.ref, p.cxl):
        assert c.get_seq_length() == 0 and c.get_mask_sizes(3, 0) == (3, 0) or c.is_linear[0]
    g = torch.Generator().manual_seed(3)
    p.forward(torch.randint(3, 1000, (2, 9), generator=g))
    p.assert_same()
    for _ in range(8):  # past the sliding window (6)
        p.step()
        p.assert_same()
    assert p.cxl.get_seq_length() == 17
    kinds = {type(layer).__name__ for layer in p.cxl.layers}
    assert "CxlKVLayer" in kinds
    d = copy.deepcopy(p.cxl)
    assert_same_state(p.ref, d)
    p.cxl.reset()
    p.ref.reset()
    p.assert_same()
    p.forward(torch.randint(3, 1000, (1, 5), generator=g))  # another batch size after reset
    p.assert_same()


@pytest.mark.parametrize("name", ["llama", "qwen2-sliding", "gemma2"])
def test_direct_update_calls_match_dynamic_cache(fresh_sim, name):
    """``cache.update(k, v, layer_idx)`` called by hand (no model, no planned
    forward): the same returned K/V, lengths and mask sizes, step after step,
    including after early_initialization."""
    m = MODELS[name]()
    wrap(m)
    cfg = m.config
    heads, dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for early in (False, True):
        ref, cxl = DynamicCache(config=cfg), CxlCache(config=cfg, allocator=hf.allocator(m))
        if early:
            for c in (ref, cxl):
                c.early_initialization(2, heads, dim, torch.float32, torch.device("cpu"))
            assert ref.is_initialized and cxl.is_initialized and cxl.get_seq_length() == 0
        g = torch.Generator().manual_seed(9)
        for q in (5, 1, 1, 3, 1, 1):
            for i in range(len(ref.layers)):
                assert ref.get_mask_sizes(q, i) == cxl.get_mask_sizes(q, i)
                k = torch.randn(2, heads, q, dim, generator=g)
                v = torch.randn(2, heads, q, dim, generator=g)
                a, b = ref.update(k, v, i), cxl.update(k, v, i)
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (q, i)
            assert_same_state(ref, cxl)


@pytest.mark.parametrize("kind", list(INDEX_KINDS))
@pytest.mark.parametrize("name", list(MODELS))
def test_reorder_and_select_with_every_index_type(fresh_sim, name, kind):
    p = prefilled(MODELS[name](), batch=3)
    p.step()
    make = INDEX_KINDS[kind]
    if kind in ("list", "tuple"):
        # DynamicCache's reorder calls beam_idx.to(...): it takes tensors only; CxlCache takes the
        # sequence as the rows it names.  Compare with the tensor form on the reference.
        p.ref.reorder_cache(torch.tensor([2, 0, 1]))
        p.cxl.reorder_cache(make([2, 0, 1]))
    elif kind == "numpy":
        p.ref.reorder_cache(torch.tensor([2, 0, 1]))
        p.cxl.reorder_cache(make([2, 0, 1]))
    else:
        p.call("reorder_cache", make([2, 0, 1]))
    p.assert_same()
    p.step()
    p.assert_same()
    r = p.call("batch_select_indices", make([2, 0]))  # a tuple is rows 2 and 0, never keys[2, 0]
    p.assert_same()
    if name == "lfm2":  # transformers' LinearAttentionLayer has no batch_select_indices: both refuse
        assert r[0] is AttributeError and "batch_select_indices" in r[1]
        assert p.call("batch_repeat_interleave", 2)[0] is AttributeError
        p.assert_same()
        return
    assert p.cxl.layers[[i for i, l in enumerate(p.cxl.layers) if isinstance(l, CxlKVLayer)][0]].keys.shape[0] == 2
    p.step()
    p.assert_same()
    p.call("batch_repeat_interleave", 2)
    p.assert_same()
    p.step()
    p.assert_same()


@pytest.mark.parametrize("name", list(MODELS))
def test_select_with_mask_negative_rows_and_duplicates(fresh_sim, name):
    p = prefilled(MODELS[name](), batch=3)
    if name == "lfm2":  # reorder only (no batch_select_indices in transformers' linear layers)
        p.call("reorder_cache", torch.tensor([1, 1, 0]))
        p.step()
        p.assert_same()
        return
    p.call("batch_select_indices", torch.tensor([True, False, True]))
    p.assert_same()
    p.step()
    p.call("batch_select_indices", [-1, 0, 0])
    p.assert_same()
    p.step()
    p.assert_same()
    p.call("reorder_cache", torch.tensor([1, 1, 0]))  # beam search keeps duplicates
    p.step()
    p.assert_same()
    p.call("reorder_cache", torch.tensor([2, 0]))  # another length: index_select selects those rows
    p.assert_same()
    p.step(batch=2)
    p.assert_same()


def test_tuple_index_is_rows_not_a_multi_dim_index(fresh_sim):
    m = tiny_llama()
    wrap(m)
    p = prefilled(m, batch=4)
    k = p.cxl.layers[0].keys.clone()
    p.cxl.batch_select_indices((3, 1))
    assert torch.equal(p.cxl.layers[0].keys, k[[3, 1]])
    assert torch.equal(p.cxl.layers[0].keys, k.index_select(0, torch.tensor([3, 1])))
    out = batch_rows((3, 1), 4, torch.device("cpu"), "indices")
    assert out.dtype == torch.long and out.tolist() == [3, 1]


@pytest.mark.parametrize("name", list(MODELS))
def test_bad_index_arguments_are_clear_errors_and_change_nothing(fresh_sim, name):
    p = prefilled(MODELS[name](), batch=3)
    before = state(p.cxl)
    cases = [
        ("batch_select_indices", [0.5, 1.0], TypeError, "integer batch rows"),
        ("batch_select_indices", torch.tensor([[0, 1]]), ValueError, "must be 1-D"),
        ("batch_select_indices", [0, 3], IndexError, "outside [-3, 3)"),
        ("batch_select_indices", [], ValueError, "selects no batch row"),
        ("batch_select_indices", torch.tensor([True, False]), IndexError, "mask of 2 rows"),
        ("batch_select_indices", [[0], [1, 2]], TypeError, "1-D tensor, list, tuple or numpy array"),
        ("reorder_cache", torch.tensor([True, False, True]), TypeError, "not a bool mask"),
        ("reorder_cache", [0, 1, 5], IndexError, "outside"),
        ("crop", 1.5, TypeError, "takes an int"),
        ("crop", "2", TypeError, "takes an int"),
    ]
    for op, arg, exc, msg in cases:
        with pytest.raises(exc, match=msg.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
            getattr(p.cxl, op)(arg)
        assert_state_equal(before, state(p.cxl))
    p.step()
    p.assert_same()


# ---------------------------------------------------------------- crop

@pytest.mark.parametrize("name", list(MODELS))
def test_crop_follows_installed_transformers(fresh_sim, name):
    p = prefilled(MODELS[name](), batch=2, length=2)  # stays below the sliding windows (5, 6)
    if name == "lfm2":  # linear layers refuse crop without past recording: both raise the same
        r = p.call("crop", -1)
        assert r[0] is RuntimeError and "activate_past_recording" in r[1]
        p.assert_same()
        p.call("activate_past_recording")
    p.step()
    p.call("crop", -2)
    p.assert_same()
    p.step()
    p.assert_same()
    p.call("crop", 0)
    p.assert_same()
    if POSITIVE_CROP_RAISES:  # positive: 5.24 refuses (5.17 kept 3)
        with pytest.raises((ValueError, RuntimeError)) as ref_err:
            p.ref.crop(3)
        with pytest.raises(ref_err.type) as err:
            p.cxl.crop(3)
        assert str(err.value) == str(ref_err.value)  # the first layer that refuses speaks, in both
    else:
        p.call("crop", 3)
    p.assert_same()
    p.call("crop", -100)  # past the length: everything goes
    p.assert_same()
    assert p.cxl.get_seq_length() == 0
    p.forward(torch.randint(3, 1000, (2, 3), generator=torch.Generator().manual_seed(5)))
    p.assert_same()


def test_crop_past_sliding_window_recording_and_not(fresh_sim):
    """qwen2 [full, full, sliding(6), sliding(6)]: past the window a crop needs
    past recording (transformers' rule); without it the crop raises and the
    CxlCache is left whole (transformers' DynamicCache has already cropped its
    full layers by then)."""
    m = tiny_qwen2_sliding()
    p = prefilled(m, batch=2, length=9)
    before = state(p.cxl)
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        p.ref.crop(-2)
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        p.cxl.crop(-2)
    assert_state_equal(before, state(p.cxl))
    assert p.ref.layers[0].get_seq_length() == 7  # the reference is half cropped
    # With recording, both roll back identically.
    q = Pair(m)
    q.call("activate_past_recording")
    q.forward(torch.randint(3, 1000, (2, 9), generator=torch.Generator().manual_seed(3)))
    for _ in range(3):
        q.step()
    q.assert_same()
    q.call("crop", -2)
    q.assert_same()
    q.step()
    q.call("crop", 0)
    q.assert_same()
    r = q.call("crop", 2)
    assert r[0] in (ValueError, RuntimeError)
    q.step()
    q.assert_same()


@pytest.mark.parametrize("name", list(MODELS))
def test_crop_is_atomic_when_a_layer_fails(fresh_sim, name, monkeypatch):
    p = prefilled(MODELS[name](), batch=2, length=5)
    p.call("activate_past_recording")
    p.step()
    before = state(p.cxl)
    last = p.cxl.layers[-1]
    calls = []

    def failing(n):
        calls.append(n)
        raise RuntimeError("injected crop failure")

    monkeypatch.setattr(last, "crop", failing)
    with pytest.raises(RuntimeError, match="injected"):
        p.cxl.crop(-2)
    assert calls == [-2]  # every layer before the last was cropped, then put back
    monkeypatch.undo()
    assert_state_equal(before, state(p.cxl))
    assert p.cxl.get_seq_length() == 6
    # Still usable and identical to the reference.
    p.step()
    p.assert_same()


def test_crop_releases_chunks_only_when_no_view_points_there(fresh_sim):
    m = tiny_llama(hidden=256, heads=8, kv_heads=8, layers=4)  # 16 KiB per token at batch 2: 128 tokens a chunk
    wrap(m)
    c = CxlCache(config=m.config, allocator=hf.allocator(m))
    with torch.no_grad():
        m(input_ids=torch.randint(3, 1000, (2, 300)), use_cache=True, **{cache_kwarg(m): c})
    assert c.kv_stats()["kv_device_bytes"] == 6 * MiB
    kept = c.layers[0].keys  # a view of all 300 tokens
    ref = kept.clone()
    c.crop(-200)
    st = c.kv_stats()
    assert c.get_seq_length() == 100 and st["kv_device_bytes"] == 6 * MiB and st["trims_deferred"] == 1
    assert torch.equal(kept, ref)  # still readable: nothing released under it
    del kept
    with torch.no_grad():  # the next step releases the chunks
        m(input_ids=torch.tensor([[7], [8]]), position_ids=torch.tensor([[100], [100]]), use_cache=True,
          **{cache_kwarg(m): c})
    assert c.get_seq_length() == 101 and c.kv_stats()["kv_device_bytes"] == 2 * MiB
    c.crop(-1)  # no view alive: released at once (here, nothing beyond the first chunk)
    assert c.kv_stats()["kv_device_bytes"] == 2 * MiB


# ---------------------------------------------------------------- kept tensors

def test_kept_tensors_and_when_they_change(fresh_sim):
    """docs/huggingface.md "CxlCache vs DynamicCache": a K/V tensor handed out
    keeps its values through later appends, spills, select/repeat, deepcopy and
    a crop; it is rewritten in place by a reorder (when applied) and, after a
    crop, by the tokens written over the dropped positions."""
    m = tiny_llama()
    wrap(m)
    p = prefilled(m, batch=3, length=6)
    kept = p.cxl.layers[0].keys
    ref = kept.clone()
    p.step()
    assert torch.equal(kept, ref)  # appends land beyond the view
    p.cxl.reserve(p.cxl.kv_stats()["capacity_tokens"] + 1000)  # a regrowth: new storage, one copy
    assert p.cxl.kv_stats()["regrowths"] == 1 and torch.equal(kept, ref)
    p.step()
    p.assert_same()
    copy.deepcopy(p.cxl)
    p.call("batch_select_indices", [0, 1, 2])  # new storage: the old view keeps its values
    assert torch.equal(kept, ref)
    kept = p.cxl.layers[0].keys
    ref = kept.clone()
    p.call("crop", -3)
    assert torch.equal(kept, ref)  # crop alone changes nothing under a kept view
    t = p.cxl.get_seq_length()
    p.forward(torch.tensor([[11], [12], [13]]))  # another token than the one dropped at position t
    new = p.cxl.layers[0].keys
    assert torch.equal(kept[:, :, :t], ref[:, :, :t])
    assert torch.equal(kept[:, :, t], new[:, :, t]) and not torch.equal(kept[:, :, t], ref[:, :, t])
    assert torch.equal(kept[:, :, t + 1:], ref[:, :, t + 1:])
    kept = p.cxl.layers[0].keys
    ref = kept.clone()
    p.call("reorder_cache", torch.tensor([2, 1, 0]))
    p.step()
    p.assert_same()
    assert torch.equal(kept, ref[[2, 1, 0]])  # rewritten in place: rows 0 and 2 swapped


# ---------------------------------------------------------------- grad

def _loss_and_grads(model, cache, ids, pos):
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        out = model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache})
        loss = out.logits.float().pow(2).mean()
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["llama", "qwen2-sliding"])
def test_forward_with_grad_backpropagates_like_dynamic_cache(fresh_sim, name):
    m = MODELS[name]()
    wrap(m)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 1000, (2, 8), generator=g)
    pos = torch.arange(8).expand(2, -1)
    ref = _loss_and_grads(m, DynamicCache(config=m.config), ids, pos)
    c = CxlCache(config=m.config, allocator=hf.allocator(m))
    out = _loss_and_grads(m, c, ids, pos)
    assert torch.equal(ref[0], out[0])
    assert ref[1].keys() == out[1].keys() and len(ref[1]) > 0
    for n in ref[1]:
        assert torch.allclose(ref[1][n], out[1][n], atol=1e-6), n
    assert c.get_seq_length() == 8 and not c.layers[0].keys.requires_grad
    # A prompt cached without grad, then a forward with grad: as DynamicCache.
    caches = []
    for cache in (DynamicCache(config=m.config), CxlCache(config=m.config, allocator=hf.allocator(m))):
        with torch.no_grad():
            m(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(m): cache})
        caches.append(cache)
    ids2, pos2 = torch.tensor([[5, 6], [7, 8]]), torch.tensor([[8, 9], [8, 9]])
    r2 = _loss_and_grads(m, caches[0], ids2, pos2)
    o2 = _loss_and_grads(m, caches[1], ids2, pos2)
    assert torch.equal(r2[0], o2[0])
    for n in r2[1]:
        assert torch.allclose(r2[1][n], o2[1][n], atol=1e-6), n
    # Two forwards with grad through one cache: refused with a clear error (DynamicCache would chain the graphs).
    with pytest.raises(RuntimeError) as e:
        _loss_and_grads(m, c, ids2, pos2)
    assert str(e.value) == GRAD_ACROSS_FORWARDS
    assert c.get_seq_length() == 8  # nothing written
    if name == "llama":
        c.crop(-8)  # dropping the tokens cached with grad lifts the refusal
    else:
        c.reset()  # (a sliding layer past its window cannot crop without past recording)
    _loss_and_grads(m, c, ids, pos)


# ---------------------------------------------------------------- assisted decoding

def _assisted(main, assistant, ids, n=14):
    return gen(main, input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
               assistant_model=assistant, num_assistant_tokens=3).sequences


def _greedy(model, ids, n=14):
    return gen(model, input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False).sequences


def _keep_caches(monkeypatch):
    """Every CxlCache wrap() makes, kept alive for inspection."""
    import importlib

    w = importlib.import_module("cxlalloc.hf.wrap")
    made = []
    orig = w.WrapState.new_cache

    def new_cache(self, model, max_cache_len):
        c = orig(self, model, max_cache_len)
        made.append((model, c))
        return c

    monkeypatch.setattr(w.WrapState, "new_cache", new_cache)
    return made


@pytest.mark.parametrize("assistant_name", ["llama", "qwen2-sliding", "gemma2", "lfm2"])
def test_assisted_decoding_with_wrapped_models(fresh_sim, assistant_name, monkeypatch):
    """Tokens identical to unwrapped assisted generation and to plain greedy of
    the main model, with the main model wrapped, the assistant wrapped, both,
    and the assistant as its own assistant; a sliding-window (window 6) or
    linear-attention assistant needs past recording for its rollbacks."""
    made = _keep_caches(monkeypatch)
    main = tiny_llama(seed=1)
    assistant = MODELS[assistant_name](seed=2)
    ids = torch.randint(3, 60, (1, 10), generator=torch.Generator().manual_seed(6))
    greedy = _greedy(main, ids)
    self_greedy = _greedy(assistant, ids)
    ref = _assisted(main, assistant, ids)
    ref_self = _assisted(assistant, assistant, ids)
    assert torch.equal(ref, greedy) and torch.equal(ref_self, self_greedy)
    wrap(main)
    assert torch.equal(_assisted(main, assistant, ids), greedy)  # wrapped main, plain assistant
    wrap(assistant)
    assert torch.equal(_assisted(main, assistant, ids), greedy)  # both wrapped
    assert torch.equal(_assisted(assistant, assistant, ids), self_greedy)  # its own assistant
    hf.unwrap(main)
    del made[:]
    assert torch.equal(_assisted(main, assistant, ids), greedy)  # plain main, wrapped assistant
    (model, c), = made  # one cache: the assistant's, made once and passed back in for every round
    assert model is assistant and c.get_seq_length() > 0
    recording = [c.is_recording_past(i) for i in range(len(c.layers))]
    if assistant_name == "llama":
        assert recording == [False, False]  # CxlKVLayer rolls back without recording
    else:  # transformers' own sliding / conv layers were marked, as in the DynamicCache it made
        assert recording == [not isinstance(layer, CxlKVLayer) for layer in c.layers] and any(recording)
    hf.unwrap(assistant)


def test_assisted_decoding_generate_hook_keeps_recording(fresh_sim, monkeypatch):
    made = _keep_caches(monkeypatch)
    main = tiny_llama(seed=1)
    assistant = tiny_qwen2_sliding(seed=2)
    ids = torch.randint(3, 60, (1, 10), generator=torch.Generator().manual_seed(6))
    greedy = _greedy(main, ids)
    wrap(assistant, hook="generate")
    assert torch.equal(_assisted(main, assistant, ids), greedy)
    (model, c), = made
    assert model is assistant and [c.is_recording_past(i) for i in range(4)] == [False, False, True, True]
    assert torch.equal(_greedy(assistant, ids), _greedy(hf.unwrap(assistant), ids))


def test_assisted_sampling_equals_unwrapped(fresh_sim):
    """Speculative sampling (do_sample=True with an assistant): the same seed
    gives the same tokens and scores wrapped as unwrapped."""
    main = tiny_llama(seed=1)
    assistant = tiny_qwen2_sliding(seed=2)
    ids = torch.randint(3, 60, (1, 10), generator=torch.Generator().manual_seed(6))
    kw = dict(input_ids=ids, max_new_tokens=14, min_new_tokens=14, do_sample=True, assistant_model=assistant,
              num_assistant_tokens=3, seed=5)
    ref = gen(main, **kw)
    wrap(main)
    wrap(assistant)
    out = gen(main, **kw)
    assert torch.equal(ref.sequences, out.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ref.scores, out.scores)) and len(ref.scores) == len(out.scores)
