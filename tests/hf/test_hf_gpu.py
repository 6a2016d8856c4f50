"""cxlalloc.hf on a real GPU (marked ``gpu``; skipped without CUDA).

The CPU tests' properties on CUDA (KV spills oldest-first to the host tier while
weights stay in VRAM, identical tokens, flat per-step copies, C01/C03/C04) plus:
**bit-identical logits** versus an uncapped plain-transformers run, in eager decode
(no torch.compile, no CUDA graphs), for every SDPA backend (flash, mem-efficient,
cuDNN, math) and transformers' eager attention, with the KV cache's oldest chunks on
the host tier (read by the kernels over the link through cxlalloc's mappings).

``CXLALLOC_GPU_RESULTS=DIR`` appends one JSON line per check to
``DIR/hf_gpu.jsonl`` (copied to benchmarks/results/ after a GPU run).
``CXLALLOC_HF_GPU_DRYRUN=1`` runs the same checks on the CPU simulator (math
backend and eager only): a check of the tests' own logic, not of a GPU.
"""

import functools
import json
import os
import time

import pytest
from tests.helpers.hf_util import (MiB, assert_same, gen, kv_bytes_per_token, padded_batch, tiny_gpt2, tiny_gpt_neo,
                                   tiny_llama, torch, weight_footprint)

import cxlalloc.hf as hf
from cxlalloc.hf import returned_cache

DRY = os.environ.get("CXLALLOC_HF_GPU_DRYRUN") == "1"
DEVICE = "cpu" if DRY else "cuda"
CHUNK = 2 * MiB
pytestmark = [] if DRY else [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def _device(request):
    if DRY:
        request.getfixturevalue("fresh_sim")
    else:
        torch.cuda.empty_cache()
    yield
    if not DRY:
        torch.cuda.synchronize()


def record(check, **kw):
    out = os.environ.get("CXLALLOC_GPU_RESULTS")
    kw = {"check": check, **kw}
    if not DRY:
        kw["gpu"] = torch.cuda.get_device_name(0)
    kw["torch"] = torch.__version__
    import transformers

    kw["transformers"] = transformers.__version__
    print(json.dumps(kw, default=str))
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "hf_gpu.jsonl"), "a") as f:
            f.write(json.dumps(kw, default=str) + "\n")


def to_dev(model, dtype):
    return model.to(DEVICE, dtype)


def dev_inputs(d):
    return {k: v.to(DEVICE) for k, v in d.items()}


# The dry run (no GPU) wraps with simulate=True.
wrap = functools.partial(hf.wrap, simulate=True) if DRY else hf.wrap


def sync():
    if not DRY:
        torch.cuda.synchronize()


@pytest.fixture
def deterministic_sdpa():
    """Keep SDPA off cuDNN attention, torch 2.11's default on the H200, which is not
    deterministic run to run (measured: two plain-transformers runs of the same
    greedy generate() differ; scripts/gpu_sdpa_diag.py, benchmarks/results/): an
    identical-token oracle needs a kernel that is."""
    if DRY:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield


# ------------------------------------------------------------------ SDPA backends
def _backends():
    names = ["eager", "MATH"] if DRY else ["eager", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]
    return names


