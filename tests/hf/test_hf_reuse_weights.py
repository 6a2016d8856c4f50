"""KV reuse never serves K/V of other weights or other inputs (simulation).

For every way of changing weights in place, the next generate() with a
kv_store has no stale hit and its tokens equal those of a fresh model with the
same weights; every generate() input that can change K/V without changing the
token ids turns lookup and store off for that call (said once)."""

import warnings

import pytest

from tests.helpers.hf_util import assert_same_tokens, gen, tiny_llama, torch

import cxlalloc.hf as hf
from cxlalloc.hf.reuse import KVReuseWarning
from cxlalloc.kvstore import keys as K

from tests.hf.test_hf_reuse import wrap  # the same wrap() options (8-token blocks)

KW = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)


def prompt(n=41, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (1, n), generator=g)


def last(model):
    return hf.stats(model)["hf"]["reuse"]["last"]


def _lora(m):  # W += B @ A on q/k/v of every layer (a merged rank-2 adapter), through .data as peft's merge does
    g = torch.Generator().manual_seed(7)
    for layer in m.model.layers:
        for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
            w = proj.weight
            b, a = torch.randn(w.shape[0], 2, generator=g), torch.randn(2, w.shape[1], generator=g)
            w.data += 0.05 * (b @ a)


def _load(m):
    m.load_state_dict(tiny_llama(seed=1).state_dict())


def _one_element(m):  # one element far from every sampled position, through .data
    m.model.layers[1].self_attn.k_proj.weight.data[17, 29] += 3.0


