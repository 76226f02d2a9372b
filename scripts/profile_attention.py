"""Run the decode attention of one Llama-3-8B-shaped layer at a long context a few times, for Nsight Compute (ncu).

usage: python scripts/profile_attention.py [kv bits] [context] [splits]   (defaults: 4 32768, the launcher's splits)
"""
import sys

import torch

from localllm import kvquant
from localllm.kernels import attention

bits, ctx = int((sys.argv[1:2] or [4])[0]), int((sys.argv[2:3] or [32768])[0])
splits = int(sys.argv[3]) if len(sys.argv) > 3 else None
heads, kv_heads, D = 32, 8, 128
k, v = (torch.randn(kv_heads, ctx, D, device="cuda") for _ in range(2))
if bits == 16:
    (kc, ksz), (vc, vsz) = (k.half(), None), (v.half(), None)
else:
    (kc, ksz), (vc, vsz) = kvquant.quantize(k, bits), kvquant.quantize(v, bits)
qkv = torch.randn((heads + 2 * kv_heads) * D, device="cuda").half()
inv_freq = torch.rand(D // 2, device="cuda") / ctx
pos = torch.tensor([ctx - 1], device="cuda")
for _ in range(3):
    attention.attend(qkv, inv_freq, kc, vc, pos, heads, kv_heads, D ** -0.5, ksz, vsz, splits=splits)
torch.cuda.synchronize()
