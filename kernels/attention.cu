// Attention of one new token (decode), fused with its RoPE and its KV-cache append, split over the context
// (flash-decoding): attend_part: block (kv head, split) takes a run of 128-position chunks of the context up to the
// position, rotates the query heads of its kv head, appends the new key and value when its run holds the new
// position, streams the run's chunks through shared memory (cp.async: each chunk's keys and values are one round
// trip to memory, the next chunk's keys load while this chunk's values are used) with an online softmax, and writes
// the run's softmax statistics and unnormalized output; attend_combine merges the runs per query head. Where one run
// covers the context (short contexts), that run writes the normalized output itself and the combine has nothing to
// do: one chain of dependent reads less per layer; where that run is one chunk, a block takes one query head (grid z,
// kernels/attention.py: H200, 8B W3 step 0.2-2.5% faster at positions 16-120). The position
// comes from device memory, so one captured CUDA graph serves every step: the runs are cut at run time, splits past
// the context exit at once (localllm/decode.py still captures a second graph for positions below one chunk, launched
// with one run and no attend_combine, a third below 2 chunks whose two runs o's GEMV merges (merge 2), and on sm_90 a
// fourth below 8 chunks, whose runs merge in their cluster: merge 1).
// Same math as the torch path (model.Block): q and k rounded
// to fp16 after rotate-half RoPE, scores and softmax in fp32, output rounded to fp16.
//
// BITS is the cache width. 16: fp16 keys and values. 8 or 4: kvquant.py's format, per (position, kv head) the codes
// packed in 32-bit words (code i of a word at bits BITS * i) and a half2 (scale s, zero z); a channel reads back as
// s * c + z. The appending block quantizes the new key and value as kvquant.quantize does (float32 arithmetic,
// fp16-rounded s and z, round half to even). Reading needs no dequantized copy: a score is s * (q . c) + z * sum(q),
// and the output sum_i p_i (s_i c_i + z_i) is sum_i (p_i s_i) c_i + sum_i p_i z_i, so the inner loops multiply codes.
#include <cuda_fp16.h>

#include "async_copy.cuh"
#include "pdl.cuh"
#include "runs.cuh"

constexpr int GQ_MAX = 8;    // query heads per kv head
constexpr int SPLITS_MAX = 1024;  // splits of the context per kv head (attend_combine's shared weights)
constexpr int CLUSTER_MAX = 8;    // runs merged in a cluster (the portable cluster size)
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


// Thread-block clusters (sm_90+): a kv head's runs launched as one cluster (kernels/attention.py, where the span needs
// at most CLUSTER_MAX runs) merge through each other's shared memory after a cluster barrier, instead of through
// memory and attend_combine: one kernel boundary less (H200, 8B W3 step with an 8192-token cache at positions
// 200-1000: 1.617-1.635 -> 1.590-1.604 ms; kernels/NOTES.md, session 73).
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// *p in the shared memory of the cluster's block `rank` (p: an address in this block's shared memory)
__device__ __forceinline__ float cluster_load(const float* p, int rank) {
#if __CUDA_ARCH__ >= 900
    unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p)), r;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(r));
    return v;
#else
    return *p;
#endif
}

