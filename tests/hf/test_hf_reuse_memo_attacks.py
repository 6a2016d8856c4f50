"""Attacks on the model fingerprint (weights + module state) that keys KV reuse (trial33).

Each case stores blocks for a prompt in one state, changes something that changes K/V, and checks that the
wrapped model gives the tokens of an unwrapped twin in the same state (a stale fingerprint would serve K/V
computed in the old state: a wrong token).
"""

import copy


from tests.helpers.hf_util import assert_same_tokens, gen, tiny_llama, torch

import cxlalloc.hf as hf

from tests.hf.test_hf_reuse import wrap  # 8-token blocks, in-process store

KW = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)


def prompt(n=41, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (1, n), generator=g)


def hit(model):
    return last(model)["hit_tokens"]


class Knob(torch.nn.Module):
    """A layer-0 input norm whose output is scaled by ``read(self)``: a float computed from whatever attribute
    the case sets up (the reader is a plain function attribute, the same object in every state)."""

    def __init__(self, inner, read):
        super().__init__()
        self.inner = inner
        self.read = read

    def forward(self, x):
        return self.inner(x) * self.read(self)


def with_knob(read, setup):
    torch.manual_seed(0)
    m = tiny_llama()
    layer = m.model.layers[0]
    layer.input_layernorm = Knob(layer.input_layernorm, read)
    setup(layer.input_layernorm)
    return m


def run_case(m, change, conversation=True, opaque=None):
    """Store in state 1, apply ``change`` to the wrapped model and its twin, compare tokens.  Returns the
    hit tokens after the change.  ``opaque``: a part of the reason expected when state the digest cannot
    cover turns reuse off from the start (then no call may hit, before or after the change)."""
    ref = copy.deepcopy(m)
    wrap(m, **({} if conversation else {"kv_conversation_limit": 0}))
    p = prompt()
    gen(m, input_ids=p, **KW)
    gen(m, input_ids=p, **KW)
    if opaque is None:
        assert hit(m) >= 40  # positive control: the unchanged state hits
    else:
        assert hit(m) == 0 and opaque in last(m)["skipped"], last(m)["skipped"]
    before = gen(ref, input_ids=p, **KW)
    change(m)
    change(ref)
    want = gen(ref, input_ids=p, **KW)
    assert not torch.equal(want.scores[0], before.scores[0]), "the change does not change the output: no attack"
    out = gen(m, input_ids=p, **KW)
    h = hit(m)
    assert_same_tokens(want, out, atol=1e-5)
    return h


def last(model):
    return hf.stats(model)["hf"]["reuse"]["last"]
