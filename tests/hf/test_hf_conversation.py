"""Sub-block reuse for a conversation: the previous turn's cache continues
the next turn in the same process (cxlalloc.hf.reuse, ``kv_conversation_limit``),
simulation.  The oracle is the unwrapped model recomputing every prompt."""

import pytest

from tests.helpers.hf_util import tiny_gpt2, tiny_llama, torch
from tests.hf.test_hf_reuse import BT, ids, wrap

import cxlalloc.hf as hf


def plain(model, **kw):
    """generate() as a chat loop calls it: the sequences tensor, no cache handed back."""
    torch.manual_seed(0)
    kw.setdefault("pad_token_id", 0)
    with torch.no_grad():
        return model.generate(**kw)


def reuse(model):
    return hf.stats(model)["hf"]["reuse"]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
def test_a_five_turn_chat_hits_the_whole_previous_turn_with_identical_tokens(fresh_sim, make, sample):
    ref, m = make(), make()
    wrap(m)
    kw = dict(max_new_tokens=7, min_new_tokens=7, do_sample=sample)
    turn, prev_held, expected = ids(29, seed=5), 0, 0
    for t in range(5):
        out = plain(m, input_ids=turn, **kw)
        rec = reuse(m)["last"]
        if t:
            # the whole previous turn (prompt + answer but its last token), partial block included
            assert prev_held % BT and rec["conversation"] and rec["hit_tokens"] == prev_held
            expected += prev_held
        else:
            assert rec["hit_tokens"] == 0 and not rec["conversation"]
        assert torch.equal(out, plain(ref, input_ids=turn, **kw)), f"turn {t}: tokens differ from a recompute"
        prev_held = out.shape[1] - 1
        turn = torch.cat([out, ids(5 + t, seed=10 + t)], 1)
    st = reuse(m)
    c = st["counters"]
    assert c["conversation_hits"] == 4 and c["conversation_hit_tokens"] == expected == 35 + 47 + 60 + 74
    assert st["conversation"]["kept"] and st["conversation"]["kept_tokens"] == prev_held
    assert 0 < st["conversation"]["kept_bytes"] <= st["conversation"]["limit_bytes"]
    # the blocks were stored too: another conversation with the same start hits them in the store
    hf.forget_conversation(m)
    assert not reuse(m)["conversation"]["kept"]
    plain(m, input_ids=turn, **kw)
    rec = reuse(m)["last"]
    assert not rec["conversation"] and rec["hit_tokens"] == prev_held // BT * BT


def test_an_edited_history_continues_from_the_shared_tokens_only(fresh_sim):
    ref, m = tiny_llama(), tiny_llama()
    wrap(m)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    out = plain(m, input_ids=ids(27, seed=1), **kw)
    edited = out.clone()
    edited[0, 20] = (edited[0, 20] + 1) % 1000  # the user edits an earlier message
    nxt = torch.cat([edited, ids(4, seed=2)], 1)
    got = plain(m, input_ids=nxt, **kw)
    rec = reuse(m)["last"]
    assert rec["conversation"] and rec["hit_tokens"] == 20
    assert torch.equal(got, plain(ref, input_ids=nxt, **kw))
    # a prompt that is a strict prefix of the kept tokens: everything but its last token is reused
    short = got[:, :30]
    plain(m, input_ids=short, **kw)
    assert reuse(m)["last"]["hit_tokens"] == 29 and reuse(m)["last"]["conversation"]


def test_changed_weights_namespaces_and_handed_back_caches_never_continue(fresh_sim):
    m = tiny_llama()
    wrap(m)
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
    out = plain(m, input_ids=ids(30, seed=3), **kw)
    with torch.no_grad():
        next(m.parameters()).add_(1e-3)  # weights changed in place: the kept cache is stale
    nxt = torch.cat([out, ids(3, seed=4)], 1)
    plain(m, input_ids=nxt, **kw)
    assert reuse(m)["last"]["hit_tokens"] == 0 and reuse(m)["counters"]["conversation_dropped"] == 1
    out = plain(m, input_ids=nxt, **kw)
    plain(m, input_ids=torch.cat([out, ids(3, seed=5)], 1), cache_salt="tenant-b", **kw)
    assert reuse(m)["last"]["hit_tokens"] == 0  # another namespace: neither the conversation nor the store
    # a cache handed back to the caller (return_dict_in_generate) stays the caller's: not kept
    hf.forget_conversation(m)
    with torch.no_grad():
        r = m.generate(input_ids=ids(30, seed=6), return_dict_in_generate=True, pad_token_id=0, **kw)
    assert r.past_key_values is not None and not reuse(m)["conversation"]["kept"]


