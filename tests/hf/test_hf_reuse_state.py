"""KV reuse never serves K/V computed under other module state (simulation; real peft).

Issue 29, item 1: the weights digest and the token ids are not all that enters K/V.  A multi-adapter PEFT
model picks its active adapter by attribute (``set_adapter``, ``disable_adapter()``), a module attribute
such as a norm's ``variance_epsilon`` enters the forward, and a forward hook can change any output.  Each
case below stores blocks in one state, changes the state, and checks: no hit (store and last-conversation
cache), tokens equal to an unwrapped twin in the same state, and hits again in the first state.
"""

import copy
import warnings

import pytest

from tests.helpers.hf_util import assert_same_tokens, gen, tiny_llama, torch

import cxlalloc.hf as hf
from cxlalloc.hf.forward_state import StateMemo, forward_state, state_digest
from cxlalloc.hf.reuse import KVReuseWarning

from tests.hf.test_hf_reuse import wrap  # the same wrap() options (8-token blocks)

import peft  # noqa: E402  (the test extra and scripts/bootstrap.sh install it: never skipped)

KW = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)


def prompt(n=41, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (1, n), generator=g)


def reuse(model):
    r = hf.stats(model)["hf"]["reuse"]
    return r["last"], r["counters"]


def two_adapters():
    """A tiny Llama with two LoRA adapters on q/k/v (random B, so each changes K/V); 'a' active."""
    torch.manual_seed(0)
    base = tiny_llama()
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    m = peft.get_peft_model(base, peft.LoraConfig(**cfg), adapter_name="a")
    torch.manual_seed(2)
    m.add_adapter("b", peft.LoraConfig(**cfg))
    m.set_adapter("a")
    return m.eval()


@pytest.mark.parametrize("conversation", [True, False], ids=["conversation-cache", "block-store"])
def test_peft_set_adapter_and_disable_adapter_never_hit_blocks_of_another_adapter(fresh_sim, conversation):
    m = two_adapters()
    ref = copy.deepcopy(m)  # never wrapped: the truth in each state
    wrap(m, **({} if conversation else {"kv_conversation_limit": 0}))
    p = prompt()
    gen(m, input_ids=p, **KW)
    gen(m, input_ids=p, **KW)
    assert reuse(m)[0]["hit_tokens"] >= 40  # positive control: the same adapter hits

    m.set_adapter("b")
    ref.set_adapter("b")
    out = gen(m, input_ids=p, **KW)
    assert reuse(m)[0]["hit_tokens"] == 0, "a hit on blocks computed under adapter 'a'"
    assert_same_tokens(gen(ref, input_ids=p, **KW), out, atol=1e-5)

    with m.disable_adapter(), ref.disable_adapter():
        out = gen(m, input_ids=p, **KW)
        assert reuse(m)[0]["hit_tokens"] == 0, "a hit on blocks computed with an adapter enabled"
        assert_same_tokens(gen(ref, input_ids=p, **KW), out, atol=1e-5)

    m.set_adapter("a")
    ref.set_adapter("a")
    out = gen(m, input_ids=p, **KW)
    assert reuse(m)[0]["hit_tokens"] >= 40  # adapter a's own blocks are still served
    assert_same_tokens(gen(ref, input_ids=p, **KW), out, atol=1e-5)


def test_a_module_attribute_that_enters_the_forward_is_in_the_key(fresh_sim):
    torch.manual_seed(0)
    m = tiny_llama()
    ref = copy.deepcopy(m)
    wrap(m)
    p = prompt()
    gen(m, input_ids=p, **KW)
    gen(m, input_ids=p, **KW)
    assert reuse(m)[0]["hit_tokens"] == 40
    for model in (m, ref):
        model.model.layers[0].input_layernorm.variance_epsilon = 0.5
    out = gen(m, input_ids=p, **KW)
    assert reuse(m)[0]["hit_tokens"] == 0
    assert_same_tokens(gen(ref, input_ids=p, **KW), out, atol=1e-5)
    out = gen(m, input_ids=p, **KW)  # the new state's own blocks hit
    assert reuse(m)[0]["hit_tokens"] == 40
    assert_same_tokens(gen(ref, input_ids=p, **KW), out, atol=1e-5)


