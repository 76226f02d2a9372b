"""Run one GEMV configuration a few times, for Nsight Compute (ncu) to profile.

usage: python scripts/profile_gemv.py [layer] [bits] [warps,depth,pairs per slot] [blocks per SM] [qdec k_chunk]
       (defaults: gate_up 4, the first variant, 1 block per SM, no QDEC; bits "4t": table weights, 4 bits)
"""
import sys

import torch

from localllm.bench import LLAMA3_8B
from localllm.kernels import qdec
from localllm.kernels.gemv import Packed, PackedLUT, gemv, grid_of
from localllm.quant import QuantLUT, QuantResidual, QuantWeight, pack_codes

layer, bits = (sys.argv[1:2] or ["gate_up"])[0], (sys.argv[2:3] or ["4"])[0]
table, bits = bits.endswith("t"), int(bits.rstrip("t"))
variant = tuple(int(v) for v in sys.argv[3].split(",")) if len(sys.argv) > 3 and sys.argv[3] != "-" else None
bps = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] != "-" else None
k_chunk = int(sys.argv[5]) if len(sys.argv) > 5 else 0
(N, K), gs = LLAMA3_8B[layer], 128
x = torch.randn(K, device="cuda").half()
q = pack_codes(torch.randint(0, 2**bits, (N, K), device="cuda"), bits)
s = torch.rand(N, K // gs, device="cuda").half()
z = torch.randint(0, 2**bits, (N, K // gs), device="cuda", dtype=torch.uint8)
w = PackedLUT.from_quant(QuantLUT(q, torch.randn(N, 2**bits, device="cuda").half(), bits, K)) if table else \
    Packed.from_quant(QuantWeight(q, s, z, bits, gs, K))
comp = None
if k_chunk:
    grid = grid_of(N, x.device)
    r = QuantResidual(torch.randint(-2**31, 2**31 - 1, (K, N // 8), dtype=torch.int32), (torch.rand(N) * 0.01).half())
    a = x.float().abs()
    comp = qdec.Call(qdec.HostResidual.pin(r), qdec.new_state(K, N, "cuda"), qdec.new_part([(K, N)], "cuda"), k_chunk,
                     qdec.default_n_tb(K, N, grid, k_chunk), float(a.max()), float(a[:1024].topk(k_chunk).values[-1]), grid)
for _ in range(3):
    gemv(x, w, variant=variant, blocks_per_sm=bps, comp=comp)
torch.cuda.synchronize()