// Shared memory of attend_part, in 32-bit words: q [GQ][D] (fp32, scaled), p [GQ][CHUNK] (scores, then weights), then
// the chunk's keys [CHUNK][KS] and values [CHUNK][RW] (cache words) and, for a quantized cache, two buffers of
// (key, value) (scale, zero) [2][2][CHUNK] (the next chunk's arrive while this chunk's are used); at the end the
// output streams' sums [STREAMS][GPP][D] reuse the tiles' space, GPP query heads at a time. kernels/attention.py
// sizes it alike.
template <int D, int BITS> struct Tiles {
    // attend_part's threads (its __launch_bounds__, which kernels/attention.py reads), so that a block's chain of
    // dependent steps (scores, softmax, the output pass) stays short: with 4 warps it was latency-bound. fp16 cache: 4
    // per channel (16 warps at D = 128); quantized caches 8 warps: their decode takes more registers, and 16 warps
    // left fewer blocks resident than the long contexts need (kernels/NOTES.md, session 21).
    static constexpr int NT = BITS == 16 ? 4 * D : 256;
    // blocks per SM to build for: at 16 bits and D = 128 two where a kv head has at most 4 query heads (64 registers,
    // 8-28 bytes spilled; ptxas chose 64 by itself for the 8B's 4 until the cluster merge's code tipped it to 76: one
    // block per SM, none beside a GEMV's), else none named (0: ptxas's own choice); quantized caches one, which keeps
    // ptxas from squeezing them into 64 registers with spills: the 8B's 8-bit cache decoded 9% slower per step that
    // way (H200, kernels/NOTES.md, session 46)
    static constexpr int minb(int gq) { return BITS == 16 ? (D == 128 && gq <= 4 ? 2 : 0) : 1; }
    static constexpr int RW = D * BITS / 32;    // 32-bit words per cache row
    static constexpr int WPP = BITS / 4;        // words per 8-channel piece of a key
    static constexpr int KS = RW + 4 * WPP;     // key row stride: a load phase's pieces (4 per position) hit distinct banks
    static constexpr int STREAMS = NT / RW < 16 ? NT / RW : 16;  // positions the output pass reads side by side
    static constexpr int SZ = BITS < 16 ? 4 * CHUNK : 0;
    static constexpr int WORDS = CHUNK * KS + CHUNK * RW + SZ;
    static constexpr int GPP = WORDS / (STREAMS * D);  // query heads whose sums the tiles' space holds (>= 1)
};

// Cache rows [lo, hi) of a chunk into shared memory: keys into the padded tile and both (scale, zero) rows into sz
// (keys = true), or values. Rows outside [lo, hi) keep what was there (never read).
template <int D, int BITS, bool KEYS>
__device__ __forceinline__ void fetch(unsigned s_tile, unsigned s_sz, const unsigned* __restrict__ cache,
                                      const __half2* __restrict__ ksz, const __half2* __restrict__ vsz, size_t row,
                                      int lo, int hi) {
    using T = Tiles<D, BITS>;
    constexpr int PR = T::RW / 4, STRIDE = KEYS ? T::KS : T::RW;  // 16-byte pieces per row
    for (int i = threadIdx.x; i < CHUNK * PR; i += T::NT) {
        const int r = i / PR, c = i % PR;
        cp_async16(s_tile + 4 * (r * STRIDE + 4 * c), cache + (row + r) * T::RW + 4 * c, r >= lo && r < hi);
    }
    if (KEYS && BITS < 16 && threadIdx.x < CHUNK) {
        const int r = threadIdx.x;
        cp_async4(s_sz + 4 * r, ksz + row + r, r >= lo && r < hi);
        cp_async4(s_sz + 4 * (CHUNK + r), vsz + row + r, r >= lo && r < hi);
    }
    cp_async_commit();
}

// The cluster's merge (attend_part with merge): attend_combine's arithmetic in its order, so the same bits. Run r's
// unnormalized outputs part[g][d] and statistics mstat[g], lstat[g] are read from the shared memory of the
// cluster's block r; output (g, d) (query head head0 + g) is merged by run (g D + d) / nt % count, one of the `count` runs
// that hold some of the context (every one of them calls this; the rest of the cluster has returned). Not inlined:
// its registers stay out of attend_part's allocation (64 at D = 128, two blocks per SM beside a GEMV's).
template <int D, int GQ>
__device__ __noinline__ void cluster_merge(const float* part, const float* mstat, const float* lstat,
                                           __half* __restrict__ out, int head0, int split, int count, int nt) {
    for (int i = split * nt + threadIdx.x; i < GQ * D; i += count * nt) {
        const int g = i / D, d = i % D;
        float m[CLUSTER_MAX], l[CLUSTER_MAX], o[CLUSTER_MAX];  // every run's loads in flight together
#pragma unroll
        for (int r = 0; r < CLUSTER_MAX; r++)
            if (r < count)
                m[r] = cluster_load(mstat + g, r), l[r] = cluster_load(lstat + g, r),
                o[r] = cluster_load(part + g * D + d, r);
        float M = NEG_INF;
#pragma unroll
        for (int r = 0; r < CLUSTER_MAX; r++) M = r < count ? fmaxf(M, m[r]) : M;
        // sum_r exp(m_r - M) l_r added as attend_combine's block_reduce adds it: a butterfly over a warp's lanes,
        // lane r holding run r's term (its levels 16 and 8 add zeros: at most 8 runs)
        static_assert(CLUSTER_MAX == 8, "the butterfly below starts at 4");
        float v[CLUSTER_MAX], a = 0.0f;
#pragma unroll
        for (int r = 0; r < CLUSTER_MAX; r++) {
            const float w = r < count ? __expf(m[r] - M) : 0.0f;
            v[r] = r < count ? fmaf(w, l[r], 0.0f) : 0.0f;
            a = r < count ? fmaf(w, o[r], a) : a;
        }
#pragma unroll
        for (int h = CLUSTER_MAX / 2; h > 0; h >>= 1)
#pragma unroll
            for (int r = 0; r < h; r++) v[r] = v[r] + v[r + h];
        out[(head0 + g) * D + d] = __float2half_rn(a / v[0]);
    }
}

