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

// The layout kernels/gemv.py's PackedLUT builds at load time: a lane's four codes of one row and mma tile m, elements
// (r, h 0), (r, h 1), (r + 2, h 0), (r + 2, h 1) of row g + 8 r, are the four nibbles of one byte-permute selector, and
// each row's table is its entries' 8-bit grid values v, a byte each (quant.QuantLUT.grid). One permute picks four
// entries' bytes (8 entries in two registers) and two more pair them with 0x64 into the A fragment's half2s of
// 1024 + v; the epilogue applies the row's scale and offset. Where the codes sit (both row halves of tile m from one
// shift and mask, lut_selectors; the selector for r = 0 in bits 0-15, r = 1 in bits 16-31):
// - 2 and 3 bits: the low two bits of the codes of (m, r) in word m / 2 at bits 16 r + 4 p + 2 (m % 2) + {0, 1}; the
//   third bit (3 bits) in word 2 at bit 16 r + 4 p + m.
// - 4 bits: the whole code in word m at bits 16 r + 4 p, already placed by kernels.gemv.lut_pairs: a row's entries sit
//   in 8 pairs of slots (i, i + 8) of the same sign bit, slot i + 8 of a pair at or above 128 complemented. A permute
//   sees 8 slots: the nibble looks slot c up among 0-7 and the nibble c ^ 8 among 8-15; for c < 8 the second picks
//   slot c + 8 with bit 3 set, i.e. its sign bit replicated (0x00: a low pair's, or a high pair's complemented byte),
//   for c >= 8 the first replicates slot c - 8's (0x00 low, 0xFF high, undoing the complement), so the XOR of the
//   two is the entry: 4 permutes and an XOR per four weights (5 permutes when a third one chose between the two
//   picks; a 7-bit grid, all sign bits 0, would do with an OR but cost the demo model 1.3% perplexity).
template <int BITS>
__host__ __device__ __forceinline__ uint32_t lut_selectors(const uint32_t (&w)[BITS], int m) {
    if (BITS == 4) return w[m & (BITS - 1)];  // the whole nibble: bit 3 replicates the picked slot's sign
    uint32_t s = (w[m >> 1] >> (2 * (m & 1))) & 0x33333333u;
    if (BITS == 3) s |= (m >= 2 ? w[2 % BITS] >> (m - 2) : w[2 % BITS] << (2 - m)) & 0x44444444u;
    return s;
}

// PRMT: byte i of the result is byte (bits 0-2 of nibble i of s) of the 8 bytes y:x, or with the nibble's bit 3
// set, that byte's sign bit replicated (0x00 or 0xFF). Inline PTX: __byte_perm documents 3-bit selectors.
__host__ __device__ __forceinline__ uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#ifdef __CUDA_ARCH__
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(y), "r"(s));
    return r;
#else
    const unsigned long long v = (unsigned long long)y << 32 | x;
    uint32_t r = 0;
    for (int i = 0; i < 4; i++) {
        const uint32_t n = (s >> (4 * i)) & 15u, b = (uint32_t)(v >> (8 * (n & 7))) & 0xFFu;
        r |= (n & 8 ? (b & 0x80u ? 0xFFu : 0u) : b) << (8 * i);
    }
    return r;
#endif
}

// A table weight's record per 16-row tile (gemv.cu, kernels.gemv.PackedLUT): 16 tables of 2^bits bytes, then 16 fp32
// scales and 16 fp32 offsets.
__host__ __device__ constexpr int lut_record_bytes(int bits) { return (16 << bits) + 128; }

// Registers a row's table takes in lut_fragments: its entries' bytes, 4 to a register (2 bits: one register, whose
// bytes the selectors' nibbles 0-3 reach).
template <int BITS>
__host__ __device__ constexpr int lut_regs() { return BITS == 4 ? 4 : BITS == 3 ? 2 : 1; }

// A step's lookups (PackedLUT layout) from the lane's words and its rows' tables tg, tg8 (rows g, g + 8; lut_regs
// registers each): v[m][r], the entries' bytes of row g + 8 r's elements (r, h 0), (r, h 1), (r + 2, h 0), (r + 2, h 1)
// of mma tile m, i.e. columns 2t, 2t + 1, 2t + 8, 2t + 9 (gemv.cu multiplies them as u8 on the int8 tensor cores).
template <int BITS>
__host__ __device__ __forceinline__ void lut_bytes(const uint32_t (&w)[BITS], const uint32_t (&tg)[lut_regs<BITS>()],
                                                   const uint32_t (&tg8)[lut_regs<BITS>()], uint32_t (&v)[4][2]) {
    constexpr int R = lut_regs<BITS>();
#pragma unroll
    for (int m = 0; m < 4; m++) {
        const uint32_t both = lut_selectors<BITS>(w, m);
        const uint32_t flip = BITS == 4 ? both ^ 0x88888888u : 0u;  // 4 bits: the nibbles c ^ 8 for slots 8-15
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const uint32_t s = r ? both >> 16 : both;
            const uint32_t* tb = r ? tg8 : tg;
            if constexpr (BITS == 4)
                v[m][r] = byte_perm(tb[0], tb[1], s) ^ byte_perm(tb[2], tb[3], r ? flip >> 16 : flip);
            else
                v[m][r] = byte_perm(tb[0], tb[R - 1], s);
        }
    }
}

// The same as A fragments a[m][j] for the fp16 tensor cores, each a half2 of 1024 + v (magic = 0x64006400: byte 5 of
// y:x is 0x64).
template <int BITS>
__host__ __device__ __forceinline__ void lut_fragments(const uint32_t (&w)[BITS],
                                                       const uint32_t (&tg)[lut_regs<BITS>()],
                                                       const uint32_t (&tg8)[lut_regs<BITS>()], uint32_t magic,
                                                       uint32_t (&a)[4][4]) {
    uint32_t v[4][2];
    lut_bytes<BITS>(w, tg, tg8, v);
#pragma unroll
    for (int m = 0; m < 4; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            a[m][r] = byte_perm(v[m][r], magic, 0x5150u);      // nibbles 0, 1: elements (r, h 0), (r, h 1)
            a[m][r + 2] = byte_perm(v[m][r], magic, 0x5352u);  // nibbles 2, 3: elements (r + 2, h 0), (r + 2, h 1)
        }
}
