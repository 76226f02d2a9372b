// Non-uniform low-bit GEMV (batch 1) on the tensor cores: y[N] = W_hat[N, K] f(x) (+ res), with
// W_hat[n, c] = lut[n][code[n, c]]: one fp16 table of 2^BITS values per output channel (quant.QuantLUT,
// SqueezeLLM-style). The codes are packed exactly as the uniform weights are (quant.pack_codes, layout mma-v3):
// a 16-row x 64-channel step is 32 lanes x BITS words, each lane's words holding its A-operand elements of the
// step's four mma.m16n8k16 instructions. A lane extracts each element's code, looks its value up in the tile's 16
// tables (staged in shared memory), and the tensor core multiplies the half2 pairs by x (every column of B is x)
// with fp32 accumulation. Unlike the uniform GEMV there is no scale, zero or per-field factor: the table holds the
// weight itself, so one accumulator per lane sums every step.
//
// Work: each block takes tiles blockIdx.x, + gridDim.x, ...; its WARPS warps split a tile's K/64 steps into runs of
// U consecutive steps, loading the words of a whole run before decoding it (U * BITS words in flight per lane). The
// warps' partial sums of a tile meet in shared memory. f(x) (RMSNorm or SwiGLU gate, as in gemv.cu) is staged once
// per block. QDEC compensation is not fused here yet (the runtime runs these layers uncompensated on the GPU).
#include <cuda_fp16.h>

#include "pdl.cuh"

// NVRTC has no <stdint.h>
typedef unsigned int uint32_t;
typedef unsigned char uint8_t;

#include "mma.cuh"

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

// A lane's BITS words of a step (16-, 8- or 4-byte aligned loads).
template <int BITS>
__device__ __forceinline__ void lut_words(const uint32_t* __restrict__ p, uint32_t (&w)[BITS]) {
    if (BITS == 4) {
        const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
        w[0] = u.x; w[1 % BITS] = u.y; w[2 % BITS] = u.z; w[3 % BITS] = u.w;
    } else if (BITS == 2) {
        const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
        w[0] = u.x; w[1 % BITS] = u.y;
    } else {
#pragma unroll
        for (int b = 0; b < BITS; b++) w[b] = __ldg(p + b);
    }
}

// One step: c += W_hat[tile rows, 64 channels] . xs[64 channels]. tab: the tile's 16 tables (rows 0..15, C values
// each); xs: the step's 64 channels of f(x). A's fragment: lut_row, lut_col; B's fragment is x at channels 2t, 2t + 1
// (b0) and 2t + 8, 2t + 9 (b1) of mma tile m.
template <int BITS>
__device__ __forceinline__ void lut_step(const uint32_t (&w)[BITS], const __half* tab, const __half* xs, int g,
                                         int t, float (&c)[4]) {
    constexpr int C = 1 << BITS;
#pragma unroll
    for (int m = 0; m < 4; m++) {
        uint32_t a[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const __half* row = tab + lut_row(g, j) * C;
            const __half2 v = __halves2half2(row[lut_code<BITS>(w, m, j, 0)], row[lut_code<BITS>(w, m, j, 1)]);
            a[j] = *reinterpret_cast<const uint32_t*>(&v);
        }
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(xs + 16 * m + 2 * t);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(xs + 16 * m + 2 * t + 8);
        mma16816(c, a, b0, b1);
    }
}

