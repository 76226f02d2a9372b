// QDEC dynamic error compensation inside the GEMV (gemv.cu, QW > 0): y = W_hat x + R_hat[:, S] x[S].
//
// The first n_tb blocks of the grid compensate; the others stream the weights. A compensating block takes whole
// 1024-channel chunks (blockIdx.x, + n_tb, ...), or with n_tb = chunks x p one part of one chunk's outputs (p parts of
// whole 256-output segments; each part selects the chunk's channels itself). For each, right after staging x, its
// streaming warps select the chunk's k channels (approximate top-k, qdec.select_approx: 32 buckets from b0 and b15,
// whole buckets from the top, the boundary bucket in the pseudo-random order of qdec.boundary_order); then all its
// warps read those channels' residual rows straight from pinned host memory (zero-copy: a warp reads 128 contiguous
// bytes, 256 codes, per row and segment, all of a warp's reads in flight together), multiply by x[S], store the chunk's
// partial sums (fp32, one thread per output, rows in a fixed order) to a global buffer and raise the chunk's flag.
// Why separate blocks: zero-copy reads and the selection slow down a block that also streams weights (its reads
// wait behind the PCIe ones, its warps lose issue slots), and the grid's time is its slowest block's.
// Every streaming block's QDEC warps fetch the residual scales of the block's outputs (cp.async at kernel start).
// When its tiles are done, a block waits for every chunk's flag and adds scale * the partials to its fp32 results
// before the one rounding to fp16. So: no grid-wide sync, no atomics on y, the same bits on every run and for
// every n_tb, and nothing but the partials and flags in GPU memory.
//
// Flags carry a sequence number: each block takes a ticket from the layer's arrival counter when it starts; with a
// fixed grid, ticket / grid + 1 numbers the calls of this layer, so flags never need resetting.
#pragma once

// Profiling aid (scripts/qdec_timeline.py compiles with -DQDEC_MARKS, also in its chain mode): globaltimer stamps of a
// block's phases, for each of a block's last 8 calls (slot = its calls since the script zeroed qdec_mark_calls, mod 8).
#ifdef QDEC_MARKS
__device__ unsigned long long qdec_marks[8 * 1024 * 16];  // [slot][block][mark]
__device__ unsigned int qdec_mark_calls[1024];
__shared__ unsigned int qdec_mark_slot;  // set by thread 0 at the block's start (QDEC_MARK_START)
#define QDEC_MARK_START() (qdec_mark_slot = atomicAdd(qdec_mark_calls + blockIdx.x, 1u) & 7u)
#define QDEC_MARK(i)                                                                              \
    do {                                                                                          \
        unsigned long long t;                                                                     \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));                                     \
        qdec_marks[(qdec_mark_slot * 1024 + blockIdx.x) * 16 + (i)] = t;                           \
    } while (0)
#else
#define QDEC_MARK_START()
#define QDEC_MARK(i)
#endif

constexpr int QDEC_CHUNK = 1024;
constexpr int QDEC_SEG = 256;  // outputs per segment: 32 lanes x one word of 8 codes

__device__ __forceinline__ uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h ^ (h >> 16);
}

// The fp16 bits of channel ch of x as the GEMV stages it (B-fragment order, see the staging loop in gemv.cu).
__device__ __forceinline__ uint32_t staged_x(const uint32_t* xs, int ch) {
    const int s = ch >> 6, w = (ch & 63) >> 1, m = w >> 3, r = w & 7;
    const uint32_t word = xs[s * 32 + 8 * (r & 3) + 4 * (m >> 1) + 2 * (m & 1) + (r >> 2)];
    return (ch & 1) ? word >> 16 : word & 0xFFFFu;
}

// qdec.bucket_index, in the same float32 operations (no contraction into fma). Both ranges' buckets are computed and
// one is picked: without branches a selection takes 7% fewer cycles at 16 warps, 15% at 8 (H200, kernels/NOTES.md).
// A NaN a falls through both comparisons to the lower range, whose clamp makes it 0: bucket 16.
__device__ __forceinline__ int bucket_of(float a, float b0, float b15, float inv_hi, float inv_lo) {
    const int hi = 1 + (int)fminf(fmaxf(floorf(__fmul_rn(__fsub_rn(b0, a), inv_hi)), 0.0f), 14.0f);
    const int lo = 16 + (int)fminf(fmaxf(floorf(__fmul_rn(__fsub_rn(b15, a), inv_lo)), 0.0f), 15.0f);
    return a > b0 ? 0 : a >= b15 ? hi : lo;  // beyond the calibration's largest |x|: bucket 0 alone
}

