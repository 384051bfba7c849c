"""Throwaway probe (not committed): pack forward+backward time, eager vs torch.compile."""
import sys, time, torch
sys.path.insert(0, ".")
from benchmarks.convergence_model import GPT, pack_loss
from benchmarks.bench_convergence import SIZES
torch._dynamo.config.cache_size_limit = 64
dev = "cuda"
def flops(cfg, k):
    m = GPT(cfg["hidden"], cfg["layers"], cfg["heads"], cfg["ffn"], cfg["seq"])
    n = sum(p.numel() for p in m.parameters()) - m.embed.numel()
    tok = cfg["batch"] * cfg["seq"] * k
    return tok * (6 * n + 6 * cfg["layers"] * cfg["seq"] * cfg["hidden"])
for size, k in [(a, int(b)) for a, b in (x.split(":") for x in sys.argv[1:])]:
    cfg = SIZES[size]
    for compiled in (False, True):
        torch.manual_seed(0)
        ms = [GPT(cfg["hidden"], cfg["layers"], cfg["heads"], cfg["ffn"], cfg["seq"]).to(dev) for _ in range(k)]
        idx = torch.randint(0, 256, (k, cfg["batch"], cfg["seq"]), device=dev)
        t0 = time.perf_counter(); times = []
        for i in range(25):
            torch.cuda.synchronize(); t = time.perf_counter()
            pack_loss(ms, idx, idx, True, compiled).sum().backward()
            for m in ms: m.zero_grad(set_to_none=True)
            torch.cuda.synchronize(); times.append(time.perf_counter() - t)
        med = sorted(times[5:])[len(times[5:]) // 2]
        print(f"{size} K={k} compiled={compiled}: first {times[0]:.1f} s, median {med*1e3:.1f} ms/step, "
              f"{flops(cfg, k)/med/1e12:.0f} TFLOP/s, {torch.cuda.max_memory_allocated()/2**30:.0f} GiB", flush=True)
        del ms; torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
