"""cxlalloc.hf.wrap() on a model whose decoder layers sit on several GPUs (simulation).

The model's layers are mapped onto 2 and 4 simulated GPUs by accelerate's own
``infer_auto_device_map`` (tests/helpers/sim_dispatch.py says exactly what is
simulated: CI's torch has no CUDA, so the parameters stay on the CPU and
``model.hf_device_map`` tells wrap() which simulated GPU holds each layer).  Each
simulated GPU gets its own allocator, device budget and host tier from the
simulated driver; each layer's KV must land in its GPU's allocator, spill to
that GPU's host tier under a budget below the GPU's share, and the tokens must
be the unwrapped model's.
"""

import gc
import warnings

import pytest

from tests.helpers.hf_util import MiB, assert_same, gen, padded_batch, tiny_llama, torch
from tests.helpers.sim_dispatch import dispatch, simulated_gpus

import cxlalloc.hf as hf
from cxlalloc.hf import returned_cache

CHUNK = 2 * MiB
N_NEW = 150
PROMPT = 200
BATCH = 4


def wide_llama(layers=4):
    # 8 heads x 32 dims x K+V x fp32 = 2 KiB per token per layer per sequence
    return tiny_llama(hidden=256, heads=8, kv_heads=8, layers=layers, vocab=256)


def per_gpu_footprint(model) -> dict:
    """{"cuda:i": device bytes reserved by the weights of GPU i}: wrap with a generous budget, measure, unwrap."""
    hf.wrap(model, device_limit=256 * MiB, host_limit=64 * MiB)
    try:
        return {g: int(d["device"]["reserved_bytes"]) for g, d in hf.stats(model)["gpus"].items()}
    finally:
        hf.unwrap(model)
        gc.collect()


