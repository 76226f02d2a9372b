"""Run one GEMV configuration a few times, for Nsight Compute (ncu) to profile.

usage: python scripts/profile_gemv.py [layer] [bits] [warps,depth] [blocks per SM]   (defaults: gate_up 4)
"""
import sys

import torch

from localllm.bench import LLAMA3_8B
from localllm.kernels.gemv import Packed, gemv
from localllm.quant import QuantWeight, pack_codes

layer, bits = (sys.argv[1:2] or ["gate_up"])[0], int((sys.argv[2:3] or [4])[0])
variant = tuple(int(v) for v in sys.argv[3].split(",")) if len(sys.argv) > 3 else None
bps = int(sys.argv[4]) if len(sys.argv) > 4 else None
(N, K), gs = LLAMA3_8B[layer], 128
x = torch.randn(K, device="cuda").half()
q = pack_codes(torch.randint(0, 2**bits, (N, K), device="cuda"), bits)
s = torch.rand(N, K // gs, device="cuda").half()
z = torch.randint(0, 2**bits, (N, K // gs), device="cuda", dtype=torch.uint8)
w = Packed.from_quant(QuantWeight(q, s, z, bits, gs, K))
for _ in range(3):
    gemv(x, w, variant=variant, blocks_per_sm=bps)
torch.cuda.synchronize()