def _dtypes():
    return [torch.float32] if DRY else [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_gpu_logits_bit_identical_per_backend(backend, dtype, padded):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = tiny_llama(hidden=512, heads=8, kv_heads=4, layers=4, head_dim=64, attn="eager" if backend == "eager" else "sdpa")
    m = to_dev(m, dtype)
    inp = dev_inputs(padded_batch(batch=8, length=256, pad=16 if padded else 0))
    if not padded:
        inp.pop("attention_mask")  # no mask at all: the flash backend takes no mask
    kw = dict(max_new_tokens=16, min_new_tokens=16, output_logits=True)
    ctx = (lambda: sdpa_kernel([getattr(SDPBackend, backend)])) if backend != "eager" else None

    def run():
        if ctx is None:
            return gen(m, **inp, **kw)
        with ctx():
            return gen(m, **inp, **kw)

    try:
        ref = run()
        ref2 = run()
    except RuntimeError as e:
        if "No available kernel" in str(e) or "not supported" in str(e).lower():
            record("logits_per_backend", backend=backend, dtype=str(dtype), padded=padded, skipped=str(e)[:200])
            pytest.skip(f"{backend} cannot run this case: {str(e)[:120]}")
        raise
    if not (torch.equal(ref.sequences, ref2.sequences) and all(torch.equal(a, b) for a, b in zip(ref.logits, ref2.logits))):
        d = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref.logits, ref2.logits))
        record("logits_per_backend", backend=backend, dtype=str(dtype), padded=padded, plain_nondeterministic=True,
               plain_vs_plain_max_abs_diff=d)
        pytest.skip(f"{backend} is not deterministic run to run here (two plain runs differ by up to {d}): "
                    "bit-identity against it cannot be tested")
    # Oldest KV on the host tier: 1 chunk of KV allowed in VRAM.
    wrap(m, device_limit=1 << 30, host_limit=1 << 30, kv_device_limit=CHUNK)
    out = run()
    sync()
    st = returned_cache(out).kv_stats()
    same_tokens = bool(torch.equal(ref.sequences, out.sequences))
    diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(ref.logits, out.logits)]
    bit = all(torch.equal(a, b) for a, b in zip(ref.logits, out.logits))
    record("logits_per_backend", backend=backend, dtype=str(dtype), padded=padded, tokens_equal=same_tokens,
           logits_bit_identical=bit, logits_max_abs_diff=max(diffs), kv_host_bytes=st["kv_host_bytes"],
           kv_device_bytes=st["kv_device_bytes"])
    assert st["kv_host_bytes"] > 0 and st["kv_device_bytes"] == CHUNK
    assert same_tokens
    assert bit, f"logits differ by up to {max(diffs)}"


# ------------------------------------------------------------------ placement
def test_gpu_kv_spills_oldest_first_weights_stay(deterministic_sdpa):
    m = to_dev(tiny_llama(hidden=256, heads=8, kv_heads=8, layers=4), torch.bfloat16)
    fp = weight_footprint(m)
    inp = dev_inputs(padded_batch(batch=8, length=400))
    n_new = 200
    per_token = kv_bytes_per_token(m, batch=8) // 2  # bf16
    limit = fp + 3 * CHUNK
    ref = gen(m, **inp, max_new_tokens=n_new, min_new_tokens=n_new)
    wrap(m, device_limit=limit, host_limit=1 << 30)
    t0 = time.perf_counter()
    out = gen(m, **inp, max_new_tokens=n_new, min_new_tokens=n_new)
    sync()
    wall = time.perf_counter() - t0
    assert_same(ref, out)
    c = returned_cache(out)
    st = c.kv_stats()
    s = hf.stats(m)
    store = c._stores()[0]
    a = hf.allocator(m)
    tiers = [t for _, _, t in store.extent.tiers() if t != "none"]
    record("kv_spill_oldest_first", limit=limit, kv_device_bytes=st["kv_device_bytes"],
           kv_host_bytes=st["kv_host_bytes"], weight_host_bytes=s["weight"]["host_bytes"],
           demoted_bytes=s["demoted_bytes"], backend=s["host"].get("backend"), numa_node=s["host"].get("numa_node"),
           step_bytes_copied=sorted(set(st["step_bytes_copied"][1:])), wall_s=wall, tiers=tiers)
    assert st["kv_device_bytes"] == 3 * CHUNK and st["kv_host_bytes"] > 0
    assert tiers == sorted(tiers, key=lambda t: t != "host")
    assert a.tier_of(store.extent.base) == "host"
    assert s["weight"]["host_bytes"] == 0 and s["other"]["peak_host_bytes"] == 0
    assert s["device"]["peak_reserved_bytes"] <= limit
    assert st["step_bytes_copied"][1:] == [per_token] * (n_new - 1)
    # A KV view on the host tier is still a CUDA tensor
    assert c.layers[0].keys.is_cuda or DRY