def kv_need_per_gpu(model, layer_gpus, tokens, batch) -> dict:
    """KV bytes each GPU's layers hold for ``tokens`` tokens (fp32), in whole chunks."""
    cfg = model.config
    row = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4 * batch
    out = {}
    for g in layer_gpus:
        out[g] = out.get(g, 0) + row * tokens
    return {g: -(-b // CHUNK) * CHUNK for g, b in out.items()}


@pytest.fixture
def two_gpus(fresh_sim):
    with simulated_gpus(2) as sim:
        yield sim


@pytest.fixture
def four_gpus(fresh_sim):
    with simulated_gpus(4) as sim:
        yield sim


def test_layers_on_two_gpus_spill_on_both_gpus_tiers(two_gpus):
    m = wide_llama()
    inp = padded_batch(batch=BATCH, length=PROMPT, vocab=256)
    ref = gen(m, **inp, max_new_tokens=N_NEW, min_new_tokens=N_NEW)
    dm = dispatch(m, 2)
    layer_gpus = [f"cuda:{dm[f'model.layers.{i}']}" for i in range(4)]
    assert sorted(set(layer_gpus)) == ["cuda:0", "cuda:1"], dm
    fp = per_gpu_footprint(m)
    need = kv_need_per_gpu(m, layer_gpus, PROMPT + N_NEW - 1, BATCH)
    assert all(n > CHUNK for n in need.values()), "premise: each GPU's KV is more than the one chunk of VRAM left"
    # Each GPU's budget: its weights + one chunk of KV, below its share of weights + KV.
    limits = [fp["cuda:0"] + CHUNK, fp["cuda:1"] + CHUNK]
    hf.wrap(m, device_limit=limits, host_limit={"cuda:0": 64 * MiB, 1: 64 * MiB}, device_headroom=0)
    out = gen(m, **inp, max_new_tokens=N_NEW, min_new_tokens=N_NEW)
    assert_same(ref, out)  # tokens and scores identical to the unwrapped model
    s = hf.stats(m)
    assert s["hf"]["gpus"] == ["cuda:0", "cuda:1"] and s["hf"]["layer_gpus"] == layer_gpus
    for g in ("cuda:0", "cuda:1"):
        d = s["gpus"][g]
        assert d["device"]["device"] == int(g[-1]) and d["device"]["limit_bytes"] == limits[int(g[-1])]
        # Real bytes per GPU: one chunk of KV in that GPU's VRAM, the rest on that GPU's host tier.
        assert d["kv"]["device_bytes"] == CHUNK, g
        assert d["kv"]["host_bytes"] == need[g] - CHUNK > 0, g
        assert d["weight"]["host_bytes"] == 0 and d["weight"]["device_bytes"] > 0
        assert s["hf"]["weight_bytes_per_gpu"][g] > 0
    # Totals are the sums over GPUs.
    assert s["kv"]["host_bytes"] == sum(need.values()) - 2 * CHUNK
    assert s["device"]["limit_bytes"] == sum(limits) and s["device"]["device"] == [0, 1]
    assert s["hf"]["weight_bytes"] == sum(s["hf"]["weight_bytes_per_gpu"].values())
    c = returned_cache(out)
    st = c.kv_stats()
    assert st["kv_device_bytes"] == 2 * CHUNK and st["kv_host_bytes"] == sum(need.values()) - 2 * CHUNK
    assert st["stores"] == 2 and st["regrowths"] == 0  # one shared extent per GPU
    # Each layer's K/V live in its own GPU's allocator.
    for i, layer in enumerate(c.kv_layers()):
        assert f"cuda:{layer._store.allocator.device}" == layer_gpus[i]
    del out, c
    hf.unwrap(m)


def test_beam_search_deepcopy_and_rewrap_on_two_gpus(two_gpus):
    import copy

    from cxlalloc.hf import cache_kwarg

    m = tiny_llama(layers=4, vocab=256)
    inp = padded_batch(vocab=256)
    beam = dict(num_beams=3, num_return_sequences=2, do_sample=False, max_new_tokens=10, min_new_tokens=10)
    ref_beam = gen(m, **inp, **beam)
    prompt = {k: v[:, :6] for k, v in inp.items()}
    ref_cont = gen(m, **inp, do_sample=False, max_new_tokens=6, min_new_tokens=6)
    dispatch(m, 2)
    hf.wrap(m, device_limit=[32 * MiB, "32MiB"], host_limit="128MiB")
    assert hf.wrap(m, device_limit={0: "32MiB", "cuda:1": 32 * MiB}, host_limit=128 * MiB) is m  # same values
    with pytest.raises(ValueError, match=r"already wrapped.*cuda:1 device_limit: 32\.00 MiB \(wrapped\) vs 16\.00 MiB"):
        hf.wrap(m, device_limit=["32MiB", "16MiB"], host_limit="128MiB")
    out = gen(m, **inp, **beam)  # beam reorders and batch expansion on stores of two GPUs
    assert_same(ref_beam, out)
    assert returned_cache(out).kv_stats()["reorders"] > 0
    # prompt-cache reuse: a deep copy keeps each layer on its GPU's allocator
    pc = returned_cache(gen(m, **prompt, do_sample=False, max_new_tokens=1))
    assert pc.get_seq_length() == 6
    twin = copy.deepcopy(pc)
    on = [layer._store.allocator.device for layer in twin.kv_layers()]
    assert on == [layer._store.allocator.device for layer in pc.kv_layers()] and sorted(set(on)) == [0, 1]
    assert len({id(p) for p in twin._pools}) == 2 and twin.kv_stats()["stores"] == 2
    out2 = gen(m, **inp, do_sample=False, max_new_tokens=6, min_new_tokens=6, **{cache_kwarg(m): twin})
    assert torch.equal(out2.sequences, ref_cont.sequences)
    assert set(hf.allocators(m)) == {"cuda:0", "cuda:1"}
    del out, out2, pc, twin
    hf.unwrap(m)


def test_layers_on_four_gpus_with_options_per_gpu(four_gpus):
    m = wide_llama(layers=8)
    inp = padded_batch(batch=2, length=100, vocab=256)
    ref = gen(m, **inp, max_new_tokens=40, min_new_tokens=40)
    dm = dispatch(m, 4)
    layer_gpus = [dm[f"model.layers.{i}"] for i in range(8)]
    assert sorted(set(layer_gpus)) == [0, 1, 2, 3], dm
    hf.wrap(m, device_limit={0: 32 * MiB, "cuda:1": 32 * MiB, 2: 32 * MiB, 3: 32 * MiB},
            kv_device_limit=[0, 0, 0, 0], host_limit="64MiB")
    out = gen(m, **inp, max_new_tokens=40, min_new_tokens=40)
    assert_same(ref, out)
    s = hf.stats(m)
    for g in range(4):
        d = s["gpus"][f"cuda:{g}"]
        # kv_device_limit=0: every GPU's KV on its own host tier, none in its VRAM.
        assert d["kv"]["host_bytes"] > 0 and d["kv"]["device_bytes"] == 0, g
        assert d["device"]["device"] == g
    assert s["kv"]["host_bytes"] == sum(s["gpus"][f"cuda:{g}"]["kv"]["host_bytes"] for g in range(4))
    del out
    hf.unwrap(m)


def test_per_gpu_options_of_a_bad_shape_are_refused(two_gpus):
    m = wide_llama()
    dispatch(m, 2)
    with pytest.raises(ValueError, match=r"option 'device_limit': a list of 3 value\(s\) for a model on 2 GPU"):
        hf.wrap(m, device_limit=["8MiB"] * 3)
    with pytest.raises(ValueError, match=r"option 'host_limit': key 'cuda:5' is not one of the model's GPUs.*mapping"):
        hf.wrap(m, host_limit={"cuda:5": "8MiB"})
    with pytest.raises(ValueError, match="option 'numa_node': GPU 0 is given twice"):
        hf.wrap(m, numa_node={0: 0, "cuda:0": 0})
    with pytest.raises(ValueError, match="option 'device': the model is spread over GPUs"):
        hf.wrap(m, device=1)
    # A bad value in a list or mapping names the GPU whose value it is, the option and its allowed values.
    with pytest.raises(ValueError, match=r"^cxlalloc.hf.wrap, GPU cuda:1 of the model's \['cuda:0', 'cuda:1'\]: "
                                         r"cxlalloc option 'device_limit': 'lots' is not a size or fraction; use bytes"):
        hf.wrap(m, device_limit=["8MiB", "lots"])
    with pytest.raises(ValueError, match=r"^cxlalloc.hf.wrap, GPU cuda:1 of the model's \['cuda:0', 'cuda:1'\]: "
                                         r"cxlalloc option 'kv_device_limit': 'nonsense' is not a size or fraction"):
        hf.wrap(m, device_limit="64MiB", kv_device_limit={0: "1MiB", "cuda:1": "nonsense"})
    with pytest.raises(ValueError, match=r"^cxlalloc.hf.wrap, GPU cuda:1 of the model's \['cuda:0', 'cuda:1'\]: "
                                         r"numa_node: node 1023 does not exist"):
        hf.wrap(m, numa_node=["auto", 1023])  # the GPU whose value is at fault is named
    m.hf_device_map = dict(m.hf_device_map, lm_head="disk")
    with pytest.raises(ValueError, match="CPU or disk offload"):
        hf.wrap(m)
    m.lm_head.weight = torch.nn.Parameter(torch.empty(m.lm_head.weight.shape, device="meta"))  # offloaded to disk
    with pytest.raises(ValueError, match=r"spread over \['cpu', 'meta'\].*CPU/disk offload"):
        hf.wrap(m)
    assert not hf.is_wrapped(m)


def test_a_device_map_beyond_the_simulated_gpus(fresh_sim):
    import cxlalloc

    m = wide_llama()
    dispatch(m, 2)  # the simulated driver has one GPU (fresh_sim)
    busy = cxlalloc.Allocator(simulate=True, device_limit="8MiB", host_limit="8MiB")
    busy.tensor((1024,), torch.float32)  # something alive: the simulator cannot gain a GPU now
    with pytest.raises(ValueError, match=r"2 simulated GPUs need it to have 2 GPUs \(1 now, .* of VRAM each\).*free the other"):
        hf.wrap(m, device_limit="64MiB", host_limit="64MiB")
    assert not hf.is_wrapped(m)
    del busy
    gc.collect()
    hf.wrap(m, device_limit="64MiB", host_limit="64MiB")  # nothing alive: wrap() gives the simulator 2 GPUs
    assert fresh_sim.device_count() == 2 and hf.stats(m)["hf"]["gpus"] == ["cuda:0", "cuda:1"]
    hf.unwrap(m)
    gc.collect()
    fresh_sim.configure("vram=1GiB")  # back to the one GPU of the other tests
    cxlalloc.engine._sim_vram = 1 << 30


def test_options_per_gpu_on_one_device_as_a_list_of_one(fresh_sim):
    m = tiny_llama()
    m.hf_device_map = {"": "cpu"}  # from_pretrained(device_map="cpu") sets this: a plain CPU model
    inp = padded_batch()
    ref = gen(m, **inp, max_new_tokens=8, min_new_tokens=8)
    hf.wrap(m, device_limit=["64MiB"], host_limit={0: "256MiB"})
    assert hf.wrap(m, device_limit=64 * MiB, host_limit="256MiB") is m  # the same values, spelt as one
    assert_same(ref, gen(m, **inp, max_new_tokens=8, min_new_tokens=8))
    s = hf.stats(m)
    assert s["device"]["limit_bytes"] == 64 * MiB and list(s["gpus"]) == ["cuda:0"]
    assert s["gpus"]["cuda:0"]["device"]["limit_bytes"] == 64 * MiB and s["hf"]["layer_gpus"] is None
    with pytest.raises(ValueError, match="already wrapped"):
        hf.wrap(m, device_limit=["32MiB"])
    hf.unwrap(m)
    # A per-GPU value for a GPU the model does not use is refused, never ignored; a bad one names its GPU.
    with pytest.raises(ValueError, match=r"option 'kv_device_limit': key 1 is not one of the model's GPUs "
                                         r"\['cuda:0'\]; allowed: one value for every GPU"):
        hf.wrap(m, device_limit="64MiB", kv_device_limit={1: "1GiB"})
    with pytest.raises(ValueError, match=r"^cxlalloc.hf.wrap, GPU cuda:0 of the model's \['cuda:0'\]: cxlalloc "
                                         r"option 'host_limit': 'nonsense' is not a size"):
        hf.wrap(m, device_limit="64MiB", host_limit=["nonsense"])
    assert not hf.is_wrapped(m)


CB_PAGE = 16


def cb_prompts(n, base=120, step=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (base + step * i,), generator=g).tolist() for i in range(n)]


def greedy_tokens(model, ps, n):
    """The unwrapped model's greedy generate(), one prompt at a time: the new tokens of each."""
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in ps]