// Shared scratch of the selection: zeroed by the QDEC warps before the block's staging barrier.
struct QdecScratch {
    int hist[32];     // channels per bucket
    uint32_t hsum;    // sum of the channels' hashes
    int wtot[31];     // per selecting warp: (whole-bucket channels << 16) + boundary-bucket channels
};

// Select chunk c's k channels with the block's first NT threads (the streaming warps; they sync on named barrier
// 3, so the QDEC warps are free): sel_idx[0..k) (global channel index) and sel_x[0..k) (x as float), in priority
// order. The caller syncs the block before reading them. bk: 1024 bytes.
//   1. every channel's bucket (qdec.bucket_index), a histogram (bit-plane ballots, one shared atomic per warp and
//      bucket) and the chunk's hash (qdec.boundary_order's seed);
//   2. every warp derives the boundary bucket B, how many of it to take (need) and the priority permutation
//      p(i) = (i * A + off) mod 1024; thread u walks priorities [u * PP, u * PP + PP) and one packed prefix sum in
//      priority order counts, for each channel, the whole-bucket and boundary channels before it: a whole-bucket
//      channel lands at lt + min(eq, need), a boundary one is taken while eq < need, at lt + eq.
template <int NT>
__device__ void qdec_select(const uint32_t* xs, int c, int size, int k, float b0, float b15, float inv_hi,
                            float inv_lo, unsigned char* bk, QdecScratch* sc, int* sel_idx, float* sel_x) {
    static_assert(NT / 32 <= 31, "wtot holds 31 warps");
    constexpr int PP = QDEC_CHUNK / NT;
    const int u = threadIdx.x, lane = u & 31, w = u >> 5;
    uint32_t h = 0;
    int count = 0;  // lane l counts bucket l
#pragma unroll
    for (int j = 0; j < PP; j++) {
        const int i = j * NT + u;
        const bool valid = i < size;
        const uint32_t bits = valid ? staged_x(xs, c * QDEC_CHUNK + i) : 0u;
        const int b = bucket_of(fabsf(__half2float(__ushort_as_half((unsigned short)bits))), b0, b15, inv_hi, inv_lo);
        bk[i] = (unsigned char)b;
        h += valid ? fmix32(((uint32_t)i << 16) | bits) : 0u;
        // histogram from bit planes: lane l counts the lanes whose bucket's 5 bits spell l
        uint32_t m = __ballot_sync(0xffffffffu, valid);
#pragma unroll
        for (int bit = 0; bit < 5; bit++) {
            const uint32_t plane = __ballot_sync(0xffffffffu, (b >> bit) & 1);
            m &= (lane >> bit) & 1 ? plane : ~plane;
        }
        count += __popc(m);
    }
    h = __reduce_add_sync(0xffffffffu, h);  // (REDUX, one instruction: 6% of a selection against five shuffles)
    if (count) atomicAdd(&sc->hist[lane], count);
    if (lane == 0) atomicAdd(&sc->hsum, h);
    asm volatile("bar.sync 3, %0;\n" ::"n"(NT) : "memory");
    if (u == 0) QDEC_MARK(10);

    int cum = sc->hist[lane];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, cum, d);
        if (lane >= d) cum += t;
    }
    const int B = __popc(__ballot_sync(0xffffffffu, cum <= k));
    const int need = k - (B > 0 ? __shfl_sync(0xffffffffu, cum, max(B - 1, 0)) : 0);
    const uint32_t seed = fmix32(sc->hsum);
    const uint32_t A = 2u * (seed & 511u) + 1u, off = (seed >> 9) & 1023u;
    uint32_t Ainv = A;  // A * Ainv = 1 mod 2^32, so mod 1024 too (Newton: each step doubles the correct bits)
#pragma unroll
    for (int it = 0; it < 4; it++) Ainv *= 2u - A * Ainv;

    int ib[PP];  // (channel << 8) | bucket, in priority order; bucket 255: no channel
    int v = 0;
#pragma unroll
    for (int e = 0; e < PP; e++) {
        const int i = (int)(((uint32_t)(u * PP + e) - off) * Ainv & 1023u);
        ib[e] = i < size ? (i << 8) | bk[i] : 255;
        v += (((ib[e] & 255) < B) << 16) + ((ib[e] & 255) == B);
    }
    int inc = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, inc, d);
        if (lane >= d) inc += t;
    }
    if (lane == 31) sc->wtot[w] = inc;
    asm volatile("bar.sync 3, %0;\n" ::"n"(NT) : "memory");
    if (u == 0) QDEC_MARK(11);
    if (u < 32) sc->hist[u] = 0;  // every warp has read the counters: clear them for the block's next chunk
    if (u == 0) sc->hsum = 0;
    const int before = (int)__reduce_add_sync(0xffffffffu, lane < w ? (uint32_t)sc->wtot[lane] : 0u);
    int lt = (before + inc - v) >> 16, eq = (before + inc - v) & 0xFFFF;
