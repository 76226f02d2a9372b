// Attention of one new token (decode), fused with its RoPE and its KV-cache append, split over the context:
// attend_part: block (kv head, 128-position chunk) rotates the query heads of its kv head, appends the new key and
// value when the chunk holds the new position, and writes its chunk's softmax statistics and unnormalized output;
// attend_combine merges the chunks per query head. The position comes from device memory, so one captured CUDA
// graph serves every step; chunks past it exit at once. Same math as the torch path (model.Block): q and k rounded
// to fp16 after rotate-half RoPE, scores and softmax in fp32, output rounded to fp16.
//
// BITS is the cache width. 16: fp16 keys and values. 8 or 4: kvquant.py's format, per (position, kv head) the codes
// packed in 32-bit words (code i of a word at bits BITS * i) and a half2 (scale s, zero z); a channel reads back as
// s * c + z. The appending block quantizes the new key and value as kvquant.quantize does (float32 arithmetic,
// fp16-rounded s and z, round half to even). Reading needs no dequantized copy: a score is s * (q . c) + z * sum(q),
// and the output sum_i p_i (s_i c_i + z_i) is sum_i (p_i s_i) c_i + sum_i p_i z_i, so the inner loops multiply codes.
#include <cuda_fp16.h>

#include "pdl.cuh"

constexpr int CHUNK = 128;  // positions per block (and threads per block)
constexpr int GQ_MAX = 8;   // query heads per kv head
#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no INFINITY
#define POS_INF __int_as_float(0x7f800000)

template <int N> struct alignas(4 * N) Words { unsigned w[N]; };  // one vector load of N 32-bit words

__device__ __forceinline__ float2 codes_at(unsigned w, int shift, unsigned mask) {
    // two codes (at bits shift and 16 + shift, each < 1024) as floats: 0x6400 | c is the fp16 1024 + c, exactly
    const unsigned h = ((w >> shift) & mask) | 0x64006400u;
    return __half22float2(__hsub2(*reinterpret_cast<const __half2*>(&h), __float2half2_rn(1024.0f)));
}

// The values of one 32-bit cache word in channel order: 16 bits: 2 fp16 values; 8 / 4 bits: 4 / 8 codes.
template <int BITS> __device__ __forceinline__ void word_values(unsigned w, float* f) {
    if constexpr (BITS == 16) {
        const float2 t = __half22float2(*reinterpret_cast<const __half2*>(&w));
        f[0] = t.x, f[1] = t.y;
    } else if constexpr (BITS == 8) {
        const float2 a = codes_at(w, 0, 0x00ff00ffu), b = codes_at(w, 8, 0x00ff00ffu);  // codes (0, 2), (1, 3)
        f[0] = a.x, f[1] = b.x, f[2] = a.y, f[3] = b.y;
    } else {
#pragma unroll
        for (int s = 0; s < 4; s++) {  // codes (s, s + 4)
            const float2 t = codes_at(w, 4 * s, 0x000f000fu);
            f[s] = t.x, f[s + 4] = t.y;
        }
    }
}