def generate_batch(model, ps, n, **cfg):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg.setdefault("page_size", CB_PAGE)
    cfg.setdefault("max_batch_tokens", 256)
    gcfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)
    out = model.generate_batch(ps, generation_config=gcfg, continuous_batching_config=ContinuousBatchingConfig(**cfg))
    return [o.generated_tokens for o in out.values()]


def test_continuous_batching_on_two_gpus_spills_on_both_gpus_tiers(two_gpus):
    """generate_batch on a model whose layers sit on 2 GPUs: one paged-cache extent per GPU (its layers' pages of
    every block) in that GPU's allocator, spilling to that GPU's host tier; the tokens are the unwrapped model's."""
    from cxlalloc.hf.paged import ContinuousBatchingWarning

    m = wide_llama()
    ps = cb_prompts(4)
    ref = greedy_tokens(m, ps, 8)
    dm = dispatch(m, 2)
    assert [dm[f"model.layers.{i}"] for i in range(4)] == [0, 0, 1, 1], dm
    fp = per_gpu_footprint(m)
    # Each GPU's budget: its weights + one chunk of KV; 96 blocks are 6 MiB of KV per GPU (2 layers x 32 KiB pages)
    hf.wrap(m, device_limit=[fp["cuda:0"] + CHUNK, fp["cuda:1"] + CHUNK], host_limit="64MiB", device_headroom=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ContinuousBatchingWarning)  # tiered on both GPUs: nothing to say
        assert generate_batch(m, ps, 8, num_blocks=96) == ref
    s = hf.stats(m)
    cb = s["hf"]["continuous_batching"]
    assert cb["tiered"] is True and cb["untiered_reason"] is None
    cache, c = cb["cache"], cb["counters"]
    page = 2 * 8 * 32 * 4 * CB_PAGE  # K and V, 8 heads x 32 dims, fp32
    assert cache["block_bytes"] == 4 * page and cache["num_blocks"] == 96
    gpus = cache["gpus"]
    assert sorted(gpus) == ["cuda:0", "cuda:1"]
    for g, layers in (("cuda:0", [0, 1]), ("cuda:1", [2, 3])):
        d = gpus[g]
        assert d["layers"] == layers and d["block_bytes"] == 2 * page
        # Real bytes per GPU and tier: one chunk of that GPU's VRAM, the rest on that GPU's host tier
        assert c["per_gpu"][g] == {"peak_kv_device_bytes": CHUNK, "peak_kv_host_bytes": CHUNK}, (g, c["per_gpu"])
        a = s["gpus"][g]["kv"]
        assert a["peak_device_bytes"] == CHUNK and a["peak_host_bytes"] >= CHUNK, (g, a)
    # Totals are the sums over GPUs
    assert c["peak_kv_device_bytes"] == 2 * CHUNK and c["peak_kv_host_bytes"] == 2 * CHUNK
    assert cache["kv_device_bytes"] == sum(gpus[g]["kv_device_bytes"] for g in gpus)
    assert cache["committed_bytes"] == sum(gpus[g]["committed_bytes"] for g in gpus) == c["peak_committed_bytes"]
    assert c["promoted_bytes"] > 0 and c["placement_failures"] == 0
    hf.unwrap(m)


