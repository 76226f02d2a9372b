// Where the codes of the mma-v3 layout (quant.pack_codes) sit, element by element: for the table (non-uniform) path
// of gemv.cu, which looks every code up, and for the host harness of tests/test_lut_decode.py. Host and device code.
#pragma once

// Where quant._SLOT puts register j of mma tile m: 32 * word + bit position of half 0 (half 1 is 16 bits higher),
// or -1 for the 3-bit register spread over bit 15 of words 0, 1, 2 (code bit b in word b).
__host__ __device__ constexpr int lut_slot(int bits, int m, int j) {
    return bits == 4   ? 32 * m + 4 * j
           : bits == 3 ? (m == 0   ? (j == 0 ? 0 : j == 1 ? 32 : j == 2 ? 9 : 41)
                          : m == 1 ? (j == 0 ? 64 : j == 1 ? 3 : j == 2 ? 73 : 12)
                          : m == 2 ? (j == 0 ? 35 : j == 1 ? 67 : j == 2 ? 44 : 76)
                                   : (j == 0 ? 6 : j == 1 ? 70 : j == 2 ? 38 : -1))
           : (m < 3 ? 2 * m + (j == 0 ? 0 : j == 1 ? 32 : j == 2 ? 10 : 42)
                    : (j == 0 ? 6 : j == 1 ? 8 : j == 2 ? 38 : 40));
}

// The code of element (register j, half h) of mma tile m in a lane's BITS words (m, j, h are unrolled constants).
template <int BITS>
__host__ __device__ __forceinline__ uint32_t lut_code(const uint32_t (&w)[BITS], int m, int j, int h) {
    const int s = lut_slot(BITS, m, j);
    if (s < 0) {
        const int p = 15 + 16 * h;
        return ((w[0] >> p) & 1u) | (((w[1 % BITS] >> p) & 1u) << 1) | (((w[2 % BITS] >> p) & 1u) << 2);
    }
    return (w[s >> 5] >> ((s & 31) + 16 * h)) & ((1u << BITS) - 1u);
}

// Row within the tile and column within the step of element (register j, half h) of mma tile m held by lane
// 4g + t: the mma.m16n8k16 A fragment, the order quant.pack_codes stores the codes in.
__host__ __device__ constexpr int lut_row(int g, int j) { return g + 8 * (j & 1); }
__host__ __device__ constexpr int lut_col(int t, int m, int j, int h) { return 16 * m + 2 * t + h + 8 * (j >> 1); }
