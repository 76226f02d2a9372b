// Attention of one new token (decode), fused with its RoPE and its KV-cache append, split over the context:
// attend_part: block (kv head, 128-position chunk) rotates the query heads of its kv head, appends the new key and
// value when the chunk holds the new position, and writes its chunk's softmax statistics and unnormalized output;
// attend_combine merges the chunks per query head. The position comes from device memory, so one captured CUDA
// graph serves every step; chunks past it exit at once. Same math as the torch path (model.Block): q and k rounded
// to fp16 after rotate-half RoPE, scores and softmax in fp32, output rounded to fp16.
#include <cuda_fp16.h>

#include "pdl.cuh"

constexpr int CHUNK = 128;  // positions per block (and threads per block)
constexpr int GQ_MAX = 8;   // query heads per kv head
#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no INFINITY

// qkv: [H*D | KVH*D | KVH*D] of the new token; cos/sin: [D/2] at its position; kc/vc: [KVH, max_len, D] of this
// layer. Shared memory (fp32): q [GQ_MAX][D], p [GQ_MAX][CHUNK], then the output streams' partial sums.
template <int D, int GQ>
__global__ void __launch_bounds__(CHUNK) attend_part(const __half* __restrict__ qkv, const float* __restrict__ cos,
                                                     const float* __restrict__ sin, __half* __restrict__ kc,
                                                     __half* __restrict__ vc, const long long* __restrict__ pos_p,
                                                     float* __restrict__ ws_o, float* __restrict__ ws_ml, int H,
                                                     int KVH, int max_len, float scale) {
    wait_previous();
    start_next();
    const int kvh = blockIdx.x, chunk = blockIdx.y, n_chunks = gridDim.y;
    const int pos = (int)*pos_p, start = chunk * CHUNK;
    if (start > pos) return;
    const int n = min(CHUNK, pos + 1 - start);
    extern __shared__ float sm[];
    float* q = sm;                         // [GQ][D]
    float* p = q + GQ_MAX * D;             // [GQ][CHUNK]
    float2* red = reinterpret_cast<float2*>(p + GQ_MAX * CHUNK);  // [STREAMS - 1][GQ][D / 2]
    __shared__ float mstat[GQ_MAX], lstat[GQ_MAX];
    constexpr int HALF = D / 2;
    const int tid = threadIdx.x;

    for (int i = tid; i < GQ * HALF; i += CHUNK) {
        const int g = i / HALF, d = i % HALF;
        const __half* x = qkv + (kvh * GQ + g) * D;
        const float c = cos[d], s = sin[d], x1 = __half2float(x[d]), x2 = __half2float(x[d + HALF]);
        q[g * D + d] = __half2float(__float2half_rn(x1 * c - x2 * s)) * scale;
        q[g * D + d + HALF] = __half2float(__float2half_rn(x2 * c + x1 * s)) * scale;
    }
    if (pos < start + CHUNK) {  // this chunk holds the new position: append k (rotated) and v
        const __half* k = qkv + H * D + kvh * D;
        const __half* v = qkv + (H + KVH) * D + kvh * D;
        __half* kd = kc + ((size_t)kvh * max_len + pos) * D;
        __half* vd = vc + ((size_t)kvh * max_len + pos) * D;
        for (int d = tid; d < HALF; d += CHUNK) {
            const float c = cos[d], s = sin[d], x1 = __half2float(k[d]), x2 = __half2float(k[d + HALF]);
            kd[d] = __float2half_rn(x1 * c - x2 * s);
            kd[d + HALF] = __float2half_rn(x2 * c + x1 * s);
        }
        for (int d = tid; d < D; d += CHUNK) vd[d] = v[d];
    }
    __syncthreads();  // q staged, and this block's cache writes visible to it

    // scores: 4 threads per position (a short context still spreads over the block); thread qd of a position takes
    // the 8-dim pieces qd, qd + 4, ...: its 4 threads read 64 contiguous bytes of k and q from 4 different banks
    constexpr int TPP = 4, PIECES = D / 8 / TPP, PER_PASS = CHUNK / TPP;
    const int qd = tid % TPP;
    for (int p0 = 0; p0 < n; p0 += PER_PASS) {
        const int ps = p0 + tid / TPP;
        float sc[GQ];
#pragma unroll
        for (int g = 0; g < GQ; g++) sc[g] = 0.0f;
        if (ps < n) {
            const uint4* kp = reinterpret_cast<const uint4*>(kc + ((size_t)kvh * max_len + start + ps) * D) + qd;
            uint4 u[PIECES];
#pragma unroll
            for (int j = 0; j < PIECES; j++) u[j] = kp[j * TPP];
#pragma unroll
            for (int j = 0; j < PIECES; j++) {
                const __half2* h = reinterpret_cast<const __half2*>(&u[j]);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float2 f = __half22float2(h[e]);
#pragma unroll
                    for (int g = 0; g < GQ; g++) {
                        const float2 qg = reinterpret_cast<const float2*>(q + g * D + (j * TPP + qd) * 8)[e];
                        sc[g] = fmaf(qg.y, f.y, fmaf(qg.x, f.x, sc[g]));
                    }
                }
            }
        }
#pragma unroll
        for (int g = 0; g < GQ; g++) {
            sc[g] += __shfl_xor_sync(0xffffffffu, sc[g], 1);
            sc[g] += __shfl_xor_sync(0xffffffffu, sc[g], 2);
            if (qd == 0 && ps < n) p[g * CHUNK + ps] = sc[g];
        }
    }
    __syncthreads();

    // softmax statistics per query head: warp w takes heads w, w + 4, ...
    const int warp = tid >> 5, lane = tid & 31;
    for (int g = warp; g < GQ; g += CHUNK / 32) {
        float m = NEG_INF;
        for (int i = lane; i < n; i += 32) m = fmaxf(m, p[g * CHUNK + i]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float l = 0.0f;
        for (int i = lane; i < CHUNK; i += 32) {
            const float e = i < n ? __expf(p[g * CHUNK + i] - m) : 0.0f;  // nothing past the position
            p[g * CHUNK + i] = e;
            l += e;
        }
        for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
        if (lane == 0) { mstat[g] = m; lstat[g] = l; }
    }
    __syncthreads();

    // output: thread = (position stream, pair of dims); streams meet in shared memory
    constexpr int PAIRS = D / 2, STREAMS = CHUNK / PAIRS;
    const int dp = tid % PAIRS, st = tid / PAIRS;
    float2 acc[GQ];
#pragma unroll
    for (int g = 0; g < GQ; g++) acc[g] = make_float2(0.0f, 0.0f);
    const __half2* vp = reinterpret_cast<const __half2*>(vc + ((size_t)kvh * max_len + start) * D) + dp;
    constexpr int U = 8;  // positions whose loads are in flight together
    for (int i0 = st; i0 < n; i0 += U * STREAMS) {
        float2 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = i0 + u * STREAMS;
            v[u] = i < n ? __half22float2(vp[(size_t)i * PAIRS]) : make_float2(0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = min(i0 + u * STREAMS, CHUNK - 1);  // past n: v is 0
#pragma unroll
            for (int g = 0; g < GQ; g++) {
                const float w = p[g * CHUNK + i];
                acc[g].x = fmaf(w, v[u].x, acc[g].x);
                acc[g].y = fmaf(w, v[u].y, acc[g].y);
            }
        }
    }
#pragma unroll
    for (int g = 0; g < GQ; g++)
        if (st > 0) red[((st - 1) * GQ + g) * PAIRS + dp] = acc[g];
    __syncthreads();
    if (st == 0) {
#pragma unroll
        for (int g = 0; g < GQ; g++) {
                float2 a = acc[g];
                for (int k = 1; k < STREAMS; k++) {
                    const float2 b = red[((k - 1) * GQ + g) * PAIRS + dp];
                    a.x += b.x;
                    a.y += b.y;
                }
                const int head = kvh * GQ + g;
                reinterpret_cast<float2*>(ws_o + ((size_t)head * n_chunks + chunk) * D)[dp] = a;
                if (dp == 0) {
                    ws_ml[(head * n_chunks + chunk) * 2] = mstat[g];
                    ws_ml[(head * n_chunks + chunk) * 2 + 1] = lstat[g];
                }
            }
    }
}