def test_the_limit_bounds_what_is_kept_and_zero_turns_it_off(fresh_sim):
    m, off = tiny_llama(), tiny_llama()
    wrap(m, kv_conversation_limit="1KiB")
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
    out = plain(m, input_ids=ids(30, seed=3), **kw)
    st = reuse(m)
    assert not st["conversation"]["kept"] and st["counters"]["conversation_too_large"] == 1
    wrap(off, kv_conversation_limit=0)
    out = plain(off, input_ids=ids(30, seed=3), **kw)
    plain(off, input_ids=torch.cat([out, ids(3, seed=4)], 1), **kw)
    rec = reuse(off)["last"]
    assert not rec["conversation"] and rec["hit_tokens"] == 32  # whole blocks from the store only
    with pytest.raises(ValueError, match="kv_conversation_limit"):
        wrap(tiny_llama(), kv_conversation_limit="lots")


def test_a_turn_crossing_a_block_boundary_copies_nothing_from_the_store(fresh_sim):
    """A new turn of more than a block's tokens makes a stored-block lookup worth trying, but the blocks the
    previous turns stored never cover more than the kept conversation: nothing may be copied in from the store
    only to be thrown away (it was, every such turn: a whole-prefix copy a turn, issue 33's chat overhead)."""
    ref, m = tiny_llama(), tiny_llama()
    wrap(m)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    turn = ids(2 * BT + 3, seed=3)
    for t in range(4):
        out = plain(m, input_ids=turn, **kw)
        rec, store = reuse(m)["last"], reuse(m)["store"]
        assert torch.equal(out, plain(ref, input_ids=turn, **kw)), f"turn {t}: tokens differ from a recompute"
        if t:
            assert rec["conversation"] and rec["hit_tokens"] == turn.shape[1] - BT - 2
        assert store["bytes_loaded"] == 0 and store["loads"] == 0, (t, store)
        turn = torch.cat([out, ids(BT + 1, seed=20 + t)], 1)
    assert reuse(m)["counters"]["conversation_hits"] == 3


def test_a_growing_conversation_regrows_its_cache_geometrically_not_every_turn(fresh_sim):
    """Each turn reserves a little more than the last; reserving exactly that re-created the kept cache and
    copied its whole KV on nearly every turn (13 of 20 turns of the kvspeed chat).  Grown x2 in whole rounds,
    8 turns of 40 tokens regrow it at most twice, and the copies stay below two whole conversations."""
    ref = tiny_llama(hidden=256, heads=8, kv_heads=8, layers=16)
    m = tiny_llama(hidden=256, heads=8, kv_heads=8, layers=16)  # 64 KiB of KV a token: 32 tokens a 2 MiB chunk
    wrap(m)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    turn = ids(40, seed=4)
    for t in range(8):
        out = plain(m, input_ids=turn, **kw)
        assert torch.equal(out, plain(ref, input_ids=turn, **kw)), f"turn {t}: tokens differ from a recompute"
        assert t == 0 or reuse(m)["last"]["conversation"]
        turn = torch.cat([out, ids(34, seed=30 + t)], 1)
    st = hf.stats(m)["hf"]["cache"]
    assert st["live_tokens"] == out.shape[1] - 1 == 40 + 7 * 40 + 6 - 1
    assert st["regrowths"] <= 2, st["regrowths"]
    assert st["bytes_copied_existing"] < 2 * st["live_tokens"] * st["bytes_per_token"], st
