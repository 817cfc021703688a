# ruff: noqa
import json, os, sys, itertools
import torch, triton
sys.path.insert(0, '.')
from flashrl_tools.quant.kernels import fp8_decode_attn as f
PAGE, D = 16, 128
def make(qh, kvh, batch, ctx, gen):
    lens = torch.randint(ctx // 2, 3 * ctx // 2 + 1, (batch,), generator=gen, device='cuda', dtype=torch.int32)
    pages = [(int(n) + PAGE - 1) // PAGE for n in lens]; total = sum(pages)
    perm = torch.randperm(total + 1, generator=gen, device='cuda').to(torch.int32)[:total]
    bt = torch.zeros(batch, max(pages), dtype=torch.int32, device='cuda'); off = 0
    for i, p in enumerate(pages): bt[i, :p] = perm[off:off + p]; off += p
    kv = (torch.randn(2, total + 1, PAGE, kvh, D, generator=gen, device='cuda') * 2).to(torch.float8_e4m3fn)
    qs = torch.tensor([0.05], device='cuda')
    q8 = (torch.randn(batch, qh, D, generator=gen, device='cuda') * 2 / qs).to(torch.float8_e4m3fn)
    return dict(lens=lens, bt=bt, k=kv[0], v=kv[1], q8=q8, qs=qs, ks=torch.tensor([0.03], device='cuda'),
                vs=torch.tensor([0.02], device='cuda'), qsl=torch.arange(batch + 1, dtype=torch.int32, device='cuda'),
                kv_bytes=int(lens.sum()) * kvh * 2 * D)
cfgs = [(bn, nw, ns) for bn, nw, ns in itertools.product((32, 64, 128), (1, 2), (2, 3, 4))]
gen = torch.Generator(device='cuda').manual_seed(0); rows = []
for batch in (256, 128, 64, 16):
    b = make(32, 8, batch, 3000, gen); out = torch.empty(batch, 32, D, dtype=torch.bfloat16, device='cuda')
    for bn, nw, ns in [(None, 4, 2)] + cfgs:
        fn = lambda: f.fp8_decode_attention(b['q8'], b['k'], b['v'], out, b['bt'], b['lens'], b['qsl'], D ** -0.5, b['ks'], b['vs'], q_scale=b['qs'], block_n=bn, num_warps=nw, num_stages=ns)
        try:
            fn(); torch.cuda.synchronize(); us = triton.testing.do_bench_cudagraph(fn, rep=30) * 1000
            rows.append(dict(shape='qwen3-8b', batch=batch, block_n=bn, num_warps=nw, num_stages=ns, us=round(us, 2), tb_s=round(b['kv_bytes'] / us / 1e6, 3)))
        except Exception as e:
            rows.append(dict(batch=batch, block_n=bn, num_warps=nw, num_stages=ns, error=str(e)[-200:]))
        print(json.dumps(rows[-1]), flush=True)
        json.dump({'device': torch.cuda.get_device_name(), 'triton': triton.__version__, 'rows': rows}, open(sys.argv[1], 'w'), indent=1)
