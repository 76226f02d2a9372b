// Low-bit GEMV (batch 1): y[N] = W_hat[N, K] x[K], W_hat group-wise asymmetric (quant.py, layout rtn-planes-v1).
//
// qweight: int32 [N, K*BITS/32]; each 32-channel block of a row is BITS words:
//   BITS=4: word j holds channels 8j..8j+7 as nibbles (channel 8j+i at bits 4i)
//   BITS=2: word j holds channels 16j..16j+15 (channel 16j+i at bits 2i)
//   BITS=3: words 0,1 = the low 2 bits as in BITS=2; word 2 = bit 2 of the 32 codes (channel i at bit i)
// scales: fp16 [N, G], zeros: uint8 [N, G], G = ceil(K / group_size), group_size % 32 == 0.
// A warp computes ROWS rows; each lane takes 32-channel blocks strided by 1024 channels, so one x block in
// registers serves ROWS rows. Math in fp32: y = sum_g s_g * (sum q*x - z_g * sum x), exact codes via the
// 2^23 float trick (no int->float conversion instruction per weight).
#include <cuda_fp16.h>

// NVRTC has no <stdint.h>
typedef unsigned int uint32_t;
typedef unsigned char uint8_t;

__device__ __forceinline__ float code_f(uint32_t c) {  // exact float(c) for c < 2^23
    return __uint_as_float(0x4B000000u | c) - 8388608.0f;
}

// One 32-channel block: 16-byte load for 4-bit, 8-byte for 2-bit (rows stay aligned as K % 32 == 0).
template <int BITS>
__device__ __forceinline__ void load_words(const uint32_t* p, uint32_t (&w)[BITS]) {
    if (BITS == 4) {
        const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
        w[0] = u.x; w[1] = u.y; w[2 % BITS] = u.z; w[3 % BITS] = u.w;
    } else if (BITS == 2) {
        const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
        w[0] = u.x; w[1 % BITS] = u.y;
    } else {
#pragma unroll
        for (int b = 0; b < BITS; b++) w[b] = __ldg(p + b);
    }
}

// sum_c code_c * x_c over one 32-channel block, in four independent chains (a single chain of 32 dependent
// FMAs would leave the lane waiting on FMA latency).
template <int BITS>
__device__ __forceinline__ uint32_t code_at(const uint32_t (&w)[BITS], int c) {
    if (BITS == 4) return (w[c >> 3] >> (4 * (c & 7))) & 15u;
    if (BITS == 2) return (w[c >> 4] >> (2 * (c & 15))) & 3u;
    return ((w[c >> 4] >> (2 * (c & 15))) & 3u) | (((w[BITS - 1] >> c) & 1u) << 2);
}

template <int BITS>
__device__ __forceinline__ float block_dot(const uint32_t (&w)[BITS], const float (&x)[32]) {
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int c = 0; c < 32; c++) d[c & 3] = fmaf(code_f(code_at<BITS>(w, c)), x[c], d[c & 3]);
    return (d[0] + d[1]) + (d[2] + d[3]);
}

// One lane's 32-channel block of x, as floats, and their sum.
__device__ __forceinline__ float load_x(const __half* __restrict__ x, int c0, float (&xf)[32]) {
    const uint4* xv = reinterpret_cast<const uint4*>(x + c0);
    float xsum = 0.0f;
#pragma unroll
    for (int v = 0; v < 4; v++) {
        const uint4 u = __ldg(xv + v);
        const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float2 f = __half22float2(h[e]);
            xf[8 * v + 2 * e] = f.x;
            xf[8 * v + 2 * e + 1] = f.y;
            xsum += f.x + f.y;
        }
    }
    return xsum;
}

// UNROLL strides of 1024 channels per outer step: all their weight loads are issued before any math, so
// each lane keeps UNROLL * ROWS * BITS words in flight.
template <int BITS, int ROWS, int UNROLL>
__global__ void __launch_bounds__(128) gemv(const uint32_t* __restrict__ qw, const __half* __restrict__ scales,
                                            const uint8_t* __restrict__ zeros, const __half* __restrict__ x,
                                            __half* __restrict__ y, int N, int K, int G, int group_size) {
    const int lane = threadIdx.x & 31;
    const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * ROWS;
    if (row0 >= N) return;
    const int wpr = K / 32 * BITS;  // words per row
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;

    for (int base = lane * 32; base < K; base += 1024 * UNROLL) {
        uint32_t w[UNROLL][ROWS][BITS];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c0 = min(base + 1024 * u, K - 32);  // past the end: a harmless re-read, not used
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                const int row = min(row0 + r, N - 1);
                load_words<BITS>(qw + (size_t)row * wpr + (c0 / 32) * BITS, w[u][r]);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c0 = base + 1024 * u;
            if (c0 < K) {
                float xf[32];
                const float xsum = load_x(x, c0, xf);
                const int g = c0 / group_size;
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    const int row = min(row0 + r, N - 1);
                    const float s = __half2float(scales[(size_t)row * G + g]);
                    const float z = (float)zeros[(size_t)row * G + g];
                    acc[r] = fmaf(s, block_dot<BITS>(w[u][r], xf) - z * xsum, acc[r]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        float v = acc[r];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && row0 + r < N) y[row0 + r] = __float2half_rn(v);
    }
}

#define INST(B) template __global__ void gemv<B, 4, 4>(const uint32_t*, const __half*, const uint8_t*, \
                                                  const __half*, __half*, int, int, int, int);
INST(2)
INST(3)
INST(4)