def test_continuous_batching_on_four_gpus_keeps_each_gpus_kv_on_its_host_tier(four_gpus):
    m = wide_llama(layers=8)
    ps = cb_prompts(3, base=100, step=7, seed=1)
    ref = greedy_tokens(m, ps, 6)
    dm = dispatch(m, 4)
    layers = {g: [i for i in range(8) if dm[f"model.layers.{i}"] == g] for g in range(4)}
    assert all(layers.values()), dm
    fp = per_gpu_footprint(m)
    # Each GPU's budget: its weights alone, so every GPU's paged cache is on its own host tier
    hf.wrap(m, device_limit={g: fp[f"cuda:{g}"] for g in range(4)}, host_limit="64MiB", device_headroom=0)
    assert generate_batch(m, ps, 6, num_blocks=64) == ref
    s = hf.stats(m)
    cb = s["hf"]["continuous_batching"]
    per = cb["counters"]["per_gpu"]
    assert sorted(per) == [f"cuda:{g}" for g in range(4)]
    for g in range(4):
        committed = cb["cache"]["gpus"][f"cuda:{g}"]["committed_bytes"]  # all of it on that GPU's host tier
        assert per[f"cuda:{g}"] == {"peak_kv_device_bytes": 0, "peak_kv_host_bytes": committed}, per
        assert committed >= CHUNK and s["gpus"][f"cuda:{g}"]["kv"]["peak_host_bytes"] >= committed
        assert s["gpus"][f"cuda:{g}"]["kv"]["peak_device_bytes"] == 0
        assert cb["cache"]["gpus"][f"cuda:{g}"]["layers"] == layers[g]
        assert cb["cache"]["gpus"][f"cuda:{g}"]["block_bytes"] == len(layers[g]) * 2 * 8 * 32 * 4 * CB_PAGE
    assert cb["counters"]["peak_kv_host_bytes"] == cb["cache"]["committed_bytes"]
    assert cb["counters"]["peak_kv_device_bytes"] == 0
    hf.unwrap(m)