// qkv: [H*D | KVH*D | KVH*D] of the new token; inv_freq: [D/2] RoPE frequencies; kc/vc: this layer's cache rows
// [KVH, max_len, D * BITS / 32] in 32-bit words; ksz/vsz: [KVH, max_len] (scale, zero), unused at 16 bits;
// ws_o [H, splits, D], ws_ml [H, splits, 2]: the runs' unnormalized outputs and (max, sum) of their softmax; out
// [H * D]: the output, written here where one run covers the context. merge: 0, the runs go to ws_o / ws_ml for
// attend_combine; 1, a cluster's runs merge in it; 2, the runs go to ws_o / ws_ml even where one run covers the
// context, and the next kernel, o's GEMV, merges them while it stages its input (gemv.cu, runs_o).
template <int D, int GQ, int BITS>
__global__ void __launch_bounds__(Tiles<D, BITS>::NT, Tiles<D, BITS>::minb(GQ)) attend_part(const __half* __restrict__ qkv,
                                                     const float* __restrict__ inv_freq, unsigned* __restrict__ kc,
                                                     unsigned* __restrict__ vc, __half2* __restrict__ ksz,
                                                     __half2* __restrict__ vsz, const long long* __restrict__ pos_p,
                                                     float* __restrict__ ws_o, float* __restrict__ ws_ml,
                                                     __half* __restrict__ out, int H,
                                                     int KVH, int max_len, float scale, int merge) {
    using T = Tiles<D, BITS>;
    constexpr bool QUANT = BITS < 16;
    constexpr int NT = T::NT, RW = T::RW, VPW = 32 / BITS, HALF = D / 2;
    // the position was written before the graph started and rows before it by earlier steps: this run's first chunk
    // is fetched before waiting for the kernel that computes qkv
    const int kvh = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    // grid z: the kv head's query heads in groups of GQ, one a block (kernels/attention.py splits them where one
    // chunk is the whole span: the short graph's attention on 4x the SMs); group 0 appends the new key and value to
    // the cache, the others keep theirs in their own tiles only (their run holds the new position in its first chunk)
    const int hg = blockIdx.z, head0 = kvh * (H / KVH) + hg * GQ;
    const int pos = (int)*pos_p;
    const Runs runs(pos, splits);
    const int used = runs.used, c0 = split * runs.per, c1 = min(used, c0 + runs.per), pc = pos / CHUNK;
    if (c0 >= used) {
        wait_previous();
        start_next();
        if (merge == 1) cluster_sync(), cluster_sync();  // the active runs merge meanwhile (none reads this block)
        return;
    }
    extern __shared__ float sm[];
    float* q = sm;              // [GQ][D]
    float* p = q + GQ * D;      // [GQ][CHUNK]
    unsigned* kt = reinterpret_cast<unsigned*>(p + GQ * CHUNK);  // [CHUNK][KS]
    unsigned* vt = kt + CHUNK * T::KS;                           // [CHUNK][RW]
    const __half2* szt = reinterpret_cast<const __half2*>(vt + CHUNK * RW);  // [2][2][CHUNK]
    float* red = reinterpret_cast<float*>(kt);                   // [STREAMS][GPP][D], after the last chunk
    const unsigned s_kt = (unsigned)__cvta_generic_to_shared(kt), s_vt = (unsigned)__cvta_generic_to_shared(vt);
    const unsigned s_sz = (unsigned)__cvta_generic_to_shared(szt);
    __shared__ float mstat[GQ_MAX], lstat[GQ_MAX], qsum[GQ_MAX], zsum[GQ_MAX], alpha[GQ_MAX];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const size_t row0 = (size_t)kvh * max_len;  // this kv head's first cache row
    auto rows = [&](int c) { return min(CHUNK, pos + 1 - c * CHUNK); };
    // the new position's row: this block appends it, and writes it into its own tiles as well (no round trip to
    // memory for what it just computed)
    const bool late = c0 == pc, append = c1 - 1 == pc;  // append: this run holds the new position
    const int r_new = pos - c0 * CHUNK;  // its row in the first chunk's tiles, where late
    fetch<D, BITS, true>(s_kt, s_sz, kc, ksz, vsz, row0 + c0 * CHUNK, 0, rows(c0) - late);
    fetch<D, BITS, false>(s_vt, 0, vc, ksz, vsz, row0 + c0 * CHUNK, 0, rows(c0) - late);
    // the rotation's cos and sin at the position (model.rope_tables: the fp32 angle pos * inv_freq), before the wait
    __shared__ float rc[HALF], rs[HALF];
    for (int d = tid; d < HALF; d += NT) {
        const float a = (float)pos * inv_freq[d];
        rc[d] = cosf(a), rs[d] = sinf(a);
    }
    __syncthreads();

    wait_previous();
    start_next();
    // the new token's q, k and v as this thread uses them, all loaded before any is used: one round trip to memory
    constexpr int QI = (GQ * HALF + NT - 1) / NT, KI = (HALF + NT - 1) / NT, VI = (D + NT - 1) / NT;
    const __half* k = qkv + H * D + kvh * D;
    const __half* v = qkv + (H + KVH) * D + kvh * D;
    __half qx[QI][2], kx[KI][2], vx[VI];
#pragma unroll
    for (int t = 0; t < QI; t++) {
        const int i = tid + t * NT, g = i / HALF, d = i % HALF;
        if (i < GQ * HALF) qx[t][0] = qkv[(head0 + g) * D + d], qx[t][1] = qkv[(head0 + g) * D + d + HALF];
    }
    if (append) {
#pragma unroll
        for (int t = 0; t < KI; t++)
            if (tid + t * NT < HALF) kx[t][0] = k[tid + t * NT], kx[t][1] = k[tid + t * NT + HALF];
#pragma unroll
        for (int t = 0; t < VI; t++)
            if (tid + t * NT < D) vx[t] = v[tid + t * NT];
    }
#pragma unroll
    for (int t = 0; t < QI; t++) {
        const int i = tid + t * NT, g = i / HALF, d = i % HALF;
        if (i < GQ * HALF) {
            const float c = rc[d], s = rs[d], x1 = __half2float(qx[t][0]), x2 = __half2float(qx[t][1]);
            q[g * D + d] = __half2float(__float2half_rn(x1 * c - x2 * s)) * scale;
            q[g * D + d + HALF] = __half2float(__float2half_rn(x2 * c + x1 * s)) * scale;
        }
    }
    if (tid < GQ) mstat[tid] = NEG_INF, lstat[tid] = 0.0f, zsum[tid] = 0.0f;
    if (append) {  // k (rotated) and v into the cache
        if constexpr (!QUANT) {
            __half* kd = reinterpret_cast<__half*>(kc) + (row0 + pos) * D;
            __half* vd = reinterpret_cast<__half*>(vc) + (row0 + pos) * D;
            __half* kn = reinterpret_cast<__half*>(kt + r_new * T::KS);  // used only where late
            __half* vn = reinterpret_cast<__half*>(vt + r_new * RW);
#pragma unroll
            for (int t = 0; t < KI; t++) {
                const int d = tid + t * NT;
                if (d < HALF) {
                    const float c = rc[d], s = rs[d], x1 = __half2float(kx[t][0]), x2 = __half2float(kx[t][1]);
                    const __half a = __float2half_rn(x1 * c - x2 * s), b = __float2half_rn(x2 * c + x1 * s);
                    if (hg == 0) kd[d] = a, kd[d + HALF] = b;
                    if (late) kn[d] = a, kn[d + HALF] = b;
                }
            }
#pragma unroll
            for (int t = 0; t < VI; t++) {
                const int d = tid + t * NT;
                if (d < D) {
                    if (hg == 0) vd[d] = vx[t];
                    if (late) vn[d] = vx[t];
                }
            }
        } else {
            __shared__ float fresh[2][D];  // the new key (rotated, fp16-rounded) and value
#pragma unroll
            for (int t = 0; t < KI; t++) {
                const int d = tid + t * NT;
                if (d < HALF) {
                    const float c = rc[d], s = rs[d], x1 = __half2float(kx[t][0]), x2 = __half2float(kx[t][1]);
                    fresh[0][d] = __half2float(__float2half_rn(x1 * c - x2 * s));
                    fresh[0][d + HALF] = __half2float(__float2half_rn(x2 * c + x1 * s));
                }
            }
#pragma unroll
            for (int t = 0; t < VI; t++)
                if (tid + t * NT < D) fresh[1][tid + t * NT] = __half2float(vx[t]);
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
                unsigned* tile = warp == 0 ? kt + r_new * T::KS : vt + r_new * RW;  // used only where late
                for (int w = lane; w < RW; w += 32) {
                    unsigned word = 0;
#pragma unroll
                    for (int e = 0; e < VPW; e++) {
                        const float c = s > 0.0f ? rintf(__fdiv_rn(x[w * VPW + e] - z, s)) : 0.0f;
                        word |= (unsigned)fminf(fmaxf(c, 0.0f), LEVELS) << (BITS * e);
                    }
                    if (hg == 0) row[w] = word;
                    if (late) tile[w] = word;
                }
                if (lane == 0) {
                    if (hg == 0) (warp == 0 ? ksz : vsz)[row0 + pos] = __halves2half2(sh, zh);
                    // the first chunk's (scale, zero) buffer: keys' at r, values' at CHUNK + r (fetch's places)
                    if (late) const_cast<__half2*>(szt)[warp * CHUNK + r_new] = __halves2half2(sh, zh);
                }
            }
        }
    }
    __syncthreads();  // q staged; the new row in this block's tiles (late), or visible to its later copies
    if constexpr (QUANT) {  // sum(q) per query head, for the zero points
        for (int g = warp; g < GQ; g += NT / 32) {
            float a = 0.0f;
            for (int d = lane; d < D; d += 32) a += q[g * D + d];
            for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (lane == 0) qsum[g] = a;
        }
    }

    // output: thread = (position stream, 32-bit word of the row); streams meet in shared memory at the end
    constexpr int STREAMS = T::STREAMS;
    const int wd = tid % RW, st = tid / RW;  // threads past STREAMS streams sit the output pass out
    float acc[GQ][VPW];
