"""The 32 layer applications of one B = 8 decode step replayed alone (issue 34, 2026-12-04): the model's modules
against the same ops called directly from a plain loop (raw), and variants putting back one wrapper at a time,
alternating 150 times (per-iteration median ratios).  Ouro only (PeriNormBlock).
    PYTHONPATH=.:docs/performance/ouro-vllm python docs/performance/ouro-vllm/layer_replay.py"""
# floor of a decode step's 32 layer applications: raw ops only, vs the model's block calls
import time, torch, dasspec, sys
sys.path.insert(0, "docs/performance/ouro-vllm")
from decoding import decoding_engine
from dasspec.model.families import ouro as O
from dasspec.model import attention as A, decode_kernel as DK, linear as LI
import torch.nn.functional as F
torch.set_num_threads(2)
model = dasspec.load_model("/tmp/ouro-mid", dtype=torch.float32)
eng = decoding_engine(model, 8)
for _ in range(3): eng.step()
cap = []
real = O.PeriNormBlock.forward
def f(self, x, span, kv):
    cap.append((self, x.clone(), span, kv))
    return real(self, x, span, kv)
O.PeriNormBlock.forward = f
eng.step()
O.PeriNormBlock.forward = real
print(len(cap))
lin = torch.ops.mkldnn._linear_pointwise.default
def prep(blk, span, kv):
    M.append(blk)
    a = blk.attn
    kvs = kv.parts
    rows, starts, lengths = A.row_lists(kvs, span.parts, span._rows_cache)
    pr = span.pool_rows(kvs)
    return (blk.norm_1.weight, blk.norm_2.weight, blk.norm_3.weight, blk.norm_4.weight, LI._PACKS.get(a.Wqkv.weight),
            LI._PACKS.get(a.proj.weight), LI._PACKS.get(blk.mlp.fc.weight), LI._PACKS.get(blk.mlp.proj.weight),
            kvs[0].k_own, kvs[0].v_own, rows, starts, lengths, pr, span.rot)
M = []
P = [prep(b, s, k) for b, x, s, k in cap]
x0 = cap[0][1]
def raw():
    x = x0[0]
    for (n1, n2, n3, n4, wqkv, wo, wfc, wp, K, V, rows, starts, lengths, pr, rot) in P:
        h = DK.rms_norm(x, n1, 1e-6)
        qkv = lin(h, wqkv, None, "none", [], "").view(1, 8, 24, 64)
        qk = DK.rope_half(qkv[:, :, :16], rot[0], rot[1])
        DK.store_rows(K, V, pr, qk[0, :, 8:].transpose(0, 1), qkv[0, :, 16:].transpose(0, 1))
        y = DK.rows_attention(qk[0, :, :8], K, V, rows, starts, lengths, 0.125)
        o = lin(y.reshape(8, 512), wo, None, "none", [], "")
        x = x + DK.rms_norm(o, n2, 1e-6)
        g = lin(DK.rms_norm(x, n3, 1e-6), wfc, None, "none", [], "")
        m = lin(F.silu(g[:, :1408]) * g[:, 1408:], wp, None, "none", [], "")
        x = x + DK.rms_norm(m, n4, 1e-6)
    return x
def model_path():
    x = x0
    for b, _, s, k in cap:
        x = b(x, s, k)
    return x