def test_paged_rows_split_over_gpus_match_the_full_layout():
    """gpu_parts on its own: a full-layout paged tensor (3 layers, pages of K then V rows) split over 2 GPUs
    with non-contiguous layers ([0, 2] and [1]): every layer's row w of the full layout's shifted views is row
    local_rows(w) of its GPU's; whole blocks read and written through StripedBlocks are the full layout's bytes."""
    from cxlalloc.hf.paged.gpu_parts import GpuPart, StripedBlocks, local_pages, local_rows

    L, P, H, D, blocks = 3, 4, 2, 3, 6
    R = 2 * L * P  # rows per block
    full = torch.randn(blocks * R, H, D)
    page_bytes = 2 * P * H * D * 4
    parts = []
    for g, layers in ((0, [0, 2]), (1, [1])):
        rows = torch.cat([full.view(blocks, L, 2 * P, H, D)[:, i] for i in layers], dim=1).reshape(-1, H, D)
        t = rows.contiguous().view(-1).view(torch.uint8)
        parts.append(GpuPart(gpu=g, allocator=None, layers=layers, bytes_per_sector=0, block_bytes=len(layers) *
                             page_bytes, rows_per_block=2 * len(layers) * P, tensor=t,
                             copy_view=t.view(-1, len(layers) * page_bytes)))
    w = torch.tensor([0, 1, P - 1, R, R + 2, 3 * R + P - 1, 5 * R])
    for part in parts:
        flat = part.tensor.view(torch.float32).view(-1, H, D)
        local = local_rows(w, R, part.rows_per_block)
        for j, layer in enumerate(part.layers):
            for shift in (2 * P * layer, 2 * P * layer + P):  # the layer's K view, then its V view
                local_shift = shift - 2 * P * layer + 2 * P * j
                assert torch.equal(flat[local_shift + local], full[shift + w]), (part.gpu, layer, shift)
    assert local_pages(torch.tensor([-1, 0, 2 * L, 5 * 2 * L]), 2 * L, 2).tolist() == [-1, 0, 2, 10]
    sb = StripedBlocks(parts, L, page_bytes, "cpu")
    ids = torch.tensor([4, 1])
    got = sb.index_select(0, ids)
    want = full.view(blocks, -1)[ids].contiguous().view(torch.uint8).view(2, -1)
    assert torch.equal(got, want)
    sb.index_copy_(0, torch.tensor([0, 5]), got)  # blocks 4 and 1 copied into blocks 0 and 5
    assert torch.equal(sb.index_select(0, torch.tensor([0, 5])), want)
    assert torch.equal(sb.index_select(0, torch.tensor([2, 3])),
                       full.view(blocks, -1)[2:4].contiguous().view(torch.uint8).view(2, -1))  # the others untouched


