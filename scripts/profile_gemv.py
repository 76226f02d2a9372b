"""Run the GEMV kernels once per bit width on the 8B gate_up shape, for Nsight Compute (ncu) to profile."""
import torch

from localllm.kernels.gemv import gemv
from localllm.quant import pack_codes

N, K, gs = 28672, 4096, 128
x = torch.randn(K, device="cuda").half()
for bits in (4, 3):
    q = pack_codes(torch.randint(0, 2**bits, (N, K), device="cuda"), bits)
    s = torch.rand(N, K // gs, device="cuda").half()
    z = torch.randint(0, 2**bits, (N, K // gs), device="cuda", dtype=torch.uint8)
    for _ in range(2):
        gemv(x, q, s, z, bits, gs)
torch.cuda.synchronize()