#pragma unroll
    for (int g = 0; g < GQ; g++)
#pragma unroll
        for (int e = 0; e < VPW; e++) acc[g][e] = 0.0f;

    for (int c = c0; c < c1; c++) {
        const int n = rows(c), buf = (c - c0) & 1;
        const __half2* ks = szt + buf * 2 * CHUNK;  // this chunk's key (scale, zero), then the values'
        const __half2* vs = ks + CHUNK;
        const bool next = c + 1 < c1;
        cp_async_wait<1>();  // the keys (the values may still be on their way)
        __syncthreads();

        // scores: 4 threads per position; thread qd of a position takes the 8-channel pieces qd, qd + 4, ... (BITS
        // bytes each): its 4 threads read contiguous bytes of the key row, and q from 4 different banks
        constexpr int TPP = 4, PIECES = D / 8 / TPP, PER_PASS = NT / TPP, WPP = T::WPP;
        using Piece = Words<WPP>;
        const int qd = tid % TPP;
        for (int p0 = 0; p0 < n; p0 += PER_PASS) {
            const int ps = p0 + tid / TPP;
            float sc[GQ];
#pragma unroll
            for (int g = 0; g < GQ; g++) sc[g] = 0.0f;
            if (ps < n) {
                const Piece* kp = reinterpret_cast<const Piece*>(kt + ps * T::KS) + qd;
#pragma unroll
                for (int j = 0; j < PIECES; j++) {
                    const Piece u = kp[j * TPP];
                    float f[8];
#pragma unroll
                    for (int w = 0; w < WPP; w++) word_values<BITS>(u.w[w], f + w * VPW);
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
            float2 sz = make_float2(1.0f, 0.0f);
            if (QUANT && ps < n) sz = __half22float2(ks[ps]);
#pragma unroll
            for (int g = 0; g < GQ; g++) {
                sc[g] += __shfl_xor_sync(0xffffffffu, sc[g], 1);
                sc[g] += __shfl_xor_sync(0xffffffffu, sc[g], 2);
                if (qd == 0 && ps < n) p[g * CHUNK + ps] = QUANT ? fmaf(sz.x, sc[g], sz.y * qsum[g]) : sc[g];
            }
        }
        __syncthreads();  // the key tile is free: the next chunk's keys (and scales) start loading
        if (next) fetch<D, BITS, true>(s_kt, s_sz + 4 * 2 * CHUNK * (buf ^ 1), kc, ksz, vsz,
                                       row0 + (c + 1) * CHUNK, 0, rows(c + 1));

        // online softmax per query head: warp w takes heads w, w + NT / 32, ...; the running max moves to m and what was
        // summed so far is scaled by alpha = exp(m_old - m); quantized values: p_i becomes p_i s_i, and
        // sum_i p_i z_i is kept per head
        for (int g = warp; g < GQ; g += NT / 32) {
            float m = mstat[g];
            const float m_old = m;
            for (int i = lane; i < n; i += 32) m = fmaxf(m, p[g * CHUNK + i]);
            for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            float l = 0.0f, zs = 0.0f;
            for (int i = lane; i < CHUNK; i += 32) {
                float e = i < n ? __expf(p[g * CHUNK + i] - m) : 0.0f;  // nothing past the position
                l += e;
                if (QUANT && i < n) {
                    const float2 v = __half22float2(vs[i]);
                    zs = fmaf(e, v.y, zs);
                    e *= v.x;
                }
                p[g * CHUNK + i] = e;
            }
            for (int o = 16; o > 0; o >>= 1) {
                l += __shfl_xor_sync(0xffffffffu, l, o);
                zs += __shfl_xor_sync(0xffffffffu, zs, o);
            }
            if (lane == 0) {
                const float a = __expf(m_old - m);  // 0 at the first chunk (m_old = -inf)
                mstat[g] = m, lstat[g] = fmaf(lstat[g], a, l), zsum[g] = fmaf(zsum[g], a, zs), alpha[g] = a;
            }
        }
        if (next)
            cp_async_wait<1>();  // the values (the next keys may still be on their way)
        else
            cp_async_wait<0>();
        __syncthreads();

        const unsigned* vp = vt + wd;
#pragma unroll
        for (int g = 0; g < GQ; g++) {
            const float a = alpha[g];
#pragma unroll
            for (int e = 0; e < VPW; e++) acc[g][e] *= a;
        }
        constexpr int U = 4;
        for (int i0 = st < STREAMS ? st : n; i0 < n; i0 += U * STREAMS) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int i = i0 + u * STREAMS;
                if (i < n) {
                    float f[VPW];
                    word_values<BITS>(vp[i * RW], f);
#pragma unroll
                    for (int g = 0; g < GQ; g++) {
                        const float w = p[g * CHUNK + i];
#pragma unroll
                        for (int e = 0; e < VPW; e++) acc[g][e] = fmaf(w, f[e], acc[g][e]);
                    }
                }
            }
        }
        __syncthreads();  // the value tile (and p) are free
        if (next) fetch<D, BITS, false>(s_vt, 0, vc, ksz, vsz, row0 + (c + 1) * CHUNK, 0, rows(c + 1));
    }

    // No copies are in flight after the last chunk: the tiles' space holds the streams' sums, GPP heads at a time,
    // and thread i adds up output i of them.
    // the only run: it writes the output itself (attend_combine's result for one run, same bits), unless the next GEMV
    // merges the runs (merge 2)
    const bool alone = runs.count == 1 && merge != 2;
    static_assert(T::GPP >= 1, "the tiles' space holds one head's sums");
    constexpr int GPP = T::GPP < GQ ? T::GPP : GQ;
    for (int g0 = 0; g0 < GQ; g0 += GPP) {
        if (st < STREAMS)
#pragma unroll
            for (int g = 0; g < GQ; g++)
                if (g >= g0 && g < g0 + GPP)
#pragma unroll
                    for (int e = 0; e < VPW; e++) red[(st * GPP + g - g0) * D + wd * VPW + e] = acc[g][e];
        __syncthreads();
        for (int i = tid; i < GPP * D && g0 + i / D < GQ; i += NT) {
            const int g = g0 + i / D, d = i % D, head = head0 + g;
            float a = 0.0f;
#pragma unroll
            for (int k = 0; k < STREAMS; k++) a += red[k * GPP * D + i];
            a = QUANT ? a + zsum[g] : a;
            if (alone)
                out[head * D + d] = __float2half_rn(a / lstat[g]);
            else if (merge == 1)
                q[g * D + d] = a;  // (q is spent) for the cluster's merge below
            else
                ws_o[((size_t)head * splits + split) * D + d] = a;
            if (d == 0 && merge != 1) {
                ws_ml[(head * splits + split) * 2] = mstat[g];
                ws_ml[(head * splits + split) * 2 + 1] = lstat[g];
            }
        }
        __syncthreads();  // red is free again
    }
    if (merge != 1) return;
    cluster_sync();  // every run's outputs and statistics are in place
    if (!alone) cluster_merge<D, GQ>(q, mstat, lstat, out, head0, split, runs.count, NT);
    cluster_sync();  // no block leaves while another reads its shared memory
}

