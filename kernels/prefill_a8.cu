// Prompts with 8-bit activations: Y[T, N] = X8[T, K] W_hat^T on the int8 tensor cores, straight from the packed
// low-bit weights of gemv.cu (kernels.gemv.Packed: group-wise scales and zeros, no second copy of the model).
//
// quant_a8: per token, s = max|x| / 127 and x8 = rint(x / s) (ops.quantize_tokens), written in the order the mma
// fragments read it (a8_pos), plus the sum of x8 over every weight group.
//
// gemm_a8: C^T = W_hat X8^T with mma.m16n8k32 (u8 x s8 -> s32): A = the codes (unsigned, zero folded in later), B = x8.
// A lane's codes of a 64-channel step are those of the fp16 mma fragments (codes.cuh); for row g (or g + 8)
// of fp16 mma tile m they are channels 16m + (2t, 2t + 8, 2t + 1, 2t + 9): exactly what the int8 fragment wants in
// k slots 4t .. 4t + 3 once x8 carries the same channel order. So one int8 mma covers fp16 tiles 2kk, 2kk + 1 with
// a0/a2 = rows g of tiles 2kk/2kk+1, a1/a3 = rows g + 8. The integer sums of a group are exact; at its end
// acc += s_n,g * (sum - z_n,g * sum_g x8), and Y = s_token * acc (fp32, rounded once to fp16).
//
// Work: a block of 8 warps takes 128 outputs (a 16-row tile per warp) x 128 tokens (16 mma columns of 8); the
// tokens' x8 of each 64-channel step goes through a STAGES-deep cp.async ring in shared memory that all 8 warps
// read (a lane's four B registers of a step and column: one 16-byte load), each warp's codes come straight from
// global memory one step ahead.
#include <cuda_fp16.h>

typedef unsigned int uint32_t;
typedef unsigned char uint8_t;
typedef signed char int8_t;

#include "async_copy.cuh"
#include "lut.cuh"
#include "codes.cuh"

constexpr int META_BYTES = 48;  // gemv.cu's meta record: 16 fp16 scales, 16 uint8 zeros, rows 0, 8, 1, 9, ...

// Where channel c of a 64-channel step goes: lane t's 16 bytes (4t + i of fp16 mma tiles 0, 1, 2, 3 in turn),
// 4t + i being the slot of channel c % 16 in the order 0, 8, 1, 9, ..., 7, 15.
__device__ __forceinline__ int a8_pos(int c) {
    const int m = (c >> 4) & 3, cc = c & 15, slot = cc < 8 ? 2 * cc : 2 * (cc - 8) + 1;
    return (c & ~63) + 16 * (slot >> 2) + 4 * m + (slot & 3);
}

// One block per token. x: fp16 [T, K]; x8: int8 [T, K] (permuted); sx: fp32 [T]; xsum: int32 [T, G], G groups of
// `group` channels (the last may be shorter).
__global__ void quant_a8(const __half* __restrict__ x, int8_t* __restrict__ x8, float* __restrict__ sx,
                         int* __restrict__ xsum, int K, int group, int G) {
    __shared__ float wmax[32];
    extern __shared__ int gsum[];
    const int tok = blockIdx.x;
    const __half* xr = x + (size_t)tok * K;
    float m = 0.0f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) m = fmaxf(m, fabsf(__half2float(xr[i])));
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) wmax[threadIdx.x >> 5] = m;
    for (int g = threadIdx.x; g < G; g += blockDim.x) gsum[g] = 0;
    __syncthreads();
    m = 0.0f;
    for (int w = 0; w < (int)blockDim.x / 32; w++) m = fmaxf(m, wmax[w]);
    const float s = m > 0.0f ? m / 127.0f : 1.0f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
        const int q = (int)fminf(fmaxf(rintf(__half2float(xr[i]) / s), -127.0f), 127.0f);
        x8[(size_t)tok * K + a8_pos(i)] = (int8_t)q;
        atomicAdd(&gsum[i / group], q);
    }
    __syncthreads();
    for (int g = threadIdx.x; g < G; g += blockDim.x) xsum[(size_t)tok * G + g] = gsum[g];
    if (threadIdx.x == 0) sx[tok] = s;
}

__device__ __forceinline__ void mma_u8s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// v[m][r]: the 4 codes of row g + 8r, fp16 tile m, as bytes in the permuted channel order (2t, 2t + 8, 2t + 1,
// 2t + 9): 3 and 4 bits as the GEMV's int8 path makes them, their factors shifted out; 2 bits code by code.
template <int BITS>
__device__ __forceinline__ void a8_codes(const uint32_t (&w)[BITS], uint32_t (&v)[4][2]) {
    if constexpr (BITS == 2) {
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int r = 0; r < 2; r++)
                v[m][r] = lut_code<BITS>(w, m, r, 0) | (lut_code<BITS>(w, m, r + 2, 0) << 8) |
                          (lut_code<BITS>(w, m, r, 1) << 16) | (lut_code<BITS>(w, m, r + 2, 1) << 24);
    } else {
        u8_operands<BITS>(w, v);
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int r = 0; r < 2; r++) v[m][r] >>= log2_factor(BITS, m, r);  // the bytes' other bits are 0
    }
}

