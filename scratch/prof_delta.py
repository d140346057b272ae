import sys, time, torch
from miles_hpc.sync import delta_kernels as K
from miles_hpc.sync.delta_codec import encode, decode, to_bytes, warm_kernels
n = int(float(sys.argv[1])) if len(sys.argv) > 1 else 500_000_000
g = torch.Generator(device="cuda").manual_seed(0)
w = torch.randn(n, device="cuda", generator=g) * torch.exp(torch.randn(n, device="cuda", generator=g) * 0.5) * 0.02
step = 1e-6 * torch.randn(n, device="cuda", generator=g).sign()
old, new = w.bfloat16(), (w + step).bfloat16()
del w, step
for nw in (4, 8):
    K.NUM_WARPS = nw
    warm_kernels("cuda", max_classes=16)
    for mc in (16, 8):
        p = encode(old, new, max_classes=mc); decode(old, p); torch.cuda.synchronize()
        te, td = [], []
        for _ in range(3):
            t0 = time.perf_counter(); p = encode(old, new, max_classes=mc); torch.cuda.synchronize(); te.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); out = decode(old, p); torch.cuda.synchronize(); td.append(time.perf_counter() - t0)
        gb = n * 2 / 1e9
        print({"num_warps": nw, "max_classes": mc, "classes": p.counts[0], "ratio": len(to_bytes(p)) / (n * 2), "enc_s": min(te), "dec_s": min(td),
               "enc_gbps": gb / min(te), "dec_gbps": gb / min(td), "both_gbps": gb / (min(te) + min(td))}, flush=True)
K.NUM_WARPS = 4
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    p = encode(old, new); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