def test_a_forward_hook_turns_reuse_off_said_once_and_tokens_follow_the_hook(fresh_sim):
    torch.manual_seed(0)
    m = tiny_llama()
    ref = copy.deepcopy(m)
    wrap(m)
    p = prompt()
    gen(m, input_ids=p, **KW)

    def steer(module, args, output):  # activation steering: shifts the attention output
        return (output[0] + 0.5,) + tuple(output[1:])

    handles = [model.model.layers[0].self_attn.register_forward_hook(steer) for model in (m, ref)]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = gen(m, input_ids=p, **KW)
        gen(m, input_ids=p, **KW)
    said = [x for x in w if issubclass(x.category, KVReuseWarning) and "forward hooks" in str(x.message)]
    assert len(said) == 1 and "steer" in str(said[0].message)
    last, counters = reuse(m)
    assert last["hit_tokens"] == 0 and counters["skipped_state"] == 2
    assert "forward hooks" in last["skipped"]
    assert_same_tokens(gen(ref, input_ids=p, **KW), out, atol=1e-5)
    for h in handles:
        h.remove()
    gen(m, input_ids=p, **KW)
    assert reuse(m)[0]["hit_tokens"] == 40  # without the hook, the hook-free blocks serve again


def test_the_state_digest_is_stable_across_calls_and_sees_training_mode(fresh_sim):
    torch.manual_seed(0)
    m = tiny_llama().eval()
    d0 = state_digest(m)
    gen(m, input_ids=prompt(), **KW)
    assert state_digest(m) == d0  # generate() leaves no state behind that would defeat every hit
    m.train()
    assert state_digest(m) != d0  # dropout on: other K/V
    m.eval()
    assert forward_state(m) == (d0, None)


def test_the_memo_gives_the_plain_digest_under_every_kind_of_change(fresh_sim):
    """StateMemo (the per-call path) reuses a module's encoding only while its state is the very same objects:
    after each change below its digest equals state_digest's, which itself changed; and while nothing
    changes it encodes only the modules holding containers (the model's own dicts and sets)."""
    torch.manual_seed(0)
    m = tiny_llama().eval()
    memo = StateMemo()

    def check():
        d = state_digest(m)
        assert forward_state(m, memo) == (d, None)
        return d

    d = check()
    assert check() == d
    base = memo.encoded  # the modules holding a container (the model's own dicts and sets), encoded every time
    assert base <= 2 < len(list(m.named_modules()))
    attn, norm = m.model.layers[0].self_attn, m.model.layers[1].input_layernorm
    seen = {d}

    def changed():
        d = check()
        assert d not in seen  # every change below is a change of K/V's inputs
        seen.add(d)

    norm.variance_epsilon = norm.variance_epsilon * 2   # a float replaced
    changed()
    attn.scaling = True                                 # 1.0-like value of another type: bool, not float
    changed()
    attn.scaling = 1                                    # an int equal to True: another encoding again
    changed()
    attn.extra_list = [1, 2]                            # a new attribute, a container
    changed()
    attn.extra_list.append(3)                           # changed in place: same object, same module dict
    changed()
    attn.extra_list[0] = 7
    changed()
    norm.tbl = torch.zeros(3)                           # a small plain tensor
    changed()
    norm.tbl[1] = 5.0                                   # written in place
    changed()
    del attn.extra_list                                 # an attribute removed
    changed()
    m.model.layers[1].mlp.act_fn = torch.nn.GELU()      # a module replaced by one of another class
    changed()
    m.model.layers[1].mlp.__class__ = type("OtherMLP", (type(m.model.layers[1].mlp),), {})  # re-classed
    changed()
    m.model.layers[0].train()                           # training mode of part of the model
    changed()
    m.model.layers[0].eval()
    assert check() in seen
    assert check() == check() and memo.encoded == base + 1  # nothing changed: the container holders (+ norm.tbl)


def test_reuse_off_warnings_point_at_the_line_calling_generate(fresh_sim):
    """The hook and the undigestable-state warnings name the user's generate() line (fixed stacklevels named
    ``sys`` and transformers' utils.py: the frames between differ by path)."""
    torch.manual_seed(0)
    m = tiny_llama()
    wrap(m)
    p = prompt()
    said = []
    handle = m.model.layers[0].register_forward_hook(lambda mod, args, out: out)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m.generate(input_ids=p, **KW)
    said += w
    handle.remove()
    m.model.layers[1].self_attn.helper_table = [[[[1.0]]]]  # nested 4 deep: state no digest covers
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m.generate(input_ids=p, **KW)
    said += w
    said = [x for x in said if issubclass(x.category, KVReuseWarning)]
    assert [("forward hooks" in str(x.message), "nested" in str(x.message)) for x in said] == [(True, False),
                                                                                              (False, True)]
    assert [x.filename for x in said] == [__file__] * 2, [(x.filename, x.lineno) for x in said]