constexpr int A8_WARPS = 8, A8_TOK = 128, A8_STAGES = 4, A8_STEP_BYTES = A8_TOK * 64;

// qw, meta: gemv.Packed; y: fp16 [T, N]. Group size = 64 << GSHIFT. Dynamic shared memory: A8_STAGES steps of x8.
template <int BITS, int GSHIFT>
__global__ void __launch_bounds__(32 * A8_WARPS, 1)
    gemm_a8(const uint32_t* __restrict__ qw, const uint8_t* __restrict__ meta, const int8_t* __restrict__ x8,
            const float* __restrict__ sx, const int* __restrict__ xsum, __half* __restrict__ y, int T, int N, int K,
            int G) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * A8_WARPS + warp, tok0 = blockIdx.y * A8_TOK, S = K / 64;
    const bool rows = tile < N / 16;  // (a warp past the last tile still helps stage x8)
    const uint32_t* wp = qw + (size_t)min(tile, N / 16 - 1) * S * 32 * BITS;  // the tile's first step
    // staging: thread i copies 16-byte pieces i and i + 256 of a step (token = piece / 4, piece % 4 = quarter)
    const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    auto stage = [&](int s) {
        if (s < S) {
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int piece = threadIdx.x + 256 * r, tok = piece >> 2;
                cp_async16(sbase + (s % A8_STAGES) * A8_STEP_BYTES + 16 * piece,
                           x8 + (size_t)min(tok0 + tok, T - 1) * K + 64 * s + 16 * (piece & 3), true);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
#pragma unroll
    for (int s = 0; s < A8_STAGES - 1; s++) stage(s);
    float acc[16][4] = {};
    int isum[16][4] = {};
    uint32_t w[BITS];
    step_words<BITS>(wp, lane, w);
    for (int s = 0; s < S; s++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(A8_STAGES - 2));
        __syncthreads();  // step s is in; everyone is past step s - 1, whose slot the next stage() reuses
        stage(s + A8_STAGES - 1);
        uint32_t v[4][2], a[2][4];
        a8_codes<BITS>(w, v);
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            a[kk][0] = v[2 * kk][0];
            a[kk][1] = v[2 * kk][1];
            a[kk][2] = v[2 * kk + 1][0];
            a[kk][3] = v[2 * kk + 1][1];
        }
        if (s + 1 < S) step_words<BITS>(wp + (size_t)(s + 1) * 32 * BITS, lane, w);  // the next step's, in flight now
        const unsigned char* xs = smem + (s % A8_STAGES) * A8_STEP_BYTES + 16 * t;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const uint4 b = *reinterpret_cast<const uint4*>(xs + (8 * j + g) * 64);
            mma_u8s8(isum[j], a[0], b.x, b.y);
            mma_u8s8(isum[j], a[1], b.z, b.w);
        }
        if (((s + 1) & ((1 << GSHIFT) - 1)) == 0 || s == S - 1) {  // a group ends: scale its exact sums, fold the zero in
            const int grp = s >> GSHIFT;
            const uint8_t* rec = meta + ((size_t)min(tile, N / 16 - 1) * G + grp) * META_BYTES;
            const float2 sc = __half22float2(reinterpret_cast<const __half2*>(rec)[g]);
            const float z0 = rec[32 + 2 * g], z1 = rec[32 + 2 * g + 1];
#pragma unroll
            for (int j = 0; j < 16; j++) {
                // C fragment: c0, c1 = row g, tokens 2t, 2t + 1 of column tile j; c2, c3 = row g + 8
                const int ta = min(tok0 + 8 * j + 2 * t, T - 1), tb = min(ta + 1, T - 1);
                const float xa = (float)__ldg(xsum + (size_t)ta * G + grp), xb = (float)__ldg(xsum + (size_t)tb * G + grp);
                acc[j][0] = fmaf(sc.x, (float)isum[j][0] - z0 * xa, acc[j][0]);
                acc[j][1] = fmaf(sc.x, (float)isum[j][1] - z0 * xb, acc[j][1]);
                acc[j][2] = fmaf(sc.y, (float)isum[j][2] - z1 * xa, acc[j][2]);
                acc[j][3] = fmaf(sc.y, (float)isum[j][3] - z1 * xb, acc[j][3]);
                isum[j][0] = isum[j][1] = isum[j][2] = isum[j][3] = 0;
            }
        }
    }
    if (!rows) return;
    const int n0 = tile * 16 + g;
#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int tok = tok0 + 8 * j + 2 * t + (e & 1), n = n0 + 8 * (e >> 1);
            if (tok < T) y[(size_t)tok * N + n] = __float2half_rn(sx[tok] * acc[j][e]);
        }
}

#ifndef __CUDACC_RTC__  // nvcc (resource checks) builds every variant; NVRTC only what kernels/cuda.py asks for
#define A8_INST(B, GS) template __global__ void gemm_a8<B, GS>(const uint32_t*, const uint8_t*, const int8_t*, \
    const float*, const int*, __half*, int, int, int, int);
#define A8_BITS(B) A8_INST(B, 0) A8_INST(B, 1) A8_INST(B, 2) A8_INST(B, 3)
A8_BITS(2)
A8_BITS(3)
A8_BITS(4)
#endif
