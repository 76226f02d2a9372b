"""The table GEMV's code extraction and lookups (kernels/lut.cuh), compiled for the host with nvcc and checked on
fresh random codes and tables: lut_code against quant.pack_codes, and the byte-permute lookups
(lut_fragments) on PackedLUT's load-time layout against QuantLUT.grid: the CPU-side half of the kernel's
correctness (the GPU tests check the rest). Skipped where nvcc is not installed."""
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from localllm.kernels.gemv import PackedLUT, lut_record_bytes
from localllm.quant import BASE_BITS, QuantLUT, pack_codes

HERE = Path(__file__).parent
KERNELS = HERE.parent / "kernels"


@pytest.fixture(scope="module")
def decoder(tmp_path_factory) -> Path:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    exe = tmp_path_factory.mktemp("lut") / "decode_host"
    r = subprocess.run([nvcc, "-std=c++17", f"-I{KERNELS}", "-arch=sm_89", str(HERE / "lut_decode_host.cu"), "-o",
                        str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return exe


@pytest.mark.parametrize("bits", BASE_BITS)
def test_kernel_decodes_the_packed_layout(decoder, bits):
    n, k = 32, 192
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
    words = (pack_codes(codes, bits).flatten().long() & 0xFFFFFFFF).tolist()
    out = subprocess.run([str(decoder)], input=f"0 {bits} {n} {k}\n" + " ".join(map(str, words)),
                         capture_output=True, text=True, check=True).stdout.split()
    assert torch.equal(torch.tensor(list(map(int, out))).view(n, k), codes.long())


@pytest.mark.parametrize("bits", BASE_BITS)
def test_byte_permute_lookups_of_the_select_layout(decoder, bits):
    n, k = 48, 256
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
    q = QuantLUT(pack_codes(codes, bits), torch.randn(n, 2**bits).half(), bits, k)
    p = PackedLUT.from_quant(q, "cpu")
    assert p.qweight.shape == q.qweight.shape and p.lut.shape == (n // 16, lut_record_bytes(bits))
    words = (p.qweight.flatten().long() & 0xFFFFFFFF).tolist()
    out = subprocess.run([str(decoder)], input=f"1 {bits} {n} {k}\n" + " ".join(map(str, words)) + "\n" +
                         " ".join(map(str, p.lut.flatten().tolist())), capture_output=True, text=True,
                         check=True).stdout.split()
    v = q.grid()[0].long().gather(1, codes.long())
    assert torch.equal(torch.tensor(list(map(int, out))).view(n, k), 0x6400 + v)  # fp16 1024 + v
