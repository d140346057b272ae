import sys, torch, numpy as np
sys.path.insert(0, "tests")
from test_delta_codec import adam_like
from miles_hpc.sync import delta_codec as dc, delta_kernels as K
spec = dc._SPECS["bfloat16"]
for n in (2047, 100003):
    old, new = adam_like(n, torch.bfloat16, seed=n)
    for dev in ("cpu", "cuda"):
        ob, nb = dc._flat_bits(old.to(dev), spec), dc._flat_bits(new.to(dev), spec)
        e = dc._exponents(ob, spec)
        print(dev, "bincount sum", int(torch.bincount(e, minlength=256).sum()), torch.bincount(e, minlength=256).nonzero().flatten()[:5].tolist())
    ob, nb = dc._flat_bits(old.cuda(), spec), dc._flat_bits(new.cuda(), spec)
    lows = [110, 115, 118, 120]
    lows_t = torch.tensor(lows, dtype=torch.int32, device="cuda")
    cnt = K.block_counts(ob, nb, lows_t, spec.exp_shift, spec.n_exp)
    e = dc._exponents(ob, spec).long()
    cls = sum((e >= l).long() for l in lows)
    chg = ob != nb
    print("counts all", cnt[:, :5].sum(0).tolist(), torch.bincount(cls, minlength=5).tolist())
    print("counts chg", cnt[:, 5:].sum(0).tolist(), torch.bincount(cls[chg], minlength=5).tolist())
    ranks, d, k_c = K.class_ranks(ob, nb, lows_t, 16, 7, 256)
    ref_r, ref_d = [], []
    dd = dc._keys(nb, spec) - dc._keys(ob, spec)
    for c in range(5):
        m = cls == c
        r = torch.cumsum(m.long(), 0) - 1
        ref_r.append(r[m & chg]); ref_d.append(dd[m & chg])
    ref_r, ref_d = torch.cat(ref_r), torch.cat(ref_d)
    print("ranks equal", torch.equal(ranks, ref_r), "d equal", torch.equal(d, ref_d), ranks[:10].tolist(), ref_r[:10].tolist(), d[:5].tolist(), ref_d[:5].tolist())
    n_c, bc_ = K.class_sizes(ob, lows_t, 7, 256)
    dense = torch.zeros(n, dtype=torch.int32, device="cuda")
    st = torch.cumsum(torch.bincount(cls, minlength=5), 0) - torch.bincount(cls, minlength=5)
    idx = torch.cat([st[c] + ref_r[(torch.bincount(cls[chg], minlength=5).cumsum(0) - torch.bincount(cls[chg], minlength=5))[c]:][: int((cls[chg]==c).sum())] for c in range(5)])
    dense[idx] = ref_d.int()
    out, bad = K.apply_dense(ob, lows_t, bc_, dense, 16, 7, 256)
    print("apply equal", torch.equal(out, nb), bad)
    p_gpu, p_cpu = dc.encode(old.cuda(), new.cuda()), dc.encode(old, new)
    print("counts gpu", p_gpu.counts[:12]); print("counts cpu", p_cpu.counts[:12])
