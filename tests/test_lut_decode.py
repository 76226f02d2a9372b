"""The GEMV's code extraction and lookups (kernels/lut.cuh, codes.cuh), compiled for the host with nvcc and checked on
fresh random codes and tables: lut_code against quant.pack_codes, the uniform operands of Packed's layout, and the
byte-permute lookups (lut_fragments) on PackedLUT's load-time layout against QuantLUT.grid: the CPU-side half of the
kernel's correctness (the GPU tests check the rest). Skipped where nvcc is not installed."""
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from localllm.kernels.gemv import Packed, PackedLUT, lane_rows, lut_pairs, lut_record_bytes
from localllm.quant import BASE_BITS, QuantLUT, QuantWeight, pack_codes
from localllm.squeezellm import quantize_lut

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


@pytest.mark.parametrize("mode, bits", [(2, 2), (2, 3), (2, 4), (3, 3), (3, 4)])
def test_uniform_operands_of_the_gpu_layout(decoder, mode, bits):
    """What the uniform GEMV multiplies (codes.cuh), from the words Packed puts on the GPU (3 bits: laid out again,
    bytes3_layout): decode's half2s (mode 2) and the int8 path's bytes (mode 3) hold every code times its factor and
    nothing else."""
    n, k = 32, 192
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
    q = QuantWeight(pack_codes(codes, bits), torch.ones(n, k // 64).half(), torch.zeros(n, k // 64, dtype=torch.uint8),
                    bits, 64, k)
    p = Packed.from_quant(q, "cpu")
    assert p.qweight.shape == q.qweight.shape and (bits == 3) != torch.equal(p.qweight, q.qweight)
    words = (p.qweight.flatten().long() & 0xFFFFFFFF).tolist()
    out = subprocess.run([str(decoder)], input=f"{mode} {bits} {n} {k}\n" + " ".join(map(str, words)),
                         capture_output=True, text=True, check=True).stdout.split()
    assert torch.equal(torch.tensor(list(map(int, out))).view(n, k), codes.long())


def test_packed_lays_3_bit_codes_out_a_tile_at_a_time():
    """Packed.from_quant re-lays 3-bit codes in chunks of tiles: every tile, at a chunk's edges too, is what
    bytes3_layout makes of that tile alone, and the QuantWeight's own codes are left as they were."""
    from localllm.kernels.gemv import bytes3_layout
    from localllm.quant import unpack_codes
    n, k = 16 * 70, 4096  # 64 tiles a chunk at K = 4096: two chunks, the second partial
    q = QuantWeight(pack_codes(torch.randint(0, 8, (n, k), dtype=torch.uint8), 3), torch.ones(n, k // 128).half(),
                    torch.zeros(n, k // 128, dtype=torch.uint8), 3, 128, k)
    before = q.qweight.clone()
    p = Packed.from_quant(q, "cpu")
    assert torch.equal(q.qweight, before)
    for t in (0, 1, 63, 64, 65, 69):
        assert torch.equal(p.qweight[t:t + 1], bytes3_layout(unpack_codes(q.qweight[t:t + 1], 3))), t


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


def test_4_bit_tables_go_in_pairs_of_slots_whose_xor_looks_an_entry_up():
    """lut_pairs, emulated as gemv.cu runs it: slot c of 0-7 with the code c, of 8-15 with c ^ 8, the picked byte's sign
    replicated where the nibble's bit 3 is set, the two XORed: every code gives its entry back."""
    v = torch.randint(0, 256, (64, 16), dtype=torch.uint8)
    v[:, 0] = torch.where((v < 128).sum(1) % 2 == 1, v[:, 0] ^ 0x80, v[:, 0])  # an even number below 128 per row
    v[0] = 200  # one row all above, one all below
    v[1] = 5
    table, place = lut_pairs(v)
    assert torch.equal(place.sort(1).values, torch.arange(16).expand(64, 16))
    t = table.long()
    sign = lambda b: torch.where(b >= 128, 255, 0)  # noqa: E731
    for c in range(16):
        p = place[:, c]
        lo = torch.where(p < 8, t.gather(1, (p % 8)[:, None])[:, 0], sign(t.gather(1, (p % 8)[:, None])[:, 0]))
        hi = torch.where(p >= 8, t.gather(1, (8 + p % 8)[:, None])[:, 0], sign(t.gather(1, (8 + p % 8)[:, None])[:, 0]))
        assert torch.equal(lo ^ hi, v[:, c].long())
    with pytest.raises(ValueError, match="even number"):
        lut_pairs(torch.tensor([[1] + [200] * 15], dtype=torch.uint8))


@pytest.mark.parametrize("bits", BASE_BITS)
def test_packed_lut_record_of_a_tile(bits):
    """What gemv.cu's table path reads per 16-row tile (lut_tables, the epilogue, dequant_lut): the rows' byte tables
    in row order, then their fp32 scales and offsets in the order 0, 8, 1, 9, ..., 7, 15 (a lane's rows g, g + 8)."""
    n, k, e = 48, 128, 2**bits
    lut = torch.randn(n, e).half()
    q = QuantLUT(pack_codes(torch.randint(0, e, (n, k), dtype=torch.uint8), bits), lut, bits, k)
    rec = PackedLUT.from_quant(q, "cpu").lut
    v, scale, offset = q.grid()
    assert rec.dtype == torch.uint8 and rec.shape == (n // 16, lut_record_bytes(bits))
    assert torch.equal(rec[:, :16 * e].reshape(n, e), lut_pairs(v)[0] if bits == 4 else v)
    lanes = lane_rows("cpu")
    assert lanes.tolist() == [r for g in range(8) for r in (g, g + 8)]
    for i, want in enumerate((scale, offset)):
        got = rec[:, 16 * e + 64 * i:16 * e + 64 * (i + 1)].contiguous().view(torch.float32)
        assert torch.equal(got, want.view(n // 16, 16)[:, lanes])
    # grouped tables: then per group, the rows' fp16 group scales and offsets, rows in the same order
    k = 320  # groups of 128, 128, 64
    w = torch.randn(n, k) * torch.rand(k)
    g = quantize_lut(w, bits, group_size=128)
    grec = PackedLUT.from_quant(g, "cpu").lut
    base = lut_record_bytes(bits)
    assert grec.shape == (n // 16, base + 3 * 64)
    for j in range(3):
        for i, want in enumerate((g.scales, g.offsets)):
            got = grec[:, base + 64 * j + 32 * i:base + 64 * j + 32 * (i + 1)].contiguous().view(torch.float16)
            assert torch.equal(got, want[:, j].reshape(n // 16, 16)[:, lanes])