#pragma unroll
    for (int e = 0; e < PP; e++) {
        const int b = ib[e] & 255;
        const int pos = b < B ? lt + min(eq, need) : b == B && eq < need ? lt + eq : -1;
        if (pos >= 0) {
            const int ch = c * QDEC_CHUNK + (ib[e] >> 8);
            sel_idx[pos] = ch;
            sel_x[pos] = __half2float(__ushort_as_half((unsigned short)staged_x(xs, ch)));
        }
        lt += b < B;
        eq += b == B;
    }
}

// part[n] = sum_r q[sel_r, n] * x[sel_r] (unscaled) for the outputs n of segments [g0, g1), by QW warps (u: thread
// index among them); rq: the residual codes in pinned host memory, row = input channel, N / 8 words.
template <int QW>
__device__ void qdec_fetch(const uint32_t* rq, float* part, int N, int g0, int g1, int k, int u, const int* sel_idx,
                           const float* sel_x) {
    const int lane = u & 31, w = u >> 5, words = N / 8;
    constexpr int U = 16;  // reads in flight per thread
    const int nseg = g1 - g0 > w ? (g1 - g0 - w + QW - 1) / QW : 0;  // this warp's segments: g0 + w + QW j
    const int P = nseg * k;  // (segment, row) pairs, row fastest
    float acc[8] = {};
    int j = 0, r = 0;  // the pair being accumulated
    for (int m0 = 0; m0 < P; m0 += U) {
        uint32_t v[U];
        int jj = j, rr = r;
#ifdef QDEC_MARKS
        if (u == 0 && m0 == 0) QDEC_MARK(12);  // the first round's reads are about to go out
#endif
#pragma unroll
        for (int e = 0; e < U; e++) {
            const int word = (g0 + w + QW * jj) * 32 + lane;
            v[e] = m0 + e < P && word < words ? rq[(size_t)sel_idx[rr] * words + word] : 0x88888888u;  // 8: code 0
            if (++rr == k) { rr = 0; jj++; }
        }
#ifdef QDEC_MARKS  // warp 0's first round: its first word landed (13), all its words landed (14); a branch on the
                   // loaded value makes the timer read wait for it
        if (u == 0 && m0 == 0) {
            if (v[0] == 0x9E3779B9u) qdec_marks[blockIdx.x * 16 + 15] = 1;
            QDEC_MARK(13);
            uint32_t all = 0;
#pragma unroll
            for (int e = 0; e < U; e++) all ^= v[e];
            if (all == 0x9E3779B9u) qdec_marks[blockIdx.x * 16 + 15] = 2;
            QDEC_MARK(14);
        }
#endif
#pragma unroll
        for (int e = 0; e < U; e++) {
            if (m0 + e < P) {
                const float xv = sel_x[r];
                // codes i and i + 4 as the fp16 pair (1024 + code) (bit trick), minus 1032: code - 8, exact; the
                // same products and sums as fmaf(code - 8, x, acc) in fewer instructions (27 per word, not 38)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const uint32_t hb = ((v[e] >> (4 * i)) & 0x000F000Fu) | 0x64006400u;
                    const float2 f = __half22float2(__hsub2(*reinterpret_cast<const __half2*>(&hb),
                                                            __half2(__ushort_as_half(0x6408), __ushort_as_half(0x6408))));
                    acc[i] = fmaf(f.x, xv, acc[i]);
                    acc[i + 4] = fmaf(f.y, xv, acc[i + 4]);
                }
                if (++r == k) {  // the segment's rows are done: store its partial sums
                    const int word = (g0 + w + QW * j) * 32 + lane;
                    if (word < words) {
                        float4* dst = reinterpret_cast<float4*>(part + (size_t)word * 8);
                        __stcg(dst, make_float4(acc[0], acc[1], acc[2], acc[3]));
                        __stcg(dst + 1, make_float4(acc[4], acc[5], acc[6], acc[7]));
                    }
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[i] = 0.0f;
                    r = 0;
                    j++;
                }
            }
        }
    }
}

__device__ __forceinline__ void flag_release(uint32_t* f, uint32_t v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(f), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t flag_acquire(const uint32_t* f) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(f) : "memory");
    return v;
}

// Wait until flag f holds seq (or later). A flag that never comes (a bug, not a load) traps after ~10 s instead of
// hanging the GPU.
__device__ __forceinline__ void flag_wait(const uint32_t* f, uint32_t seq) {
    long long spins = 0;
    while ((int)(flag_acquire(f) - seq) < 0) {
        __nanosleep(32);
        if (++spins > 100000000LL) __trap();
    }
}