// Dynamic shared memory: f(x) (K halves), then the tile's tables (16 x 2^BITS halves).
template <int BITS, int WARPS, int U>
__global__ void __launch_bounds__(32 * WARPS, 2)
    gemv_lut(const uint32_t* __restrict__ qw, const __half* __restrict__ lut, const __half* __restrict__ x,
             const __half* __restrict__ res, __half* __restrict__ y, int N, int K, const float* __restrict__ norm_w,
             float eps, int glu) {
    constexpr int C = 1 << BITS;
    extern __shared__ __align__(16) unsigned char smem[];
    __half* xs = reinterpret_cast<__half*>(smem);
    __half* tab = reinterpret_cast<__half*>(smem + K * 2);
    __shared__ float red[WARPS][16];
    __shared__ float wsum[WARPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int S = K / 64, T = N / 16;
    wait_previous();  // x (and res) come from the previous kernel

    // f(x): with norm_w, fp16(x * rsqrt(mean(x^2) + eps) * norm_w) (ops.rmsnorm); with glu, x = [gate | up] (2K
    // halves) -> fp16(silu(gate) * up) (ops.silu_mul); else x.
    float rnorm = 1.0f;
    if (norm_w != nullptr) {
        float ss = 0.0f;
        for (int i = threadIdx.x; i < K / 2; i += blockDim.x) {
            const float2 f = __half22float2(reinterpret_cast<const __half2*>(x)[i]);
            ss = fmaf(f.x, f.x, fmaf(f.y, f.y, ss));
        }
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) wsum[warp] = ss;
        __syncthreads();
        ss = 0.0f;
#pragma unroll
        for (int k = 0; k < WARPS; k++) ss += wsum[k];
        rnorm = rsqrtf(ss / K + eps);
    }
    for (int i = threadIdx.x; i < K / 2; i += blockDim.x) {
        float2 f = __half22float2(reinterpret_cast<const __half2*>(x)[i]);
        if (norm_w != nullptr) {
            const float2 nw = reinterpret_cast<const float2*>(norm_w)[i];
            f = make_float2(f.x * rnorm * nw.x, f.y * rnorm * nw.y);
        } else if (glu) {
            const float2 u = __half22float2(reinterpret_cast<const __half2*>(x + K)[i]);
            f = make_float2(f.x / (1.0f + __expf(-f.x)) * u.x, f.y / (1.0f + __expf(-f.y)) * u.y);
        }
        reinterpret_cast<__half2*>(xs)[i] = __floats2half2_rn(f.x, f.y);
    }

    for (int tile = blockIdx.x; tile < T; tile += gridDim.x) {
        for (int i = threadIdx.x; i < 16 * C; i += blockDim.x) tab[i] = lut[(size_t)tile * 16 * C + i];
        __syncthreads();  // the tables (and, the first time, f(x)) are staged; red of the previous tile was read
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const uint32_t* base = qw + (size_t)tile * S * 32 * BITS + lane * BITS;
        for (int s0 = warp * U; s0 < S; s0 += WARPS * U) {
            uint32_t w[U][BITS];
#pragma unroll
            for (int u = 0; u < U; u++)  // a run's loads all go out before its first decode
                if (s0 + u < S) lut_words<BITS>(base + (size_t)(s0 + u) * 32 * BITS, w[u]);
#pragma unroll
            for (int u = 0; u < U; u++)
                if (s0 + u < S) lut_step<BITS>(w[u], tab, xs + (s0 + u) * 64, g, t, c);
        }
        if (t == 0) {  // every column of C is the same dot product: column 0 of rows g (c[0]) and g + 8 (c[2])
            red[warp][g] = c[0];
            red[warp][g + 8] = c[2];
        }
        __syncthreads();  // the partial sums are in; the tables may be replaced after the reads below
        if (threadIdx.x < 16) {
            float v = 0.0f;
#pragma unroll
            for (int k = 0; k < WARPS; k++) v += red[k][threadIdx.x];
            const int n = tile * 16 + threadIdx.x;
            if (res != nullptr) v += __half2float(res[n]);
            y[n] = __float2half_rn(v);
        }
    }
}

// W_hat as dense fp16 [N, K] (prompts: cuBLAS then multiplies), as quant.QuantLUT.dequantize(torch.float16). One
// thread per (tile, step, lane), decoding exactly as the GEMV does.
template <int BITS>
__global__ void dequant_lut(const uint32_t* __restrict__ qw, const __half* __restrict__ lut, __half* __restrict__ out,
                            int N, int K) {
    constexpr int C = 1 << BITS;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    const int steps = K / 64;
    if (idx >= N / 16 * steps * 32) return;
    const int lane = idx & 31, step = (idx >> 5) % steps, tile = (idx >> 5) / steps;
    const int g = lane >> 2, t = lane & 3;
    uint32_t w[BITS];
    lut_words<BITS>(qw + (size_t)idx * BITS, w);
#pragma unroll
    for (int m = 0; m < 4; m++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = tile * 16 + lut_row(g, j), col = step * 64 + lut_col(t, m, j, h);
                out[(size_t)row * K + col] = lut[(size_t)row * C + lut_code<BITS>(w, m, j, h)];
            }
}

#define LUT_INST(B)                                                                                                \
    template __global__ void gemv_lut<B, 8, 4>(const uint32_t*, const __half*, const __half*, const __half*,      \
                                               __half*, int, int, const float*, float, int);                       \
    template __global__ void dequant_lut<B>(const uint32_t*, const __half*, __half*, int, int);
LUT_INST(2)
LUT_INST(3)
LUT_INST(4)