# Each changes the weights in place (nothing that replaces the module).
CHANGES = {
    "data-add": lambda m: m.model.layers[0].self_attn.k_proj.weight.data.add_(0.05),
    "copy": lambda m: torch.no_grad()(lambda: m.model.layers[0].self_attn.v_proj.weight.copy_(
        torch.randn_like(m.model.layers[0].self_attn.v_proj.weight)))(),
    "slice": lambda m: m.model.layers[0].self_attn.k_proj.weight.data.__setitem__((slice(0, 3),), 0.5),
    "one-element": _one_element,
    "numpy-alias": lambda m: m.model.embed_tokens.weight.detach().numpy().__imul__(1.5),
    "load-state-dict": _load,
    "lora-merge": _lora,
    "buffer": lambda m: m.model.rotary_emb.inv_freq.mul_(0.5),
    "dtype-roundtrip": lambda m: m.to(torch.bfloat16).to(torch.float32),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_no_in_place_weight_change_gives_a_stale_hit(fresh_sim, change):
    torch.manual_seed(0)
    m = tiny_llama()
    wrap(m)
    p = prompt()
    gen(m, input_ids=p, **KW)
    gen(m, input_ids=p, **KW)
    assert last(m)["hit_tokens"] == 40  # positive control: the same weights hit
    torch.manual_seed(1)
    CHANGES[change](m)
    torch.manual_seed(0)
    ref = tiny_llama()  # a fresh model with the same change, never wrapped
    torch.manual_seed(1)
    CHANGES[change](ref)
    out = gen(m, input_ids=p, **KW)
    assert last(m)["hit_tokens"] == 0, f"{change}: a stale hit"
    assert_same_tokens(gen(ref, input_ids=p, **KW), out, atol=1e-5)
    out = gen(m, input_ids=p, **KW)  # the new weights' own blocks hit
    assert last(m)["hit_tokens"] == 40
    assert_same_tokens(gen(ref, input_ids=p, **KW), out, atol=1e-5)
    assert hf.stats(m)["hf"]["reuse"]["counters"]["fingerprint_changes"] >= 1


def test_a_dtype_move_keys_apart_and_matches_a_fresh_model(fresh_sim):
    torch.manual_seed(0)
    m = tiny_llama().to(torch.bfloat16)
    wrap(m)
    p = prompt()
    gen(m, input_ids=p, **KW)
    torch.manual_seed(0)
    ref = tiny_llama().to(torch.bfloat16)
    fp_bf16 = K.model_fingerprint(ref)
    assert fp_bf16 != K.model_fingerprint(ref.float())  # a move to another dtype is another model
    assert K.model_fingerprint(ref.to(torch.bfloat16)) == fp_bf16  # and back: the same bytes again


def test_sampled_mode_sees_version_and_sampled_changes_but_guarded_is_the_default(fresh_sim):
    torch.manual_seed(0)
    m = tiny_llama()
    full, sampled = K.WeightsWatch(m, "full"), K.WeightsWatch(m, "sampled")
    assert K.WeightsWatch(m).mode == "guarded" and K.DEFAULT_WEIGHT_MODE == "guarded"
    f0, s0 = full.fingerprint(), sampled.fingerprint()
    assert f0 == s0  # both fingerprint every byte; they differ in how often
    with torch.no_grad():
        m.model.layers[0].mlp.up_proj.weight.add_(1e-3)  # bumps the version counter
    assert sampled.fingerprint() != s0 and full.fingerprint() != f0
    f1 = full.fingerprint()
    _one_element(m)  # .data, outside the sample: only "full" sees it (documented)
    assert full.fingerprint() != f1
    with pytest.raises(ValueError, match="kv_store_fingerprint.*allowed: guarded, full, sampled"):
        K.WeightsWatch(m, "partial")


class _Big(torch.nn.Module):
    """Two parameters of many pages each (the guard protects whole pages inside a tensor) and a small one."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.a = torch.nn.Parameter(torch.randn(512, 1024, generator=g))  # 2 MiB
        self.b = torch.nn.Parameter(torch.randn(300, 700, generator=g))
        self.c = torch.nn.Parameter(torch.randn(7, generator=g))


def _ctypes_write(m):  # a raw write that no torch counter can see
    import ctypes

    p = m.a
    ctypes.memset(p.data_ptr() + p.numel() * 2, 0x41, 4)


# Writes into the middle of a big tensor (far from its edges, which are digested at every check).
GUARDED_WRITES = {
    "data": lambda m: m.a.data.view(-1).__setitem__(262_000, 9.0),
    "numpy": lambda m: m.a.detach().numpy().reshape(-1).__setitem__(300_001, -4.0),
    "ctypes": _ctypes_write,
    "copy": lambda m: torch.no_grad()(lambda: m.b.copy_(torch.zeros_like(m.b)))(),
    "small": lambda m: m.c.data.add_(1.0),
    "replace": lambda m: setattr(m, "b", torch.nn.Parameter(m.b.detach().clone().mul_(2))),
    "load-state-dict": lambda m: m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()}),
}


@pytest.mark.parametrize("write", list(GUARDED_WRITES))
def test_guarded_mode_sees_each_write_and_reads_only_what_changed(write):
    """The default fingerprint digests no tensor again while nothing wrote one (its cost does not grow with
    the weights' bytes), sees every write (through the page fault when no torch counter moves: .data,
    .numpy(), ctypes), and equals the full digest of the same bytes."""
    from cxlalloc import _C

    m = _Big()
    g, full = K.WeightsWatch(m), K.WeightsWatch(m, "full")
    f0 = g.fingerprint()
    assert f0 == full.fingerprint()
    assert g.last_check["guarded_tensors"] == 3 and _C.guard_stats()[0] >= 2
    assert g.fingerprint() == f0
    assert g.last_check["digested_tensors"] == 0
    assert g.last_check["digested_bytes"] < 5 * _C.guard_page_size()  # the edges only, not 2.8 MB
    faults = _C.guard_stats()[1]
    GUARDED_WRITES[write](m)
    f1 = g.fingerprint()
    assert f1 != f0, f"{write}: the change was not seen"
    assert f1 == full.fingerprint()
    assert 1 <= g.last_check["digested_tensors"] <= 3
    if write in ("data", "numpy", "ctypes"):
        assert _C.guard_stats()[1] == faults + 1  # seen by the fault, one per written tensor
    assert g.fingerprint() == f1 and g.last_check["digested_tensors"] == 0  # guarded again
    GUARDED_WRITES["numpy"](m)  # and a second write after the re-guard is seen too
    assert g.fingerprint() == full.fingerprint()
    g.close()


def test_guarded_mode_starts_over_when_its_handler_was_replaced():
    """Another library's SIGSEGV handler put in place of the guard's (faulthandler.disable() restores the
    default): the next check digests every tensor again and puts the handler back; writes are seen after."""
    import faulthandler

    from cxlalloc import _C

    m = _Big()
    g = K.WeightsWatch(m)
    g.fingerprint()
    was = faulthandler.is_enabled()
    faulthandler.disable()
    faulthandler.enable()  # installed after the guard's handler (and chaining to it)
    if not _C.guard_handler_installed():
        f = g.fingerprint()
        assert g.last_check["digested_tensors"] == 3
        assert _C.guard_handler_installed()
    else:
        f = g.fingerprint()
    GUARDED_WRITES["numpy"](m)
    assert g.fingerprint() != f and g.fingerprint() == K.WeightsWatch(m, "full").fingerprint()
    if not was:
        faulthandler.disable()
    g.close()


def test_guarded_mode_sees_a_write_after_its_pages_lost_the_guard():
    """A range made writable behind the guard's back (as a remap of the address by a driver would): the
    write there does not fault, and the next check still sees it (the ranges are checked read-only in
    /proc/self/maps at every check)."""
    import ctypes

    from cxlalloc import _C

    m = _Big()
    g = K.WeightsWatch(m)
    f0 = g.fingerprint()
    ps = _C.guard_page_size()
    lo, hi = -(-m.a.data_ptr() // ps) * ps, (m.a.data_ptr() + m.a.numel() * 4) // ps * ps
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(lo, hi - lo, 3) == 0  # PROT_READ | PROT_WRITE
    faults = _C.guard_stats()[1]
    GUARDED_WRITES["numpy"](m)
    assert _C.guard_stats()[1] == faults  # no fault: only the maps check can tell
    f1 = g.fingerprint()
    assert f1 != f0 and f1 == K.WeightsWatch(m, "full").fingerprint()
    g.close()


def test_unwrap_makes_the_guarded_pages_writable_again(fresh_sim):
    from cxlalloc import _C

    torch.manual_seed(0)
    m = tiny_llama(hidden=256)
    before = _C.guard_stats()[0]
    wrap(m)
    gen(m, input_ids=prompt(), **KW)
    assert _C.guard_stats()[0] > before
    hf.unwrap(m)
    assert _C.guard_stats()[0] == before


def test_weights_changed_during_a_call_store_nothing(fresh_sim):
    """A logits processor that changes weights mid-generate(): the answer's later K/V come from other
    weights than the call's start, so nothing of the call is stored or kept; with the weights put back, the
    next call hits nothing (without the end-of-call check it hit blocks holding K/V of the changed weights)."""
    from transformers import LogitsProcessorList

    torch.manual_seed(0)
    m = tiny_llama()
    wrap(m)
    w = m.model.layers[0].self_attn.k_proj.weight
    saved = w.detach().clone()

    def change(ids, scores):
        if ids.shape[1] == 41:  # after the prefill: the decode steps run on changed weights
            w.data.add_(0.5)
        return scores

    out = gen(m, input_ids=prompt(), max_new_tokens=12, min_new_tokens=12, do_sample=False,
              logits_processor=LogitsProcessorList([change]))
    assert hf.stats(m)["hf"]["reuse"]["counters"]["changed_during_call"] == 1
    w.data.copy_(saved)
    gen(m, input_ids=out.sequences, **KW)
    assert last(m)["hit_tokens"] == 0


def test_the_on_device_digest_sees_one_word_and_a_swap():
    t = torch.randn(3000)
    d = K._device_digest(t)
    u = t.clone()
    u[1234] += 1.0
    assert K._device_digest(u) != d
    s = t.clone()
    s[[10, 20]] = s[[20, 10]]
    assert K._device_digest(s) != d
    assert K._device_digest(t.clone()) == d
    odd = torch.arange(7, dtype=torch.uint8)  # a size that is no multiple of 4 bytes
    assert K._device_digest(odd) != K._device_digest(odd + 1)


# ------------------------------------------------------------------ inputs that change K/V, not the ids
def _embeds(m, p, noise):
    with torch.no_grad():
        e = m.get_input_embeddings()(p)
    return e + noise * torch.randn(e.shape, generator=torch.Generator().manual_seed(5))


def test_inputs_embeds_with_the_same_ids_is_neither_looked_up_nor_stored(fresh_sim):
    torch.manual_seed(0)
    m = tiny_llama()
    wrap(m)
    torch.manual_seed(0)
    ref = tiny_llama()
    p = prompt()
    gen(m, input_ids=p, **KW)  # stores p's blocks
    stored = hf.stats(m)["hf"]["reuse"]["store"]["blocks"]
    e = _embeds(ref, p, 0.5)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = gen(m, input_ids=p, inputs_embeds=e, **KW)
        gen(m, input_ids=p, inputs_embeds=e, **KW)
    rec = last(m)
    assert rec["hit_tokens"] == 0 and rec["stored_blocks"] == 0 and "inputs_embeds" in rec["skipped"]
    assert hf.stats(m)["hf"]["reuse"]["store"]["blocks"] == stored
    said = [x for x in w if issubclass(x.category, KVReuseWarning) and "inputs_embeds" in str(x.message)]
    assert len(said) == 1  # once per argument
    assert_same_tokens(gen(ref, input_ids=p, inputs_embeds=e, **KW), out, atol=1e-5)
    out = gen(m, inputs_embeds=e, **KW)  # without ids
    assert last(m)["hit_tokens"] == 0 and last(m)["stored_blocks"] == 0
    assert_same_tokens(gen(ref, inputs_embeds=e, **KW), out, atol=1e-5)
    assert hf.stats(m)["hf"]["reuse"]["counters"]["skipped_inputs"] >= 2


def test_position_ids_a_4d_mask_and_cache_position_disable_reuse(fresh_sim):
    torch.manual_seed(0)
    m = tiny_llama()
    wrap(m)
    p = prompt()
    gen(m, input_ids=p, **KW)
    n = p.shape[1]
    four_d = torch.ones(1, 1, n, n).tril()  # a custom (here causal) 4-D mask
    for name, value in {"position_ids": torch.arange(n)[None] + 5, "attention_mask": four_d,
                        "cache_position": torch.arange(n)}.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                gen(m, input_ids=p, **{name: value}, **KW)
            except Exception:  # a transformers version may refuse the argument itself: still no lookup
                pass
        rec = last(m)
        assert rec["hit_tokens"] == 0 and rec["stored_blocks"] == 0 and name in rec["skipped"], name


def test_multimodal_and_token_type_inputs_disable_reuse(fresh_sim):
    from cxlalloc.hf.reuse import _unkeyed_inputs

    ids = prompt()
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": torch.zeros(1, 3, 8, 8),
          "image_grid_thw": [torch.tensor([1, 2, 2])], "token_type_ids": torch.zeros_like(ids), "max_new_tokens": 4,
          "past_key_values": None}
    assert _unkeyed_inputs(kw, "past_key_values") == ["image_grid_thw", "pixel_values", "token_type_ids"]
    torch.manual_seed(0)
    m = tiny_llama()
    wrap(m)
    gen(m, input_ids=ids, **KW)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError):  # a text-only model refuses pixel_values; nothing was looked up first
            gen(m, input_ids=ids, pixel_values=torch.zeros(1, 3, 8, 8), **KW)
    rec = last(m)
    assert rec["hit_tokens"] == 0 and "pixel_values" in rec["skipped"]
