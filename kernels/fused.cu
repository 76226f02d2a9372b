// Small fused decode kernels: each replaces a chain of 6-18 elementwise torch launches (a launch inside a CUDA
// graph costs ~1-2 us, more than the work). Same math as the torch reference in localllm/ops.py, in fp32.
#include <cuda_fp16.h>

// y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, one block per row.
__global__ void rmsnorm(const __half* __restrict__ x, const float* __restrict__ w, __half* __restrict__ y, int D,
                        float eps) {
    const __half* xr = x + (size_t)blockIdx.x * D;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float v = __half2float(xr[i]);
        ss += v * v;
    }
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (threadIdx.x == 0) part[0] = v;
    }
    __syncthreads();
    const float r = rsqrtf(part[0] / D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x)
        y[(size_t)blockIdx.x * D + i] = __float2half_rn(__half2float(xr[i]) * r * w[i]);
}

// In place, rotate-half RoPE on the first `heads` heads of each row of qkv [rows, ld] (q heads then k heads);
// row r is at position index r % T of cos/sin [T, half]. Block = (row, head), thread = rotation pair.
__global__ void rope(__half* __restrict__ qkv, const float* __restrict__ cos, const float* __restrict__ sin, int ld,
                     int T, int heads, int half) {
    const int row = blockIdx.x / heads, head = blockIdx.x % heads, i = threadIdx.x;
    if (i >= half) return;
    __half* p = qkv + (size_t)row * ld + head * 2 * half;
    const float c = cos[(row % T) * half + i], s = sin[(row % T) * half + i];
    const float x1 = __half2float(p[i]), x2 = __half2float(p[i + half]);
    p[i] = __float2half_rn(x1 * c - x2 * s);
    p[i + half] = __float2half_rn(x2 * c + x1 * s);
}

// out[r] = table[tok[r]], rows of D8 16-byte words, the table in pinned host memory read through its host pointer
// (zero-copy): the embeddings take no GPU memory (an 8B model's are 1 GB) for one row per token. Block = row.
__global__ void embed_rows(const long long* __restrict__ tok, const uint4* __restrict__ table, uint4* __restrict__ out,
                           int D8) {
    const long long t = tok[blockIdx.x];
    for (int i = threadIdx.x; i < D8; i += blockDim.x) out[(size_t)blockIdx.x * D8 + i] = table[t * D8 + i];
}

// out[r, i] = silu(gu[r, i]) * gu[r, I + i] for gu [rows, 2I]. 64-bit indices: a 70B model's 75k-token prompt has
// over 2^31 of them.
__global__ void silu_mul(const __half* __restrict__ gu, __half* __restrict__ out, int I, long long n) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    const long long r = idx / I;
    const int i = (int)(idx - r * I);
    const float g = __half2float(gu[r * 2 * I + i]), u = __half2float(gu[r * 2 * I + I + i]);
    out[idx] = __float2half_rn(__fdividef(g, 1.0f + __expf(-g)) * u);  // as the GEMV's fused staging
}