def test_gpu_c01_sweep_no_oom_identical(deterministic_sdpa):
    m = to_dev(tiny_gpt_neo(attn="eager"), torch.float32)
    fp = weight_footprint(m)
    cap = fp + 3 * CHUNK
    per_token = kv_bytes_per_token(m, batch=2)
    g = torch.Generator().manual_seed(0)
    lengths = list(range(256, 2049, 256))
    prompts = {L: torch.randint(3, 1000, (2, L), generator=g).to(DEVICE) for L in lengths}
    refs = {L: gen(m, input_ids=prompts[L], max_new_tokens=8, min_new_tokens=8).sequences for L in lengths}
    wrap(m, device_limit=cap, host_limit=1 << 30)
    host = {}
    for L in lengths:
        out = gen(m, input_ids=prompts[L], max_new_tokens=8, min_new_tokens=8)
        assert torch.equal(out.sequences, refs[L]), L
        host[L] = returned_cache(out).kv_stats()["kv_host_bytes"]
        chunks = -(-(L + 7) * per_token // CHUNK)
        assert host[L] == max(0, chunks - 3) * CHUNK, L
        del out
    s = hf.stats(m)
    record("c01_sweep", cap=cap, host_bytes_by_length=host, ooms=s["ooms"],
           peak_device=s["device"]["peak_reserved_bytes"])
    assert s["device"]["peak_reserved_bytes"] <= cap and s["ooms"] == 0


@pytest.mark.parametrize("mode", ["sample-nrs32", "beam16"])
def test_gpu_c03_beams_and_return_sequences(mode, deterministic_sdpa):
    m = to_dev(tiny_gpt2(hidden=128), torch.float32)
    fp = weight_footprint(m)
    ids = torch.randint(3, 1000, (1, 350), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    if mode == "sample-nrs32":
        kw, n_seq, n_new = dict(do_sample=True, num_return_sequences=32, max_new_tokens=32, min_new_tokens=32), 32, 32
    else:
        kw, n_seq, n_new = dict(num_beams=16, max_new_tokens=16, min_new_tokens=16, early_stopping=True), 16, 16
    kv_need = (350 + n_new - 1) * kv_bytes_per_token(m, batch=n_seq)
    ref = gen(m, input_ids=ids, seed=5, **kw)
    cap = fp + kv_need // 4
    wrap(m, device_limit=cap, host_limit=1 << 30)
    out = gen(m, input_ids=ids, seed=5, **kw)
    sync()
    st = returned_cache(out).kv_stats()
    record("c03", mode=mode, cap=cap, kv_host_bytes=st["kv_host_bytes"], reorders=st["reorders"],
           identical=bool(torch.equal(ref.sequences, out.sequences)))
    assert_same(ref, out)
    assert st["kv_host_bytes"] > kv_need // 2


def test_gpu_c04_spike_goes_to_host_kv_stays(deterministic_sdpa):
    from transformers import LogitsProcessorList

    from test_hf_tiers import SpikeProcessor  # the same processor as the CPU test

    m = to_dev(tiny_llama(hidden=256, heads=8, kv_heads=8, layers=4), torch.float32)
    fp = weight_footprint(m)
    inp = dev_inputs(padded_batch(batch=8, length=200))
    kv_need = (200 + 16 - 1) * kv_bytes_per_token(m, batch=8)
    limit = fp + (-(-kv_need // CHUNK)) * CHUNK + CHUNK
    ref = gen(m, **inp, max_new_tokens=16, min_new_tokens=16)
    wrap(m, device_limit=limit, host_limit=1 << 30)
    a = hf.allocator(m)
    proc = SpikeProcessor(a, lambda: hf.kv_cache(m), 5 * CHUNK)
    out = gen(m, **inp, max_new_tokens=16, min_new_tokens=16, logits_processor=LogitsProcessorList([proc]))
    sync()
    r = proc.report
    record("c04", spike_tier=r["tier"], spike_bytes=r["nbytes"],
           demoted_during_spike=r["mid"]["demoted_bytes"] - r["before"]["stats"]["demoted_bytes"],
           kv_unchanged=r["after"]["tiers"] == r["before"]["tiers"],
           host_after=r["after"]["stats"]["host"]["allocated_bytes"])
    assert_same(ref, out)
    assert r["tier"] == "host" and r["after"]["tiers"] == r["before"]["tiers"]
    assert r["mid"]["demoted_bytes"] == r["before"]["stats"]["demoted_bytes"]
    assert r["after"]["stats"]["host"]["allocated_bytes"] == 0


def test_gpu_default_device_limit_leaves_room_for_torch():
    if DRY:
        pytest.skip("GPU-only default")
    m = to_dev(tiny_llama(), torch.bfloat16)
    free, total = torch.cuda.mem_get_info()
    hf.wrap(m)
    lim = hf.stats(m)["device"]["limit_bytes"]
    record("default_limit", limit=lim, free_before=free, total=total)
    reserve = max(2 << 30, total // 10)
    assert lim <= free + (64 << 20) - reserve + 1 and lim > 0


# ------------------------------------------------------------------ KV reuse across requests
def test_gpu_prefix_hit_loads_into_vram_with_identical_tokens(deterministic_sdpa):
    """A stored document prefix is loaded from the host arena (registered for the
    GPU, chunk by chunk) into the cache's extent in VRAM, and the tokens equal a
    full recompute; with a device limit below the prefix, the loaded chunks land
    on the host tier instead and the tokens are still equal."""
    g = torch.Generator().manual_seed(7)
    doc = torch.randint(3, 1000, (1, 1600), generator=g)  # 6.25 MiB of bf16 KV: more than a 2 MiB chunk
    q1, q2 = (torch.randint(3, 1000, (1, 9), generator=g) for _ in range(2))
    p1, p2 = (torch.cat([doc, q], 1).to(DEVICE) for q in (q1, q2))
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    for name, limit in (("vram", 64 * MiB), ("host", None)):
        m = to_dev(tiny_llama(hidden=256, heads=8, kv_heads=8, layers=4), torch.bfloat16)
        ref = gen(m, input_ids=p2, **kw)
        fp = weight_footprint(m)
        wrap(m, device_limit=(fp + limit) if limit else fp + CHUNK, host_limit=1 << 30, kv_store=True,
             block_tokens=64, kv_store_limit=64 * MiB)
        gen(m, input_ids=p1, **kw)  # miss: stores the document's blocks
        t0 = time.perf_counter()
        out = gen(m, input_ids=p2, **kw)
        sync()
        wall = time.perf_counter() - t0
        r = hf.stats(m)["hf"]["reuse"]
        last, store = r["last"], r["store"]
        c = returned_cache(out)
        st = c.kv_stats()
        record("reuse_prefix_hit", placement=name, hit_tokens=last["hit_tokens"], bytes_loaded=last["bytes_loaded"],
               load_ms=last["load_ms"], registered_bytes=store["registered_bytes"], node=store["node"],
               kv_device_bytes=st["kv_device_bytes"], kv_host_bytes=st["kv_host_bytes"], wall_s=wall,
               load_gbps=(last["bytes_loaded"] / (last["load_ms"] * 1e-3) / 1e9) if last["load_ms"] else None)
        assert torch.equal(ref.sequences, out.sequences)
        assert last["hit_tokens"] == 1600 and last["fallback"] is None
        assert store["registered_bytes"] > 0 or DRY
        if name == "vram":
            assert st["kv_host_bytes"] == 0 and st["kv_device_bytes"] > 0
        else:
            assert st["kv_host_bytes"] > 0
        hf.unwrap(m)
        del m, ref, out, c


def test_gpu_continuous_batching_past_vram_identical_tokens(deterministic_sdpa):
    """generate_batch of a wrapped model: the paged cache's blocks in VRAM and on
    the host tier (read by attention over the link), preemption into the swap
    pool on the host tier, a second batch loading its documents from the store;
    tokens equal plain transformers' continuous batching per request."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(3, 1000, (512,), generator=g).tolist() for _ in range(3)]
    batches = [[docs[i % 3] + torch.randint(3, 1000, (24 + i,), generator=g).tolist() for i in range(8)]
               for _ in range(2)]
    gc = GenerationConfig(max_new_tokens=48, do_sample=False, eos_token_id=-1, pad_token_id=0)

    def cfg(**kw):
        return ContinuousBatchingConfig(page_size=64, max_batch_tokens=1024, auto_switch_to_flash=False, **kw)

    # float32 and the same cache size and swap pool for both: the same schedule, so a batch composition that
    # differs cannot flip a near-tie token (bf16 does, measured in the dry run)
    plain = to_dev(tiny_llama(hidden=256, heads=8, kv_heads=8, layers=4), torch.float32)
    # (transformers' own swap pool is pinned memory: none on the CPU of the dry run, which resets instead)
    refs = [[o.generated_tokens for o in plain.generate_batch(b, generation_config=gc, continuous_batching_config=cfg(
        num_blocks=30, cpu_offload_space=0.0 if DRY else 0.01)).values()] for b in batches]
    del plain
    m = to_dev(tiny_llama(hidden=256, heads=8, kv_heads=8, layers=4), torch.float32)
    fp = weight_footprint(m)
    wrap(m, device_limit=fp + CHUNK, host_limit=1 << 30, kv_store=True, kv_store_limit=64 * MiB)
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        out = m.generate_batch(b, generation_config=gc, continuous_batching_config=cfg(num_blocks=30,
                                                                                     cpu_offload_space=0.01))
        sync()
        wall = time.perf_counter() - t0
        s = hf.stats(m)["hf"]["continuous_batching"]
        c = s["counters"]
        record("cb_paged_past_vram", batch=i, wall_s=wall, cache=s["cache"], swap_pool=s["swap_pool"], counters=c)
        assert [o.generated_tokens for o in out.values()] == refs[i]
        assert s["tiered"] and s["cache"]["kv_host_bytes"] > 0 and s["cache"]["kv_device_bytes"] > 0
        assert s["swap_pool"]["host_bytes"] == s["swap_pool"]["reserved_bytes"]
    assert c["store_hit_tokens"] >= 3 * 512 and c["reprefills_avoided"] >= 3
    assert c["swapped_requests"] > 0  # 8 requests of ~10 blocks (3 documents shared) past a 30-block cache
    hf.unwrap(m)


# ------------------------------------------------------------------ cache layer kinds
@pytest.mark.parametrize("kind", ["sliding", "encoder-decoder"])
def test_gpu_layer_kinds_spill_with_identical_tokens(kind, deterministic_sdpa):
    """Sliding-window layers (each a bounded extent) and an encoder-decoder cache
    (self- and cross-attention extents) on the device with one KV chunk of VRAM
    beyond the weights: the rest of their KV on the host tier, read by the kernels
    over the link; tokens and scores identical to plain transformers (greedy, beams)."""
    from tests.helpers.hf_kinds import tiny_mistral, tiny_t5

    m = to_dev(tiny_mistral(window=64, layers=2) if kind == "sliding" else tiny_t5(), torch.float32)
    inp = dev_inputs(padded_batch(batch=4, length=160))
    refs = {mode: gen(m, **inp, max_new_tokens=24, min_new_tokens=24, **kw)
            for mode, kw in (("greedy", {}), ("beam", dict(num_beams=2)))}
    limit = weight_footprint(m) + CHUNK
    wrap(m, device_limit=limit, host_limit=1 << 30)
    for mode, kw in (("greedy", {}), ("beam", dict(num_beams=2))):
        out = gen(m, **inp, max_new_tokens=24, min_new_tokens=24, **kw)
        sync()
        assert_same(refs[mode], out)
    s = hf.stats(m)
    layers = s["hf"]["layers"]
    record("layer_kinds_spill", kind=kind, limit=limit, layers=layers, kv_peak_device_bytes=s["kv"]["peak_device_bytes"],
           kv_peak_host_bytes=s["kv"]["peak_host_bytes"], backend=s["host"].get("backend"))
    assert layers["untiered"] == {} and layers["tiered_layers"] == layers["layers"] > 0
    assert s["kv"]["peak_host_bytes"] > 0 and s["kv"]["peak_device_bytes"] > 0
    assert s["device"]["peak_reserved_bytes"] <= limit and s["weight"]["host_bytes"] == 0