// qkv: [H*D | KVH*D | KVH*D] of the new token; cos/sin: [D/2] at its position; kc/vc: this layer's cache rows
// [KVH, max_len, D * BITS / 32] in 32-bit words; ksz/vsz: [KVH, max_len] (scale, zero), unused at 16 bits. Shared
// memory (fp32): q [GQ_MAX][D], p [GQ_MAX][CHUNK], then the output streams' partial sums [STREAMS - 1][GQ_MAX][D].
template <int D, int GQ, int BITS>
__global__ void __launch_bounds__(CHUNK) attend_part(const __half* __restrict__ qkv, const float* __restrict__ cos,
                                                     const float* __restrict__ sin, unsigned* __restrict__ kc,
                                                     unsigned* __restrict__ vc, __half2* __restrict__ ksz,
                                                     __half2* __restrict__ vsz, const long long* __restrict__ pos_p,
                                                     float* __restrict__ ws_o, float* __restrict__ ws_ml, int H,
                                                     int KVH, int max_len, float scale) {
    constexpr bool QUANT = BITS < 16;
    constexpr int RW = D * BITS / 32;  // 32-bit words per cache row
    constexpr int VPW = 32 / BITS;     // values per word
    wait_previous();
    start_next();
    const int kvh = blockIdx.x, chunk = blockIdx.y, n_chunks = gridDim.y;
    const int pos = (int)*pos_p, start = chunk * CHUNK;
    if (start > pos) return;
    const int n = min(CHUNK, pos + 1 - start);
    extern __shared__ float sm[];
    float* q = sm;                         // [GQ][D]
    float* p = q + GQ_MAX * D;             // [GQ][CHUNK]
    float* red = p + GQ_MAX * CHUNK;       // [STREAMS - 1][GQ][D]
    __shared__ float mstat[GQ_MAX], lstat[GQ_MAX], qsum[GQ_MAX], zsum[GQ_MAX];
    constexpr int HALF = D / 2;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const size_t row0 = (size_t)kvh * max_len;  // this kv head's first cache row

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
        if constexpr (!QUANT) {
            __half* kd = reinterpret_cast<__half*>(kc) + (row0 + pos) * D;
            __half* vd = reinterpret_cast<__half*>(vc) + (row0 + pos) * D;
            for (int d = tid; d < HALF; d += CHUNK) {
                const float c = cos[d], s = sin[d], x1 = __half2float(k[d]), x2 = __half2float(k[d + HALF]);
                kd[d] = __float2half_rn(x1 * c - x2 * s);
                kd[d + HALF] = __float2half_rn(x2 * c + x1 * s);
            }
            for (int d = tid; d < D; d += CHUNK) vd[d] = v[d];
        } else {
            __shared__ float fresh[2][D];  // the new key (rotated, fp16-rounded) and value
            for (int d = tid; d < HALF; d += CHUNK) {
                const float c = cos[d], s = sin[d], x1 = __half2float(k[d]), x2 = __half2float(k[d + HALF]);
                fresh[0][d] = __half2float(__float2half_rn(x1 * c - x2 * s));
                fresh[0][d + HALF] = __half2float(__float2half_rn(x2 * c + x1 * s));
            }
            for (int d = tid; d < D; d += CHUNK) fresh[1][d] = __half2float(v[d]);
            __syncthreads();
            if (warp < 2) {  // warp 0 quantizes the key, warp 1 the value
                const float* x = fresh[warp];
                float lo = POS_INF, hi = NEG_INF;
                for (int d = lane; d < D; d += 32) lo = fminf(lo, x[d]), hi = fmaxf(hi, x[d]);
                for (int o = 16; o > 0; o >>= 1) {
                    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
                    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
                }
                constexpr float LEVELS = (1 << BITS) - 1;
                const __half zh = __float2half_rn(lo), sh = __float2half_rn(__fdiv_rn(hi - __half2float(zh), LEVELS));
                const float z = __half2float(zh), s = __half2float(sh);
                unsigned* row = (warp == 0 ? kc : vc) + (row0 + pos) * RW;
                for (int w = lane; w < RW; w += 32) {
                    unsigned word = 0;
#pragma unroll
                    for (int e = 0; e < VPW; e++) {
                        const float c = s > 0.0f ? rintf(__fdiv_rn(x[w * VPW + e] - z, s)) : 0.0f;
                        word |= (unsigned)fminf(fmaxf(c, 0.0f), LEVELS) << (BITS * e);
                    }
                    row[w] = word;
                }
                if (lane == 0) (warp == 0 ? ksz : vsz)[row0 + pos] = __halves2half2(sh, zh);
            }
        }
    }
    __syncthreads();  // q staged, and this block's cache writes visible to it
    if constexpr (QUANT) {  // sum(q) per query head, for the zero points
        for (int g = warp; g < GQ; g += CHUNK / 32) {
            float a = 0.0f;
            for (int d = lane; d < D; d += 32) a += q[g * D + d];
            for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (lane == 0) qsum[g] = a;
        }
        __syncthreads();
    }

    // scores: 4 threads per position (a short context still spreads over the block); thread qd of a position takes
    // the 8-channel pieces qd, qd + 4, ... (BITS bytes each): its 4 threads read contiguous bytes of k, and q from
    // 4 different banks
    constexpr int TPP = 4, PIECES = D / 8 / TPP, PER_PASS = CHUNK / TPP, WPP = BITS / 4;
    using Piece = Words<WPP>;
    const int qd = tid % TPP;
    for (int p0 = 0; p0 < n; p0 += PER_PASS) {
        const int ps = p0 + tid / TPP;
        float sc[GQ];
#pragma unroll
        for (int g = 0; g < GQ; g++) sc[g] = 0.0f;
        float2 sz = make_float2(1.0f, 0.0f);
        if (ps < n) {
            const Piece* kp = reinterpret_cast<const Piece*>(kc + (row0 + start + ps) * RW) + qd;
            Piece u[PIECES];
#pragma unroll
            for (int j = 0; j < PIECES; j++) u[j] = kp[j * TPP];
            if constexpr (QUANT) sz = __half22float2(ksz[row0 + start + ps]);
#pragma unroll
            for (int j = 0; j < PIECES; j++) {
                float f[8];
#pragma unroll
                for (int w = 0; w < WPP; w++) word_values<BITS>(u[j].w[w], f + w * VPW);
#pragma unroll
                for (int g = 0; g < GQ; g++) {
                    const float4* qg = reinterpret_cast<const float4*>(q + g * D + (j * TPP + qd) * 8);
                    const float4 a = qg[0], b = qg[1];
                    float s = sc[g];
                    s = fmaf(a.x, f[0], s), s = fmaf(a.y, f[1], s), s = fmaf(a.z, f[2], s), s = fmaf(a.w, f[3], s);
                    s = fmaf(b.x, f[4], s), s = fmaf(b.y, f[5], s), s = fmaf(b.z, f[6], s), s = fmaf(b.w, f[7], s);
                    sc[g] = s;
                }
            }
        }
#pragma unroll
        for (int g = 0; g < GQ; g++) {
            sc[g] += __shfl_xor_sync(0xffffffffu, sc[g], 1);
            sc[g] += __shfl_xor_sync(0xffffffffu, sc[g], 2);
            if (qd == 0 && ps < n) p[g * CHUNK + ps] = QUANT ? fmaf(sz.x, sc[g], sz.y * qsum[g]) : sc[g];
        }
    }
    __syncthreads();

    // softmax statistics per query head: warp w takes heads w, w + 4, ...; quantized values: p_i becomes p_i s_i,
    // and sum_i p_i z_i is kept per head
    for (int g = warp; g < GQ; g += CHUNK / 32) {
        float m = NEG_INF;
        for (int i = lane; i < n; i += 32) m = fmaxf(m, p[g * CHUNK + i]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float l = 0.0f, zs = 0.0f;
        for (int i = lane; i < CHUNK; i += 32) {
            float e = i < n ? __expf(p[g * CHUNK + i] - m) : 0.0f;  // nothing past the position
            l += e;
            if (QUANT && i < n) {
                const float2 vs = __half22float2(vsz[row0 + start + i]);
                zs = fmaf(e, vs.y, zs);
                e *= vs.x;
            }
            p[g * CHUNK + i] = e;
        }
        for (int o = 16; o > 0; o >>= 1) {
            l += __shfl_xor_sync(0xffffffffu, l, o);
            zs += __shfl_xor_sync(0xffffffffu, zs, o);
        }
        if (lane == 0) mstat[g] = m, lstat[g] = l, zsum[g] = zs;
    }
    __syncthreads();

    // output: thread = (position stream, 32-bit word of the row); streams meet in shared memory
    constexpr int STREAMS = CHUNK / RW;
    const int wd = tid % RW, st = tid / RW;
    float acc[GQ][VPW];
#pragma unroll
    for (int g = 0; g < GQ; g++)
#pragma unroll
        for (int e = 0; e < VPW; e++) acc[g][e] = 0.0f;
    const unsigned* vp = vc + (row0 + start) * RW + wd;
    constexpr int U = 8;  // positions whose loads are in flight together
    for (int i0 = st; i0 < n; i0 += U * STREAMS) {
        unsigned v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = i0 + u * STREAMS;
            v[u] = i < n ? vp[(size_t)i * RW] : 0u;  // past n: zero values (or codes)
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = min(i0 + u * STREAMS, CHUNK - 1);
            float f[VPW];
            word_values<BITS>(v[u], f);
#pragma unroll
            for (int g = 0; g < GQ; g++) {
                const float w = p[g * CHUNK + i];
#pragma unroll
                for (int e = 0; e < VPW; e++) acc[g][e] = fmaf(w, f[e], acc[g][e]);
            }
        }
    }
    if (st > 0) {
#pragma unroll
        for (int g = 0; g < GQ; g++)
#pragma unroll
            for (int e = 0; e < VPW; e++) red[((st - 1) * GQ + g) * D + wd * VPW + e] = acc[g][e];
    }
    __syncthreads();
    if (st == 0) {
#pragma unroll
        for (int g = 0; g < GQ; g++) {
            const int head = kvh * GQ + g;
            float* out = ws_o + ((size_t)head * n_chunks + chunk) * D + wd * VPW;
#pragma unroll
            for (int e = 0; e < VPW; e++) {
                float a = acc[g][e];
                for (int k = 1; k < STREAMS; k++) a += red[((k - 1) * GQ + g) * D + wd * VPW + e];
                out[e] = QUANT ? a + zsum[g] : a;
            }
            if (wd == 0) {
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

#define INST(D, GQ, B) template __global__ void attend_part<D, GQ, B>(const __half*, const float*, const float*, \
    unsigned*, unsigned*, __half2*, __half2*, const long long*, float*, float*, int, int, int, float);
#define INST_GQ(D, B) INST(D, 1, B) INST(D, 2, B) INST(D, 3, B) INST(D, 4, B) INST(D, 5, B) INST(D, 6, B) \
    INST(D, 7, B) INST(D, 8, B)
#define INST_BITS(D) INST_GQ(D, 16) INST_GQ(D, 8) INST_GQ(D, 4)
INST_BITS(64)
INST_BITS(128)
