// How a lane's words of a uniform (RTN / AWQ) 64-channel step become tensor-core operands, for gemv.cu, prefill_a8.cu
// and the host harness of tests/test_lut_decode.py (host and device code). The words are quant.pack_codes' mma-v3
// layout, except 3 bits, which kernels.gemv.Packed lays out again at load time (bytes3_layout) so that one mask makes
// four codes bytes: tiles 0-2 in word m, row g's codes at bits 2-4 of each byte and row g + 8's at bits 5-7; tile 3
// from the words' bits 0-1 (three shifts, four LOP3). Byte b of a row's four codes of mma tile m is column
// 16m + (2t, 2t + 8, 2t + 1, 2t + 9)[b] (lane 4g + t), and bytes 0 and 2 (1 and 3) are the two halves of the fp16
// mma's register j (j + 2), so one layout serves the fp16 path (decode) and the int8 one (u8_operands).
#pragma once

#include "lut.cuh"

// A lane's BITS words of a uniform step (kernels.gemv.Packed) from the step's start: at lane * BITS, but 3 bits (as
// bytes3_layout places them) W0 and W1 at 2 * lane, W2 at 64 + lane: one 8- and one 4-byte load instead of three.
template <int BITS>
__host__ __device__ __forceinline__ void step_words(const uint32_t* step, int lane, uint32_t (&w)[BITS]) {
    if constexpr (BITS == 3) {
        const uint2 u = reinterpret_cast<const uint2*>(step)[lane];
        w[0] = u.x, w[1] = u.y, w[2] = step[64 + lane];
    } else if constexpr (BITS == 2) {
        const uint2 u = reinterpret_cast<const uint2*>(step)[lane];
        w[0] = u.x, w[1] = u.y;
    } else {
#pragma unroll
        for (int q = 0; q < BITS / 4; q++) {
            const uint4 u = reinterpret_cast<const uint4*>(step + lane * BITS)[q];
            w[4 * q] = u.x, w[4 * q + 1] = u.y, w[4 * q + 2] = u.z, w[4 * q + 3] = u.w;
        }
    }
}

// log2 of the factor f in which a code of mma tile m, row half r (rows g: 0, rows g + 8: 1) comes out of decode and
// u8_operands (f * code).
__host__ __device__ constexpr int log2_factor(int bits, int m, int r) {
    return bits == 8   ? 0
           : bits == 4 ? 4 * r
           : bits == 3 ? 2 + 3 * r
                       : (m < 3 ? 2 * m : 6 + 2 * r);
}

// 3 bits, tile 3 (bytes3_layout): row g's codes times 4 (v0) and row g + 8's times 32 (v1), from the words' bits 0-1
__host__ __device__ __forceinline__ void bytes3_tile3(const uint32_t (&w)[3], uint32_t& v0, uint32_t& v1) {
    const uint32_t s1 = w[1] << 4;  // row g's bit 2 and row g + 8's bit 0, both from W1
    v0 = ((w[0] << 2) & 0x0C0C0C0Cu) | (s1 & 0x10101010u);
    v1 = (s1 & 0x20202020u) | ((w[2] << 6) & 0xC0C0C0C0u);
}

// The int8 path's A operand (4 and 3 bits): v[m][r] = the four codes of row g + 8 r, mma tile m, as bytes times
// 2^log2_factor(BITS, m, r): one LOP3 per register, but for 3-bit tile 3.
template <int BITS>
__host__ __device__ __forceinline__ void u8_operands(const uint32_t (&w)[BITS], uint32_t (&v)[4][2]) {
    static_assert(BITS == 3 || BITS == 4, "int8 operands: 3 or 4 bits");
    if constexpr (BITS == 4) {
#pragma unroll
        for (int m = 0; m < 4; m++) v[m][0] = w[m] & 0x0F0F0F0Fu, v[m][1] = w[m] & 0xF0F0F0F0u;
    } else {
#pragma unroll
        for (int m = 0; m < 3; m++) v[m][0] = w[m] & 0x1C1C1C1Cu, v[m][1] = w[m] & 0xE0E0E0E0u;
        bytes3_tile3(w, v[3][0], v[3][1]);
    }
}

// The fp16 path's 16 A registers (a[m][j]: mma tile m, register j) of a lane's step, each a half2 of 1024 + f * code.
// The GEMV passes magic = 0x64006400 as a kernel argument: a value the compiler cannot see stays a register operand,
// so each register is one LOP3 (mask immediate, magic register) instead of an AND and an OR with two immediates.
template <int BITS>
__host__ __device__ __forceinline__ void decode(const uint32_t (&w)[BITS], uint32_t magic, uint32_t (&a)[4][4]) {
    if constexpr (BITS == 8) {  // registers 0, 1 of tile m in word 2m (bits 0 and 8 of each half), 2, 3 in word 2m + 1
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint32_t v = w[2 * m + h];
                a[m][2 * h] = (v & 0x00FF00FFu) | magic;
                a[m][2 * h + 1] = ((v >> 8) & 0x00FF00FFu) | magic;
            }
    } else if constexpr (BITS == 4 || BITS == 3) {  // rows g, g + 8 in bytes 0 and 2, then (shifted) 1 and 3
        constexpr uint32_t G = BITS == 4 ? 0x000F000Fu : 0x001C001Cu, G8 = BITS == 4 ? 0x00F000F0u : 0x00E000E0u;
#pragma unroll
        for (int m = 0; m < BITS; m++) {  // 3 bits: tiles 0-2
            const uint32_t hi = w[m] >> 8;
            a[m][0] = (w[m] & G) | magic;
            a[m][1] = (w[m] & G8) | magic;
            a[m][2] = (hi & G) | magic;
            a[m][3] = (hi & G8) | magic;
        }
        if constexpr (BITS == 3) {  // tile 3's bytes paired with magic's 0x64 by PRMT: bytes 0, 2, then 1, 3
            uint32_t v0, v1;
            bytes3_tile3(w, v0, v1);
            a[3][0] = byte_perm(v0, magic, 0x7250u);
            a[3][1] = byte_perm(v1, magic, 0x7250u);
            a[3][2] = byte_perm(v0, magic, 0x7351u);
            a[3][3] = byte_perm(v1, magic, 0x7351u);
        }
    } else {
        const uint32_t A0 = w[0], A1 = w[1], B0 = A0 >> 10, B1 = A1 >> 10;
#pragma unroll
        for (int m = 0; m < 3; m++) {
            const uint32_t mask = 0x00030003u << (2 * m);
            a[m][0] = (A0 & mask) | magic;
            a[m][1] = (A1 & mask) | magic;
            a[m][2] = (B0 & mask) | magic;
            a[m][3] = (B1 & mask) | magic;
        }
        a[3][0] = (A0 & 0x00C000C0u) | magic; a[3][1] = (A0 & 0x03000300u) | magic;
        a[3][2] = (A1 & 0x00C000C0u) | magic; a[3][3] = (A1 & 0x03000300u) | magic;
    }
}
