// Low-bit GEMV (batch 1) on the tensor cores: y[N] = W_hat[N, K] x[K], W_hat group-wise asymmetric RTN.
//
// qweight is in the mma-v2 layout of quant.py: for each 16-row x 64-channel tile, lane L of a warp holds BITS
// words that contain exactly its A-operand elements of the tile's four mma.m16n8k16 instructions. Two codes
// become a half2 (1024 + code) with one mask-and-or (the 0x6400 exponent trick); the tensor core multiplies them
// by x (the B operand's column 0; the other 7 columns are zero) with fp32 accumulation, and per 64-channel step
// the lanes holding column 0 apply y += s * (C - (1024 + z) * sum(x)) in fp32 (the offset costs ~8 of fp32's 24
// bits, far below fp16 output rounding). A block owns one 16-row tile; its WARPS warps split K and reduce through
// shared memory. x (in B-fragment order), its 64-channel sums, and the tile's scales and zeros are staged in
// shared memory, so only weight loads stay in flight, double-buffered across rounds of UNROLL steps.
#include <cuda_fp16.h>

// NVRTC has no <stdint.h>
typedef unsigned int uint32_t;
typedef unsigned char uint8_t;

template <int BITS>
__device__ __forceinline__ void load_step(const uint32_t* p, uint32_t (&w)[BITS]) {
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

// half2 bits of (1024 + code) for register j of mma tile m (both arguments compile-time after unrolling).
template <int BITS>
__device__ __forceinline__ uint32_t magic_codes(const uint32_t (&w)[BITS], int m, int j) {
    if (BITS == 4) return ((w[m] >> (4 * j)) & 0x000F000Fu) | 0x64006400u;
    const uint32_t low = ((w[m >> 1] >> (2 * (4 * (m & 1) + j))) & 0x00030003u) | 0x64006400u;
    if (BITS == 2) return low;
    const int p = 4 * m + j;  // bit 2 of the code sits at bit p (and p + 16) of the plane word
    const uint32_t plane = w[BITS - 1];
    return low | ((p >= 2 ? plane >> (p - 2) : plane << (2 - p)) & 0x00040004u);
}

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int BITS, int UNROLL>
__device__ __forceinline__ void load_round(const uint32_t* base, int s0, int stride, int steps,
                                           uint32_t (&w)[UNROLL][BITS]) {
#pragma unroll
    for (int u = 0; u < UNROLL; u++) load_step<BITS>(base + (size_t)min(s0 + u * stride, steps - 1) * 32 * BITS, w[u]);
}

// y = W_hat x (+ res when res is not null). Dynamic shared memory: x as B fragments (K halves), the 64-channel sums of x (K/64 floats), then the tile's
// 16 x G scales and 16 x G zeros. Group size = 64 << GSHIFT.
template <int BITS, int WARPS, int UNROLL, int GSHIFT>
__global__ void __launch_bounds__(32 * WARPS) gemv(const uint32_t* __restrict__ qw, const __half* __restrict__ scales,
                                                   const uint8_t* __restrict__ zeros, const __half* __restrict__ x,
                                                   const __half* __restrict__ res, __half* __restrict__ y, int N,
                                                   int K, int G) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint32_t* xs = reinterpret_cast<uint32_t*>(smem);  // [step][t][m][2] half2 words
    float* xsum = reinterpret_cast<float*>(xs + K / 2);
    __half* ss = reinterpret_cast<__half*>(xsum + K / 64);
    uint8_t* zs = reinterpret_cast<uint8_t*>(ss + 16 * G);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;  // mma fragment coordinates: rows g and g + 8, columns 2t, 2t + 1
    const int tile = blockIdx.x;
    const int steps = K / 64, stride = WARPS * UNROLL;
    const uint32_t* base = qw + (size_t)tile * steps * 32 * BITS + lane * BITS;

    // The first round of weight loads goes out before the block stages x, scales and zeros.
    uint32_t w[UNROLL][BITS];
    load_round<BITS, UNROLL>(base, warp, WARPS, steps, w);
    for (int s = threadIdx.x; s < steps; s += 32 * WARPS) {  // one thread per 64-channel step
        uint32_t v[32];
        const uint4* src = reinterpret_cast<const uint4*>(x + s * 64);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const uint4 u = __ldg(src + i);
            v[4 * i] = u.x; v[4 * i + 1] = u.y; v[4 * i + 2] = u.z; v[4 * i + 3] = u.w;
        }
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&v[i]));
            sum += f.x + f.y;
        }
        xsum[s] = sum;
        // word i of the step is channels 2i, 2i+1: mma tile m = i / 8, fragment column pair (i % 8) % 4,
        // b0 (first 8 columns) or b1 (last 8)
        uint4* dst = reinterpret_cast<uint4*>(xs + s * 32);
