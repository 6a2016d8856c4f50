"""GPU diagnosis: which SDPA backend torch's default dispatch picks for plain
transformers (contiguous K/V) versus cxlalloc.hf (token-major strided K/V views),
and whether each backend is deterministic run to run.  Writes JSON lines to
$OUT/sdpa_diag.jsonl (or stdout).  Usage: python scripts/gpu_sdpa_diag.py"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tests.helpers.hf_util import gen, padded_batch, tiny_llama  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cxlalloc.hf as hf  # noqa: E402
from cxlalloc.hf import returned_cache  # noqa: E402

OUT = os.environ.get("OUT")
NAMES = {int(b): n for n, b in SDPBackend.__members__.items()}
DEV = os.environ.get("DIAG_DEVICE", "cuda")
SMALL = DEV == "cpu"  # a dry run of this script on the simulator


def emit(**kw):
    line = json.dumps(kw, default=str)
    print(line, flush=True)
    if OUT:
        with open(os.path.join(OUT, "sdpa_diag.jsonl"), "a") as f:
            f.write(line + "\n")


class Spy:
    def __init__(self):
        self.choices = {}
        self.orig = F.scaled_dot_product_attention

    def __enter__(self):
        def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kw):
            try:
                c = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
                name = NAMES.get(int(c), str(c))
            except Exception as e:  # noqa: BLE001
                name = f"?{type(e).__name__}"
            key = ("prefill" if q.shape[-2] > 1 else "decode", name, tuple(k.stride()) == tuple(k.contiguous().stride()))
            self.choices[str(key)] = self.choices.get(str(key), 0) + 1
            return self.orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                             enable_gqa=enable_gqa, **kw)
        F.scaled_dot_product_attention = sdpa
        torch.nn.functional.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *a):
        F.scaled_dot_product_attention = self.orig


def case(name, make, dtype, inp, n_new, backends):
    m = make().to(DEV, dtype)
    inp = {k: v.to(DEV) for k, v in inp.items()}
    kw = dict(max_new_tokens=n_new, min_new_tokens=n_new, output_logits=True)
    runs = {}
    for label in ["default"] + backends:
        ctx = sdpa_kernel([getattr(SDPBackend, label)]) if label != "default" else None
        for rep in range(2):
            with Spy() as spy:
                try:
                    if ctx:
                        with sdpa_kernel([getattr(SDPBackend, label)]):
                            o = gen(m, **inp, **kw)
                    else:
                        o = gen(m, **inp, **kw)
                except RuntimeError as e:
                    runs[(label, "plain", rep)] = None
                    emit(case=name, backend=label, run="plain", error=str(e)[:100])
                    break
            runs[(label, "plain", rep)] = (o.sequences, o.logits, spy.choices)
    fp = 64 << 20
    hf.wrap(m, device_limit=(sum(p.numel() * p.element_size() for p in m.parameters()) + fp), host_limit=1 << 30,
            kv_device_limit=2 << 20, **({"simulate": True} if SMALL else {}))
    for label in ["default"] + backends:
        if runs.get((label, "plain", 0)) is None:
            continue
        for rep in range(2):
            with Spy() as spy:
                if label != "default":
                    with sdpa_kernel([getattr(SDPBackend, label)]):
                        o = gen(m, **inp, **kw)
                else:
                    o = gen(m, **inp, **kw)
            runs[(label, "cxl", rep)] = (o.sequences, o.logits, spy.choices)
            kvh = returned_cache(o).kv_stats()["kv_host_bytes"]
        p0, p1, c0, c1 = (runs[(label, r, i)] for r in ("plain", "cxl") for i in (0, 1))

        def same(a, b):
            return bool(torch.equal(a[0], b[0])), max(float((x.float() - y.float()).abs().max()) for x, y in zip(a[1], b[1]))
        emit(case=name, backend=label, kv_host_bytes=kvh, plain_vs_plain=same(p0, p1), cxl_vs_cxl=same(c0, c1),
             plain_vs_cxl=same(p0, c0), plain_choice=p0[2], cxl_choice=c0[2])
    hf.unwrap(m)


BK = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]
if SMALL:
    BK = ["MATH"]
emit(torch=torch.__version__, gpu=None if SMALL else torch.cuda.get_device_name(0),
     cudnn=torch.backends.cudnn.version())
case("wide-mha-d32-bf16-padded", lambda: tiny_llama(hidden=256, heads=8, kv_heads=8, layers=4),
     torch.float32 if SMALL else torch.bfloat16, padded_batch(batch=8, length=400), 20 if SMALL else 200, BK)
u = padded_batch(batch=8, length=256, pad=0)
u.pop("attention_mask")
case("gqa-d64-fp16-unpadded", lambda: tiny_llama(hidden=512, heads=8, kv_heads=4, layers=4, head_dim=64),
     torch.float32 if SMALL else torch.float16, u, 16, ["MATH"] if SMALL else ["CUDNN_ATTENTION"])