def test_continuous_batching_on_two_gpus_preempts_into_the_swap_pool(two_gpus):
    """A cache too small for every request on a model split over 2 GPUs: requests are preempted into the swap pool
    (whole blocks gathered from both GPUs' extents) and restored (scattered back); tokens unchanged."""
    m = wide_llama()
    ps = cb_prompts(3, base=60, step=5, seed=2)
    ref = greedy_tokens(m, ps, 60)
    dispatch(m, 2)
    hf.wrap(m, device_limit=["64MiB", "64MiB"], host_limit="64MiB")
    assert generate_batch(m, ps, 60, num_blocks=16, cpu_offload_space=4 * MiB / (1 << 30)) == ref
    cb = hf.stats(m)["hf"]["continuous_batching"]
    c = cb["counters"]
    assert cb["swap_pool"]["enabled"] and cb["swap_pool"]["bytes"] == 4 * MiB
    assert c["preemptions"] > 0 and c["swapped_requests"] == c["preemptions"] and c["reprefilled_requests"] == 0, c
    hf.unwrap(m)


def test_continuous_batching_of_a_spread_sliding_window_model_says_once_it_is_not_tiered(two_gpus):
    from tests.helpers.hf_util import tiny_qwen2_sliding

    from cxlalloc.hf.paged import ContinuousBatchingWarning

    m = tiny_qwen2_sliding()
    dispatch(m, 2)
    hf.wrap(m, device_limit="64MiB", host_limit="64MiB")
    ps = [[5, 6, 7, 8], [9, 10, 11]]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(2):
            generate_batch(m, ps, 4, num_blocks=16)
    said = [x for x in w if issubclass(x.category, ContinuousBatchingWarning)]
    assert len(said) == 1 and "spread over GPUs ['cuda:0', 'cuda:1']" in str(said[0].message)
    cb = hf.stats(m)["hf"]["continuous_batching"]
    assert cb["tiered"] is False and "full-attention models only" in cb["untiered_reason"]
    assert "sliding_attention" in cb["untiered_reason"]
    hf.unwrap(m)