#pragma unroll
        for (int tt = 0; tt < 4; tt++) {
            dst[2 * tt] = make_uint4(v[tt], v[tt + 4], v[8 + tt], v[8 + tt + 4]);
            dst[2 * tt + 1] = make_uint4(v[16 + tt], v[16 + tt + 4], v[24 + tt], v[24 + tt + 4]);
        }
    }
    for (int i = threadIdx.x; i < 16 * G; i += 32 * WARPS) {
        ss[i] = scales[(size_t)tile * 16 * G + i];
        zs[i] = zeros[(size_t)tile * 16 * G + i];
    }
    __syncthreads();

    float acc0 = 0.0f, acc1 = 0.0f;
    for (int s0 = warp; s0 < steps; s0 += stride) {
        uint32_t next[UNROLL][BITS];  // the next round is in flight while this one computes
        if (s0 + stride < steps) load_round<BITS, UNROLL>(base, s0 + stride, WARPS, steps, next);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int s = s0 + u * WARPS;
            if (s < steps) {
                uint4 b01 = make_uint4(0u, 0u, 0u, 0u), b23 = b01;  // x lives in column 0 of B: lanes g == 0
                if (g == 0) {
                    b01 = reinterpret_cast<const uint4*>(xs + s * 32)[2 * t];
                    b23 = reinterpret_cast<const uint4*>(xs + s * 32)[2 * t + 1];
                }
                float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma16816(c, magic_codes<BITS>(w[u], 0, 0), magic_codes<BITS>(w[u], 0, 1),
                         magic_codes<BITS>(w[u], 0, 2), magic_codes<BITS>(w[u], 0, 3), b01.x, b01.y);
                mma16816(c, magic_codes<BITS>(w[u], 1, 0), magic_codes<BITS>(w[u], 1, 1),
                         magic_codes<BITS>(w[u], 1, 2), magic_codes<BITS>(w[u], 1, 3), b01.z, b01.w);
                mma16816(c, magic_codes<BITS>(w[u], 2, 0), magic_codes<BITS>(w[u], 2, 1),
                         magic_codes<BITS>(w[u], 2, 2), magic_codes<BITS>(w[u], 2, 3), b23.x, b23.y);
                mma16816(c, magic_codes<BITS>(w[u], 3, 0), magic_codes<BITS>(w[u], 3, 1),
                         magic_codes<BITS>(w[u], 3, 2), magic_codes<BITS>(w[u], 3, 3), b23.z, b23.w);
                if (t == 0) {  // column 0 of C: rows g (c[0]) and g + 8 (c[2])
                    const int grp = s >> GSHIFT;
                    const float xs_sum = xsum[s];
                    acc0 = fmaf(__half2float(ss[g * G + grp]), fmaf(-(1024.0f + zs[g * G + grp]), xs_sum, c[0]),
                                acc0);
                    acc1 = fmaf(__half2float(ss[(g + 8) * G + grp]),
                                fmaf(-(1024.0f + zs[(g + 8) * G + grp]), xs_sum, c[2]), acc1);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
#pragma unroll
            for (int b = 0; b < BITS; b++) w[u][b] = next[u][b];
    }
    __shared__ float red[WARPS][16];
    if (t == 0) {
        red[warp][g] = acc0;
        red[warp][g + 8] = acc1;
    }
    __syncthreads();
    if (threadIdx.x < 16) {
        float v = 0.0f;
#pragma unroll
        for (int i = 0; i < WARPS; i++) v += red[i][threadIdx.x];
        if (res != nullptr) v += __half2float(res[tile * 16 + threadIdx.x]);  // fused residual add
        y[tile * 16 + threadIdx.x] = __float2half_rn(v);
    }
}

// W_hat as dense fp16 [N, K] (for prompts: cuBLAS then multiplies). One thread per (16x64 tile, lane): the same
// decode as the GEMV, then (code - zero) * scale in fp32 rounded once to fp16, as quant.QuantWeight.dequantize.
template <int BITS>
__global__ void dequant(const uint32_t* __restrict__ qw, const __half* __restrict__ scales,
                        const uint8_t* __restrict__ zeros, __half* __restrict__ out, int N, int K, int G,
                        int group_size) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    const int steps = K / 64;
    if (idx >= N / 16 * steps * 32) return;
    const int lane = idx & 31, step = (idx >> 5) % steps, tile = (idx >> 5) / steps;
    const int g = lane >> 2, t = lane & 3;
    uint32_t w[BITS];
    load_step<BITS>(qw + (size_t)idx * BITS, w);
    const int grp = step * 64 / group_size;
#pragma unroll
    for (int half_row = 0; half_row < 2; half_row++) {
        const int row = tile * 16 + g + 8 * half_row;
        const float s = __half2float(scales[(size_t)row * G + grp]);
        const float z = 1024.0f + zeros[(size_t)row * G + grp];
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int jj = 0; jj < 2; jj++) {  // register j = 2 * jj + half_row: columns + 8 * jj
                const uint32_t v = magic_codes<BITS>(w, m, 2 * jj + half_row);
                const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&v));
                const int col = step * 64 + m * 16 + 2 * t + 8 * jj;
                *reinterpret_cast<__half2*>(out + (size_t)row * K + col) =
                    __floats2half2_rn((f.x - z) * s, (f.y - z) * s);
            }
    }
}
template __global__ void dequant<2>(const uint32_t*, const __half*, const uint8_t*, __half*, int, int, int, int);
template __global__ void dequant<3>(const uint32_t*, const __half*, const uint8_t*, __half*, int, int, int, int);
template __global__ void dequant<4>(const uint32_t*, const __half*, const uint8_t*, __half*, int, int, int, int);

// (warps per tile, steps in flight) variants, chosen per shape by gemv.py's pick_variant
#define INST(B, W, U, GS) template __global__ void gemv<B, W, U, GS>(const uint32_t*, const __half*, \
    const uint8_t*, const __half*, const __half*, __half*, int, int, int);
#define INST_GS(B, W, U) INST(B, W, U, 0) INST(B, W, U, 1) INST(B, W, U, 2) INST(B, W, U, 3)
#define INST_BITS(W, U) INST_GS(2, W, U) INST_GS(3, W, U) INST_GS(4, W, U)
INST_BITS(4, 2)
INST_BITS(4, 4)
INST_BITS(16, 2)
