"""torch.compile of a wrapped model's forward: no more compiles than the plain
model's, never dynamo's recompile limit, same tokens.

transformers' module forwards share one decorated code object (its
deprecation wrapper), so a graph break inside the forward makes dynamo compile
them one by one, as recompiles of that one function, and a few decode steps reach
the limit; the wrapped model's cache therefore plans each update before the
forward (its engine calls run in a forward pre-hook) and the traced update is
tensor operations only.  backend="eager": dynamo's guards and recompiles are
the same with inductor, and a CPU test stays fast."""

import pytest

from tests.helpers.hf_util import tiny_llama, torch

import cxlalloc.hf as hf

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402

NEW = 6


def _compiled_generate(model, prompts):
    """Compile ``model.forward`` and run generate() on each prompt; returns the
    tokens and the frames dynamo compiled (first compiles and recompiles)."""
    dynamo.reset()
    counters.clear()
    model.forward = torch.compile(model.forward, backend="eager")
    outs = []
    # A limit below the 8 default so that a few tokens show the failure; the plain
    # model needs 3 compiles of its forward (prefill, decode, decode with a dynamic length).
    with dynamo.config.patch(recompile_limit=4, fail_on_recompile_limit_hit=True):
        for ids in prompts:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0)
            outs.append(out[:, ids.shape[1]:])
    frames = int(counters["frames"]["ok"])
    del model.forward
    dynamo.reset()
    return outs, frames


def test_compiled_wrapped_forward_compiles_no_more_than_plain():
    torch.manual_seed(0)
    prompts = [torch.randint(3, 900, (1, 10)), torch.randint(3, 900, (1, 14))]  # a second prefill length too
    plain_tokens, plain_frames = _compiled_generate(tiny_llama(), prompts)
    model = hf.wrap(tiny_llama(), device_limit="64MiB", host_limit="64MiB")
    tokens, frames = _compiled_generate(model, prompts)
    assert frames <= plain_frames, (frames, plain_frames)
    assert all(torch.equal(a, b) for a, b in zip(tokens, plain_tokens))
    st = hf.stats(model)
    assert st["hf"]["caches_created"] == 2, "generate() used cxlalloc's cache"
    kv = st["hf"]["cache"]
    assert kv["cxl_layers"] == 2 and kv["live_tokens"] == 14 + NEW - 1
    # the planned updates count as before: the prefill, then one token's K/V per step
    assert kv["step_bytes_copied"][1:] == [kv["bytes_per_token"]] * (NEW - 1)


def test_planned_update_matches_the_unplanned_one():
    """The pre-hook path (model(...)) and a direct forward (no hook, no plan)
    give the same logits and the same cache."""
    torch.manual_seed(0)
    ids = torch.randint(3, 900, (2, 7))
    model = hf.wrap(tiny_llama(), device_limit="64MiB", host_limit="64MiB")
    kw = hf.cache_kwarg(model)
    a = hf.CxlCache(config=model.config, allocator=hf.allocator(model))
    b = hf.CxlCache(config=model.config, allocator=hf.allocator(model))
    with torch.no_grad():
        la = model(input_ids=ids, **{kw: a}).logits           # planned by the pre-hook
        lb = model.forward(input_ids=ids, **{kw: b}).logits   # no hook: update() binds and commits itself
        assert torch.equal(la, lb)
        nxt = la[:, -1:].argmax(-1)
        la = model(input_ids=nxt, **{kw: a}).logits
        lb = model.forward(input_ids=nxt, **{kw: b}).logits
    assert torch.equal(la, lb)
    assert a.get_seq_length() == b.get_seq_length() == 8
    for x, y in zip(a.layers, b.layers):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
    sa, sb = a.kv_stats(), b.kv_stats()
    for k in ("bytes_copied", "step_bytes_copied", "step_context_tokens", "live_tokens", "stores", "regrowths"):
        assert sa[k] == sb[k], k