def test_store_blocks_are_keyed_independently_of_the_device_map(two_gpus, tmp_path):
    """A prefix stored by a model on 2 GPUs is hit by the same weights on 1 GPU, and the reverse,
    through one kv-server pool (what two processes share)."""
    import os
    import shutil
    import tempfile

    from cxlalloc.kvstore.server import KVServer

    d = tempfile.mkdtemp(prefix="kvmg-", dir="/tmp")
    server = KVServer(32 * MiB, 0, os.path.join(d, "kv.sock"), chunk_bytes=4 * MiB).start()
    try:
        url = "unix://" + server.socket_path
        kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
        g = torch.Generator().manual_seed(3)
        first, second = (torch.randint(3, 256, (1, 49), generator=g) for _ in range(2))  # 3 blocks + 1
        plain = wide_llama()
        refs = [gen(plain, input_ids=p, **kw).sequences for p in (first, second)]
        two, one = wide_llama(), wide_llama()  # the same weights (seeded)
        dispatch(two, 2)
        opts = dict(host_limit="64MiB", kv_store=url, block_tokens=16)
        hf.wrap(two, device_limit=["64MiB", "64MiB"], **opts)
        hf.wrap(one, device_limit="64MiB", **opts)
        assert hf.stats(two)["hf"]["layer_gpus"] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]

        def run(model, prompt, ref):
            out = gen(model, input_ids=prompt, **kw)
            assert torch.equal(out.sequences, ref)
            return hf.stats(model)["hf"]["reuse"]["last"]["hit_tokens"]

        assert run(two, first, refs[0]) == 0  # stored by the 2-GPU model
        assert run(one, first, refs[0]) == 48  # hit by the 1-GPU model: 3 blocks of 16
        assert run(one, second, refs[1]) == 0  # stored by the 1-GPU model
        assert run(two, second, refs[1]) == 48  # hit by the 2-GPU model, loaded into both GPUs' layers
        s = hf.stats(two)
        assert all(s["gpus"][gpu]["kv"]["peak_device_bytes"] > 0 for gpu in ("cuda:0", "cuda:1"))
        hf.unwrap(two)
        hf.unwrap(one)
    finally:
        server.stop(0.5)
        shutil.rmtree(d, ignore_errors=True)


