"""The table GEMV's code extraction (kernels/lut.cuh: lut_slot, lut_code, lut_row, lut_col), compiled for
the host with nvcc and checked against quant.pack_codes on fresh random codes: the CPU-side half of the kernel's
correctness (the GPU tests check the rest). Skipped where nvcc is not installed."""
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from localllm.quant import BASE_BITS, pack_codes

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
    out = subprocess.run([str(decoder)], input=f"{bits} {n} {k}\n" + " ".join(map(str, words)),
                         capture_output=True, text=True, check=True).stdout.split()
    assert torch.equal(torch.tensor(list(map(int, out))).view(n, k), codes.long())