def tm(fn, n=30):
    for _ in range(3): fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[n // 2] * 1e3
with torch.inference_mode():
    pass

def raw_mod():
    x = x0[0]
    for blk, (n1, n2, n3, n4, wqkv, wo, wfc, wp, K, V, rows, starts, lengths, pr, rot) in zip(M, P):
        a = blk.attn
        h = DK.rms_norm(x, n1, 1e-6)
        qkv = a.Wqkv(h).view(1, 8, 24, 64)
        qk = DK.rope_half(qkv[:, :, :16], rot[0], rot[1])
        DK.store_rows(K, V, pr, qk[0, :, 8:].transpose(0, 1), qkv[0, :, 16:].transpose(0, 1))
        y = DK.rows_attention(qk[0, :, :8], K, V, rows, starts, lengths, 0.125)
        o = a.proj(y.reshape(8, 512))
        x = x + DK.rms_norm(o, n2, 1e-6)
        g = blk.mlp.fc(DK.rms_norm(x, n3, 1e-6))
        m = blk.mlp.proj(F.silu(g[:, :1408]) * g[:, 1408:])
        x = x + DK.rms_norm(m, n4, 1e-6)
    return x
with torch.inference_mode():
    for r in range(4):
        print("raw %.1f raw_mod %.1f model %.1f" % (tm(raw), tm(raw_mod), tm(model_path)))

def raw_pfl():
    x = x0[0]
    pfl = LI.packed_float32_linear
    for blk, (n1, n2, n3, n4, wqkv, wo, wfc, wp, K, V, rows, starts, lengths, pr, rot) in zip(M, P):
        h = DK.rms_norm(x, n1, 1e-6)
        qkv = pfl(h, wqkv, None, 1536).view(1, 8, 24, 64)
        qk = DK.rope_half(qkv[:, :, :16], rot[0], rot[1])
        DK.store_rows(K, V, pr, qk[0, :, 8:].transpose(0, 1), qkv[0, :, 16:].transpose(0, 1))
        y = DK.rows_attention(qk[0, :, :8], K, V, rows, starts, lengths, 0.125)
        o = pfl(y.reshape(8, 512), wo, None, 512)
        x = x + DK.rms_norm(o, n2, 1e-6)
        g = pfl(DK.rms_norm(x, n3, 1e-6), wfc, None, 2816)
        m = pfl(F.silu(g[:, :1408]) * g[:, 1408:], wp, None, 512)
        x = x + DK.rms_norm(m, n4, 1e-6)
    return x
def raw_lin():
    x = x0[0]
    lf = LI.linear
    for blk, (n1, n2, n3, n4, wqkv, wo, wfc, wp, K, V, rows, starts, lengths, pr, rot) in zip(M, P):
        a = blk.attn
        h = DK.rms_norm(x, n1, 1e-6)
        qkv = lf(h, a.Wqkv.weight).view(1, 8, 24, 64)
        qk = DK.rope_half(qkv[:, :, :16], rot[0], rot[1])
        DK.store_rows(K, V, pr, qk[0, :, 8:].transpose(0, 1), qkv[0, :, 16:].transpose(0, 1))
        y = DK.rows_attention(qk[0, :, :8], K, V, rows, starts, lengths, 0.125)
        o = lf(y.reshape(8, 512), a.proj.weight)
        x = x + DK.rms_norm(o, n2, 1e-6)
        g = lf(DK.rms_norm(x, n3, 1e-6), blk.mlp.fc.weight)
        m = lf(F.silu(g[:, :1408]) * g[:, 1408:], blk.mlp.proj.weight)
        x = x + DK.rms_norm(m, n4, 1e-6)
    return x

def raw_get():
    x = x0[0]
    pfl = LI.packed_float32_linear
    G = LI._PACKS.get
    for blk, (n1, n2, n3, n4, wqkv, wo, wfc, wp, K, V, rows, starts, lengths, pr, rot) in zip(M, P):
        a = blk.attn
        h = DK.rms_norm(x, n1, 1e-6)
        qkv = pfl(h, G(a.Wqkv.weight), None, 1536).view(1, 8, 24, 64)
        qk = DK.rope_half(qkv[:, :, :16], rot[0], rot[1])
        DK.store_rows(K, V, pr, qk[0, :, 8:].transpose(0, 1), qkv[0, :, 16:].transpose(0, 1))
        y = DK.rows_attention(qk[0, :, :8], K, V, rows, starts, lengths, 0.125)
        o = pfl(y.reshape(8, 512), G(a.proj.weight), None, 512)
        x = x + DK.rms_norm(o, n2, 1e-6)
        g = pfl(DK.rms_norm(x, n3, 1e-6), G(blk.mlp.fc.weight), None, 2816)
        m = pfl(F.silu(g[:, :1408]) * g[:, 1408:], G(blk.mlp.proj.weight), None, 512)
        x = x + DK.rms_norm(m, n4, 1e-6)
    return x
import statistics
with torch.inference_mode():
    fns = {"raw": raw, "raw_pfl": raw_pfl, "raw_get": raw_get, "raw_lin": raw_lin, "raw_mod": raw_mod, "model": model_path}
    ts = {k: [] for k in fns}
    for i in range(150):
        for k, f in fns.items():
            t = time.perf_counter(); f(); ts[k].append(time.perf_counter() - t)
    for k in fns:
        print(k, "median %.2f ms" % (statistics.median(ts[k]) * 1e3), "ratio to model per iter %.3f" % statistics.median([a / b for a, b in zip(ts[k], ts["model"])]))