def test_continuous_batching_store_blocks_cross_from_two_gpus_to_one_and_back(two_gpus, tmp_path):
    """A prefix stored by generate_batch on a model split over 2 GPUs is hit by generate_batch on a 1-GPU wrap of
    the same weights (a kv-server pool: what two processes share), and the reverse: the stored blocks are in the
    full layout's bytes whatever the device map (each GPU's pages gathered on store, scattered on load)."""
    import os
    import shutil
    import tempfile

    from cxlalloc.kvstore.server import KVServer

    d = tempfile.mkdtemp(prefix="kvcb-", dir="/tmp")
    server = KVServer(32 * MiB, 0, os.path.join(d, "kv.sock"), chunk_bytes=4 * MiB).start()
    try:
        url = "unix://" + server.socket_path
        g = torch.Generator().manual_seed(5)
        first, second = ([torch.randint(3, 256, (49,), generator=g).tolist()] for _ in range(2))  # 3 blocks + 1
        plain = wide_llama()
        refs = [greedy_tokens(plain, p, 5) for p in (first, second)]
        two, one = wide_llama(), wide_llama()  # the same weights (seeded)
        dispatch(two, 2)
        hf.wrap(two, device_limit=["64MiB", "64MiB"], host_limit="64MiB", kv_store=url)
        hf.wrap(one, device_limit="64MiB", host_limit="64MiB", kv_store=url)

        def run(model, ps, ref):
            assert generate_batch(model, ps, 5, num_blocks=16) == ref
            return hf.stats(model)["hf"]["continuous_batching"]["counters"]

        assert run(two, first, refs[0])["stored_blocks"] == 3  # stored by the 2-GPU model
        c = run(one, first, refs[0])
        assert c["store_hit_tokens"] == 48 and c["store_hit_blocks"] == 3  # hit by the 1-GPU model
        assert run(one, second, refs[1])["stored_blocks"] >= 3  # stored by the 1-GPU model
        c = run(two, second, refs[1])
        assert c["store_hit_tokens"] == 48 and c["reprefills_avoided"] == 1  # loaded into both GPUs' extents
        assert hf.stats(two)["hf"]["continuous_batching"]["cache"]["gpus"]["cuda:1"]["layers"] == [2, 3]
        hf.unwrap(two)
        hf.unwrap(one)
    finally:
        server.stop(0.5)
        shutil.rmtree(d, ignore_errors=True)


def test_the_docs_simulated_several_gpus_example_runs():
    """docs/huggingface.md "A model on several GPUs": its second block (simulated GPUs) run as written, in a
    fresh process (it configures the simulated driver); the first block needs GPUs and is marked so."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "huggingface.md").read_text(encoding="utf-8")
    section = text[text.index('<a id="several-gpus"></a>'):text.index("### What `hf.wrap` does")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2 and "device_map=\"auto\"" in blocks[0]
    assert "Needs several GPUs (**not yet run on several GPUs**" in section
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p),
               CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    env.pop("CXLALLOC", None)
    r = subprocess.run([sys.executable, "-c", blocks[1]], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    layer_gpus, weights = last.split("] ", 1)
    assert layer_gpus + "]" == "['cuda:0', 'cuda:1']"
    assert re.fullmatch(r"\{'cuda:0': [1-9]\d*, 'cuda:1': [1-9]\d*\}", weights), last


def test_a_tensor_parallel_model_says_once_its_weight_shards_are_not_placed(fresh_sim):
    """transformers' tensor-parallel plan marks the model with ``_tp_size`` (> 1 once sharded); CI has no
    torch.distributed run, so the mark stands in for it here: the weights (DTensor shards under TP) are left where
    they are, said once, and KV is still tiered with the tokens unchanged."""
    m = tiny_llama()
    inp = padded_batch()
    ref = gen(m, **inp, max_new_tokens=6, min_new_tokens=6)
    m._tp_size = 2
    with pytest.raises(ValueError, match="tensor-parallel plan.*place_weights=True cannot apply"):
        hf.wrap(m, place_weights=True, device_limit="64MiB")
    with pytest.warns(hf.TensorParallelWarning, match=r"tp_size=2.*DTensor shards") as w:
        hf.wrap(m, device_limit="64MiB", host_limit="64MiB")
    assert len(w) == 1
    out = gen(m, **inp, max_new_tokens=6, min_new_tokens=6)
    assert_same(ref, out)
    s = hf.stats(m)
    assert s["hf"]["weights_placed"] is False and s["weight"]["device_bytes"] == 0
    assert returned_cache(out).kv_stats()["kv_device_bytes"] > 0
    del out
    hf.unwrap(m)