// out[head, :] = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c over the chunks up to the position. Block = head.
__global__ void attend_combine(const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
                               const long long* __restrict__ pos_p, __half* __restrict__ out, int n_chunks, int D) {
    wait_previous();
    start_next();
    const int head = blockIdx.x, used = (int)(*pos_p) / CHUNK + 1;
    const float* ml = ws_ml + (size_t)head * n_chunks * 2;
    float M = NEG_INF;
    for (int c = 0; c < used; c++) M = fmaxf(M, ml[2 * c]);
    float L = 0.0f;
    for (int c = 0; c < used; c++) L += __expf(ml[2 * c] - M) * ml[2 * c + 1];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.0f;
        for (int c = 0; c < used; c++) a += __expf(ml[2 * c] - M) * ws_o[((size_t)head * n_chunks + c) * D + d];
        out[head * D + d] = __float2half_rn(a / L);
    }
}

#define INST(D, GQ) template __global__ void attend_part<D, GQ>(const __half*, const float*, const float*, __half*, \
    __half*, const long long*, float*, float*, int, int, int, float);
#define INST_GQ(D) INST(D, 1) INST(D, 2) INST(D, 3) INST(D, 4) INST(D, 5) INST(D, 6) INST(D, 7) INST(D, 8)
INST_GQ(64)
INST_GQ(128)
