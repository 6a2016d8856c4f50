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


# --- transformers' auto-compiled forward (a static cache + compile_config) -------------------------------------
# Modelled on transformers' tests/generation/test_utils.py::test_generate_compile_model_forward_fullgraph: two
# different inputs of the same shape, CompileConfig(fullgraph=True, dynamic=False) forced on the CPU
# (_compile_all_devices), cache_implementation="static"; generate() then runs model.get_compiled_call(), a
# torch.compile of model.__call__ (forward pre-hooks included).  backend="eager" keeps the CPU test fast; dynamo's
# guards (what makes it recompile) do not depend on the backend.

def _tiny_lfm2():
    from transformers import Lfm2Config, Lfm2ForCausalLM
    torch.manual_seed(0)
    return Lfm2ForCausalLM(Lfm2Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False))


def _model_inputs(name):
    g = torch.Generator().manual_seed(1)
    if name == "whisper":
        x = torch.randn(4, 8, 32, generator=g)  # (batch, num_mel_bins, 2 * max_source_positions)
        return [{"input_features": x[:2]}, {"input_features": x[2:]}]
    ids = torch.randint(3, 900, (4, 8), generator=g)
    return [{"input_ids": ids[:2], "attention_mask": torch.ones(2, 8, dtype=torch.long)},
            {"input_ids": ids[2:], "attention_mask": torch.ones(2, 8, dtype=torch.long)}]


def _auto_compiled_generate(model, inputs):
    """generate() with a static cache and a full-graph compile config on each
    input set; returns (tokens per set, dynamo compiles: first compiles and
    recompiles of every frame, counted by dynamo's compile-start callback)."""
    from torch._dynamo.callback import callback_handler
    from transformers import CompileConfig

    starts = []

    def count(args):
        starts.append(args.compile_id)

    cc = CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None)
    cc._compile_all_devices = True  # compile on the CPU too (transformers' test does the same)
    torch.compiler.reset()
    callback_handler.register_start_callback(count)
    try:
        outs = [model.generate(**x, do_sample=False, max_new_tokens=5, use_cache=True, cache_implementation="static",
                               compile_config=cc, pad_token_id=0) for x in inputs]
    finally:
        callback_handler.remove_start_callback(count)
        torch.compiler.reset()
    assert hasattr(model, "_compiled_call"), "generate() did not auto-compile the forward"
    return outs, len(starts)


@pytest.mark.parametrize("name", ["llama", "t5", "whisper", "lfm2"])
def test_auto_compiled_forward_recompiles_no_more_wrapped_than_plain(name):
    """The wrapped model's forward pre-hook is traced with __call__; it must not
    make dynamo guard on a value that changes every step (a forward counter
    did: one recompile per decode step).  Same compiles as plain, same tokens."""
    import warnings

    from tests.helpers.hf_kinds import tiny_t5, tiny_whisper
    make = {"llama": tiny_llama, "t5": tiny_t5, "whisper": tiny_whisper, "lfm2": _tiny_lfm2}[name]
    inputs = _model_inputs(name)
    plain_tokens, plain_compiles = _auto_compiled_generate(make().eval(), inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hf.CacheCoverageWarning)  # a static cache is transformers' (said once)
        model = hf.wrap(make().eval(), device_limit="64MiB", host_limit="64MiB")
        tokens, compiles = _auto_compiled_generate(model, inputs)
    assert plain_compiles >= 1
    assert compiles == plain_compiles, (compiles, plain_compiles)
    assert all(torch.equal(a, b) for a, b in zip(tokens, plain_tokens))