// A value reduced over the block (max or sum), returned to every thread.
template <bool MAX> __device__ __forceinline__ float block_reduce(float v, float* tmp) {
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? fmaxf(v, w) : v + w;
    }
    const int warps = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0) tmp[threadIdx.x >> 5] = v;
    __syncthreads();
    v = tmp[0];
    for (int w = 1; w < warps; w++) v = MAX ? fmaxf(v, tmp[w]) : v + tmp[w];
    __syncthreads();  // tmp is free again
    return v;
}

// out[head, :] = sum_r exp(m_r - M) o_r / sum_r exp(m_r - M) l_r over the runs up to the position. Block = head,
// D threads.
__global__ void attend_combine(const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
                               const long long* __restrict__ pos_p, __half* __restrict__ out, int splits, int D) {
    __shared__ float w[SPLITS_MAX], tmp[32];
    const int head = blockIdx.x, runs = Runs((int)*pos_p, splits).count;
    // The next kernel (o's GEMV) may launch now and prefetch its weights while the attention runs: it waits for this
    // kernel before it reads the output. The position was written before the graph started.
    start_next();
    wait_previous();
    if (runs == 1) return;  // attend_part wrote the output
    const float* ml = ws_ml + (size_t)head * splits * 2;
    const float* o = ws_o + (size_t)head * splits * D;
    // The first R runs' outputs go into registers together with the statistics: one round trip for all the loads
    // instead of one for the statistics and then several for the outputs.
    constexpr int R = 32;
    float ov[R];
#pragma unroll
    for (int r = 0; r < R; r++) ov[r] = r < runs && threadIdx.x < D ? o[r * D + threadIdx.x] : 0.0f;
    float m = NEG_INF;
    for (int r = threadIdx.x; r < runs; r += blockDim.x) m = fmaxf(m, ml[2 * r]);
    const float M = block_reduce<true>(m, tmp);
    float l = 0.0f;
    for (int r = threadIdx.x; r < runs; r += blockDim.x) {
        const float e = __expf(ml[2 * r] - M);
        w[r] = e;
        l = fmaf(e, ml[2 * r + 1], l);
    }
    const float L = block_reduce<false>(l, tmp);  // its barrier also publishes w
    if (threadIdx.x < D) {  // one thread per channel (blockDim = D)
        const int d = threadIdx.x;
        float a = 0.0f;
#pragma unroll
        for (int r = 0; r < R; r++) a = r < runs ? fmaf(w[r], ov[r], a) : a;
        for (int r = R; r < runs; r++) a = fmaf(w[r], o[r * D + d], a);
        out[head * D + d] = __float2half_rn(a / L);
    }
}

#ifndef __CUDACC_RTC__  // nvcc (resource checks) builds every variant; NVRTC only what kernels/cuda.py asks for
#define INST(D, GQ, B) template __global__ void attend_part<D, GQ, B>(const __half*, const float*, unsigned*, \
    unsigned*, __half2*, __half2*, const long long*, float*, float*, __half*, int, int, int, float, int);
#define INST_GQ(D, B) INST(D, 1, B) INST(D, 2, B) INST(D, 3, B) INST(D, 4, B) INST(D, 5, B) INST(D, 6, B) \
    INST(D, 7, B) INST(D, 8, B)
#define INST_BITS(D) INST_GQ(D, 16) INST_GQ(D, 8) INST_GQ(D, 4)
INST_BITS(64)
INST_BITS(128)
#endif
