// Low-bit GEMV (batch 1) on the tensor cores: y[N] = W_hat[N, K] x[K] (+ res), W_hat group-wise asymmetric RTN.
//
// qweight is in the mma-v3 layout of quant.py (3 bits: kernels.gemv.bytes3_layout; codes.cuh): a 16-row x
// 64-channel tile ("step") is 32 lanes x BITS words, each lane's words holding exactly its A-operand elements of the
// step's four mma.m16n8k16 instructions; the steps of a 16-row tile are contiguous, and tiles follow each other. One
// mask-and-or turns a bit field of both halves of a word into a half2 of (1024 + f * code) (the 0x6400 exponent
// trick; f a power of two fixed per mma tile and row half by the layout); the tensor core multiplies them by x
// (every column of B is x) with fp32 accumulation, and per group and row y += s * (sum_m C_m / f_m - 1024 * sum_m
// X_m / f_m - z * X), X_m the 16-channel sums of x, in fp32 (the offset costs ~8 of fp32's 24 bits, far below fp16
// output rounding). meta holds, per (tile, group), the 16 rows' fp16 scales then their 16 uint8 zeros, rows in the
// order 0, 8, 1, 9, ... (a lane's two rows side by side; 48 bytes; gemv.py builds it from QuantWeight's scales and
// zeros).
//
// Bandwidth comes from bytes in flight, not from threads: each block owns a contiguous range of tiles (a contiguous
// byte range of qweight); its WARPS warps split K into contiguous ranges of step pairs (128 channels: the cursor,
// waits and ring wraps, the mma sums' scaling and the group's zero and scale are paid once per pair), and every warp
// streams its pairs through its own ring of DEPTH shared-memory slots with cp.async (no registers held by loads in
// flight, no block barrier in the stream). x, in B-fragment order, and its sums per group (per step at group size
// 64, else per pair) are staged once per block. The warps' partial sums of up to four tiles wait in shared memory
// and meet at one barrier (H200, 8B decode 3-4% faster than a barrier per tile: kernels/NOTES.md, session 72).
//
// Table (non-uniform, SqueezeLLM) weights, LUT = true: W_hat[n, c] = offset[n] + scale[n] * v[n][code], a table of
// 2^BITS 8-bit values per output channel (quant.QuantLUT.grid, kernels.gemv.PackedLUT). The meta record is then the
// tile's (lut_record_bytes): the 16 rows' tables (2^BITS bytes each, rows 0..15), their fp32 scales, then their fp32
// offsets (rows 0, 8, 1, 9, ...), fetched with every pair like the uniform record. Codes and tables in PackedLUT's
// load-time layout, four lookups per byte permute (4 bits: two and an XOR; lut.cuh, lut_bytes). Without QDEC the
// looked-up bytes v are the A operand of int8 mma instructions and x is staged as three int8 planes (I8 below): per
// pair, rows g, g + 8 += scale * C + offset * X (X: the pair's sum of x). With QDEC, whose selection reads x in fp16,
// two more permutes pair the bytes into half2s of 1024 + v for the fp16 mma: rows += scale * (C - 1024 X) + offset * X.
// Uniform 4- and 3-bit weights at group size 128 with x staged in one round and ~2 tiles per block or more (U8,
// gemv.py's uses_int8: qkv, o and gate_up of 7-8B models; with QDEC gate_up only) take the int8 path too: the codes
// masked in place are the bytes (codes.cuh, u8_operands), rows += s * (C - z X).
// Grouped tables (GSHIFT > 0, quant.QuantLUT with groups): W_hat[n, c] = o[n, g] + s[n, g] * (the entry above); a
// tile's record is followed by one LUT_GROUP_BYTES record per group (16 fp16 scales, 16 fp16 offsets, rows 0, 8, 1,
// 9, ...), which every pair fetches beside the tile's tables: rows += s * (the per-row sum above) + o * X.
#include <cuda_fp16.h>

#include "pdl.cuh"

// The shared memory a block may opt in to on the GPU compiled for (kernels.cuda.options; nvcc's resource checks: an
// H100's)
#ifndef SHARED_LIMIT
#define SHARED_LIMIT (227 * 1024)
#endif

// NVRTC has no <stdint.h>
typedef unsigned int uint32_t;
typedef unsigned char uint8_t;

#include "mma.cuh"

#include "lut.cuh"

#include "codes.cuh"

#include "qdec.cuh"

#include "async_copy.cuh"

#include "runs.cuh"

constexpr int GEMV_RUNS = 2;  // the attention runs the staging merges itself (kernels.attention.GEMV_RUNS)
constexpr int GEMV_RUNS_MAX = 8;  // the most a GEMV merges before its staging (kernels.attention.GEMV_RUNS_MAX)
constexpr int GEMV_RUNS_HEADS = 64;  // ... of at most this many heads (kernels.attention.GEMV_RUNS_HEADS)

// Channels 8 i .. 8 i + 7 of x (one head's) as the decode attention's n runs make them (n <= GEMV_RUNS):
// attend_combine's arithmetic in its order (attention.cu), so the same bits as its output. runs_o [H, splits, D]: each
// run's unnormalized output; runs_ml [H, splits, 2]: its softmax's (max, sum). load_runs issues a thread's loads (all
// in one L2 round trip), merged_x merges what they bring.
struct RunLoads {
    float4 s, a0, a1, b0, b1;  // (m0, l0, m1, l1); run 0's channels; run 1's
};

__device__ __forceinline__ RunLoads load_runs(const float* __restrict__ runs_o, const float* __restrict__ runs_ml,
                                              int splits, int D, int n, int i) {
    static_assert(GEMV_RUNS == 2, "RunLoads holds two runs");
    const float4* o = reinterpret_cast<const float4*>(runs_o + (size_t)(8 * i / D) * splits * D + 8 * i % D);
    RunLoads r;
    r.s = *reinterpret_cast<const float4*>(runs_ml + (size_t)(8 * i / D) * splits * 2);
    r.a0 = __ldg(o), r.a1 = __ldg(o + 1);
    if (n > 1) r.b0 = __ldg(o + D / 4), r.b1 = __ldg(o + D / 4 + 1);
    return r;
}

__device__ __forceinline__ void merged_x(const RunLoads& r, int n, uint32_t (&v)[4]) {
    const float a[8] = {r.a0.x, r.a0.y, r.a0.z, r.a0.w, r.a1.x, r.a1.y, r.a1.z, r.a1.w};
    const float b[8] = {r.b0.x, r.b0.y, r.b0.z, r.b0.w, r.b1.x, r.b1.y, r.b1.z, r.b1.w};
    const float4 s = r.s;
    const float M = n > 1 ? fmaxf(s.x, s.z) : s.x;
    const float w0 = __expf(s.x - M), w1 = n > 1 ? __expf(s.z - M) : 0.0f;
    const float L = fmaf(w0, s.y, 0.0f) + (n > 1 ? fmaf(w1, s.w, 0.0f) : 0.0f);
#pragma unroll
    for (int e = 0; e < 4; e++) {
        float f[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float a0 = fmaf(w0, a[2 * e + h], 0.0f);
            f[h] = (n > 1 ? fmaf(w1, b[2 * e + h], a0) : a0) / L;
        }
        const __half2 x = __floats2half2_rn(f[0], f[1]);
        v[e] = *reinterpret_cast<const uint32_t*>(&x);
    }
}

// MR 8: the runs' weights of head h (h < heads, a thread each): w[h][r] = exp(m_r - M) over the n <= GEMV_RUNS_MAX
// runs (M their max), and L[h] = sum_r w_r l_r added as attend_combine's butterfly adds it (cluster_merge's: levels 16
// and 8 add zeros). Then merged_pair makes x's channels (2 c, 2 c + 1) with them: attend_combine's fmaf chain in run
// order, divided by L: the same bits.
__device__ __forceinline__ void run_weights(const float* __restrict__ runs_ml, int splits, int n, int h, float* w,
                                            float* L) {
    const float2* ml = reinterpret_cast<const float2*>(runs_ml + (size_t)h * splits * 2);
    float2 st[GEMV_RUNS_MAX];
#pragma unroll
    for (int r = 0; r < GEMV_RUNS_MAX; r++)
        if (r < n) st[r] = ml[r];
    float M = __int_as_float(0xff800000);  // -inf
#pragma unroll
    for (int r = 0; r < GEMV_RUNS_MAX; r++) M = r < n ? fmaxf(M, st[r].x) : M;
    float v[GEMV_RUNS_MAX];
#pragma unroll
    for (int r = 0; r < GEMV_RUNS_MAX; r++) {
        const float e = r < n ? __expf(st[r].x - M) : 0.0f;
        w[h * GEMV_RUNS_MAX + r] = e;
        v[r] = r < n ? fmaf(e, st[r].y, 0.0f) : 0.0f;
    }
    static_assert(GEMV_RUNS_MAX == 8, "the butterfly below starts at 4");
#pragma unroll
    for (int k = GEMV_RUNS_MAX / 2; k > 0; k >>= 1)
#pragma unroll
        for (int r = 0; r < k; r++) v[r] = v[r] + v[r + k];
    L[h] = v[0];
}

__device__ __forceinline__ uint32_t merged_pair(const float* __restrict__ runs_o, int splits, int D, int n, int c,
                                                const float* w, const float* L) {
    const int h = 2 * c / D;
    const float2* o = reinterpret_cast<const float2*>(runs_o + (size_t)h * splits * D + 2 * c % D);
    float2 ov[GEMV_RUNS_MAX];  // every run's loads in flight together
#pragma unroll
    for (int r = 0; r < GEMV_RUNS_MAX; r++)
        if (r < n) ov[r] = __ldg(o + r * D / 2);
    float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
    for (int r = 0; r < GEMV_RUNS_MAX; r++) {
        a0 = r < n ? fmaf(w[h * GEMV_RUNS_MAX + r], ov[r].x, a0) : a0;
        a1 = r < n ? fmaf(w[h * GEMV_RUNS_MAX + r], ov[r].y, a1) : a1;
    }
    const __half2 x = __floats2half2_rn(a0 / L[h], a1 / L[h]);
    return *reinterpret_cast<const uint32_t*>(&x);
}

// 1 / f: what divides the factor of decode's and u8_operands' codes out again
__device__ __forceinline__ float inv_factor(int bits, int m, int r) {
    return 1.0f / (float)(1 << log2_factor(bits, m, r));
}

// A lane's BITS words of a table weight's step (PackedLUT: at lane * BITS; uniform weights: codes.cuh, step_words).
template <int BITS>
__device__ __forceinline__ void lane_words(const uint32_t* p, uint32_t (&w)[BITS]) {
    if (BITS == 4) {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        w[0] = u.x; w[1 % BITS] = u.y; w[2 % BITS] = u.z; w[3 % BITS] = u.w;
    } else if (BITS == 2) {
        const uint2 u = *reinterpret_cast<const uint2*>(p);
        w[0] = u.x; w[1 % BITS] = u.y;
    } else {
#pragma unroll
        for (int b = 0; b < BITS; b++) w[b] = p[b];
    }
}

constexpr int META_BYTES = 48;  // per (tile, group): 16 fp16 scales, 16 uint8 zeros; rows 0, 8, 1, 9, ..., 7, 15
constexpr int LUT_GROUP_BYTES = 64;  // grouped tables, per (tile, group): 16 fp16 scales, 16 fp16 offsets, rows so

// A lane's two rows' tables (rows g, g + 8; 2^BITS bytes each, lut_regs registers) from its tile's record.
template <int BITS>
__device__ __forceinline__ void lut_tables(const unsigned char* rec, int g, uint32_t (&tg)[lut_regs<BITS>()],
                                           uint32_t (&tg8)[lut_regs<BITS>()]) {
    if constexpr (BITS == 4) {
        const uint4 u = reinterpret_cast<const uint4*>(rec)[g], v = reinterpret_cast<const uint4*>(rec)[g + 8];
        tg[0] = u.x, tg[1] = u.y, tg[2] = u.z, tg[3] = u.w, tg8[0] = v.x, tg8[1] = v.y, tg8[2] = v.z, tg8[3] = v.w;
    } else if constexpr (BITS == 3) {
        const uint2 u = reinterpret_cast<const uint2*>(rec)[g], v = reinterpret_cast<const uint2*>(rec)[g + 8];
        tg[0] = u.x, tg[1] = u.y, tg8[0] = v.x, tg8[1] = v.y;
    } else {
        tg[0] = reinterpret_cast<const uint32_t*>(rec)[g], tg8[0] = reinterpret_cast<const uint32_t*>(rec)[g + 8];
    }
}

// Rows g and g + 8's scales (sc) and offsets (of) from a tile's record: after its 16 tables, rows 0, 8, 1, 9, ...
template <int BITS>
__device__ __forceinline__ void lut_scales(const unsigned char* rec, int g, float2& sc, float2& of) {
    sc = reinterpret_cast<const float2*>(rec + (16 << BITS))[g];
    of = reinterpret_cast<const float2*>(rec + (16 << BITS) + 64)[g];
}

// y = W_hat f(x) (+ res), f the input transform below; with QW > 0 QDEC warps add R_hat[:, S] f(x)[S] (qdec.cuh).
// Dynamic shared memory: x staged (XB bytes a channel: fp16 B fragments, int8 planes, or both), per step or pair {X,
// offsets of rows g, g + 8, 0} or on the int8 path {X, 2^-e, 0, 0} (room for K/64 float4), then the warps' rings
// (WARPS x DEPTH slots of a pair's weights and meta), then with QDEC the block's fp32 results (16 per tile), the
// selection (k_chunk ints, k_chunk floats), 1024 bucket bytes and QW * 36 ints. Uniform weights without QDEC:
// registers capped at 64 so that 32 warps fit on an SM (the sweep's variants); table weights run one block per SM, and
// 4-bit tables use ~74 (+1-2 points of copy bandwidth).
// Group size = 64 << GSHIFT (uniform weights and grouped tables; per-row tables: GSHIFT 0, G = 1). hold: the next
// kernel is a GEMV that must not share the SMs with this one's stream (kernels.gemv.gemv), so it launches only as
// this one's blocks end their streams (its blocks then take SMs as this one's exit, its launch overlapping their last
// sums). x_first:
// x is ready when this one starts (it launched so, or without programmatic launch): stage x before requesting the
// first weights, whose HBM misses would delay x's L2 hits (kernels.gemv.gemv says where). MR: x is the decode
// attention's runs (runs_o, runs_ml; runs_splits of them, heads of runs_d channels), which the block merges: o's GEMV
// does the attention's last step, in place of a cluster merge or a combine kernel. MR 2: exactly two runs, merged by
// the staging itself (load_runs, merged_x: 8 channels a thread, one L2 round trip); MR 8: up to GEMV_RUNS_MAX runs,
// merged first into fp16 x in shared memory (run_weights, then merged_pair: 2 channels a thread), which the staging
// then reads. (A template flag: as a run-time branch its registers made the other instances spill under the
// 64-register cap.)
template <int BITS, int WARPS, int DEPTH, int GSHIFT, int QW, bool LUT, int Q, bool U8 = false, int MR = 0>
__global__ void __launch_bounds__(32 * (WARPS + QW), QW || LUT ? 1 : 32 / WARPS)
    gemv(const uint8_t* __restrict__ qw, const uint8_t* __restrict__ meta, const __half* __restrict__ x,
         const __half* __restrict__ res, __half* __restrict__ y, int N, int K, int G, uint32_t magic,
         const float* __restrict__ norm_w, float eps, int glu, int hold, int x_first, const uint32_t* __restrict__ rq,
         const __half* __restrict__ rs, float* __restrict__ part, unsigned long long* __restrict__ state,
         int* __restrict__ sel_out, int k_chunk, int n_tb, float b0, float b15, float inv_hi,
         float inv_lo, const float* __restrict__ runs_o, const float* __restrict__ runs_ml,
         const long long* __restrict__ runs_pos, int runs_splits, int runs_d) {
    // A ring slot holds Q pairs of steps (128 channels each) of one tile: their weights, then their meta: the tile's
    // tables (LUT), (and grouped, the pair's group record after them), the records of the pairs' groups (group size
    // >= 128), or two per pair (64). TREC: the bytes of one (tile, group) record in meta, or of a tile's tables.
    // Q = 2 (2-4 bit uniform weights where a warp's share of a tile is two pairs, gemv.py's fits): one copy
    // issue, wait and cursor step per 256 channels instead of 128 (H200, K = 4096: kernels/NOTES.md, session 44).
    constexpr int STEP_BYTES = 128 * BITS, PAIR_BYTES = 2 * STEP_BYTES;
    constexpr int TREC = LUT ? lut_record_bytes(BITS) : META_BYTES;
    constexpr int GREC = LUT && GSHIFT ? LUT_GROUP_BYTES : 0;
    constexpr int SLOT = Q * PAIR_BYTES + (LUT ? TREC + GREC : 2 * Q * META_BYTES);
    static_assert(Q == 1 || (Q == 2 && !LUT && BITS <= 4), "two pairs per slot: 2-4 bit uniform weights");
    static_assert(!LUT || GSHIFT < 2, "grouped tables: group size 128 (a pair)");
    static_assert(TREC + GREC <= 512, "a slot's meta is one 16-byte copy per lane");
    extern __shared__ __align__(16) unsigned char smem[];
    // I8 (table weights without QDEC): the looked-up bytes are the A operand of the int8 tensor cores (m16n8k32, u8),
    // x is B as three int8 planes in columns 0-2: per pair of steps x = 2^-e (65536 h + 256 m + l), |x 2^e| < 2^22,
    // e from the pair's largest |x|; the int32 sums are exact (kernels/NOTES.md, session 49). Two mma per step instead
    // of four and no pairing of the bytes into half2s. x takes 3 bytes a channel (kernels.gemv.shared_bytes).
    // U8: uniform 4- and 3-bit weights on the same int8 path (gemv.py's uses_int8): one LOP3 makes four codes the
    // A operand's bytes (codes.cuh, u8_operands; 4 bits: w & 0x0F0F0F0F and w & 0xF0F0F0F0, rows g and g + 8, the
    // latter times 16), two per eight weights instead of five (3 bits: 13 a step instead of 24). With QDEC, whose
    // selection reads x in fp16, x is staged both ways (5 bytes a channel).
    static_assert(!U8 || (!LUT && (BITS == 4 || BITS == 3) && GSHIFT == 1), "int8 uniform weights: 3 or 4 bits, "
                  "group 128");
    constexpr bool I8 = (LUT && QW == 0) || U8, XH = !I8 || QW;  // x staged as int8 planes; as half2s
    constexpr int XB = (I8 ? 3 : 0) + (XH ? 2 : 0);  // bytes of staged x per channel
    const int S = K / 64, P = (S + 1) / 2;  // steps; pairs of steps, the last one single where S is odd
    uint32_t* xs = reinterpret_cast<uint32_t*>(smem);  // [step][t][m][2] half2 words
    unsigned char* xp = smem + (XH ? 2 * K : 0);  // I8: [step][plane][t][16] bytes
    float4* xstat = reinterpret_cast<float4*>(smem + K * XB);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool streamer = warp < WARPS;  // the others are QDEC warps
    unsigned char* ring = smem + K * XB + S * 16 + warp * DEPTH * SLOT;
    const int T = N / 16;
    // With QDEC the first n_tb blocks only compensate (select, fetch and publish whole chunks' partial sums, see
    // qdec.cuh); the others stream the weights, each a contiguous range of tiles.
    const int nf = QW ? n_tb : 0, ns = gridDim.x - nf, sb = blockIdx.x - nf;
    const bool fetcher = sb < 0;
    const int t_begin = fetcher ? 0 : (int)((long long)sb * T / ns);
    const int t_end = fetcher ? 0 : (int)((long long)(sb + 1) * T / ns);
    const int lo = warp * P / WARPS, hi = (warp + 1) * P / WARPS;  // this warp's pairs of every tile
    const int items = (t_end - t_begin) * (hi - lo) / Q;  // slots
    // QDEC's shared memory, after the rings: the block's fp32 results and its outputs' residual scales (fp16), the
    // selection's scratch, buckets, and the selection itself
    const int tpb = (T + ns - 1) / ns;  // most tiles of a block
    uint32_t* mx = reinterpret_cast<uint32_t*>(smem + K * XB + S * 16 + WARPS * DEPTH * SLOT);  // MR 8: x, fp16
    float* ybuf = reinterpret_cast<float*>(smem + K * XB + S * 16 + WARPS * DEPTH * SLOT + (MR == 8 ? 2 * K : 0));
    __half* sscale = reinterpret_cast<__half*>(ybuf + 16 * tpb);
    QdecScratch* scr = reinterpret_cast<QdecScratch*>(sscale + 16 * tpb);
    unsigned char* bk = reinterpret_cast<unsigned char*>(scr + 1);
    int* sel_idx = reinterpret_cast<int*>(bk + QDEC_CHUNK);
    float* sel_x = reinterpret_cast<float*>(sel_idx + k_chunk);
    const int o0 = t_begin * 16, o1 = t_end * 16;
    // QDEC: which call of this layer this is. The first QDEC thread takes the ticket and uses it only after its
    // fetch, so the atomic's round trip (long while the weights stream) stalls nobody.
    __shared__ uint32_t seq;
    unsigned long long ticket = 0;
    if (QW && threadIdx.x == 32 * WARPS) ticket = atomicAdd(state, 1ull);
    if (threadIdx.x == 0) {
        QDEC_MARK_START();
        QDEC_MARK(0);
    }
    if (QW && !streamer) {  // the residual scales of this block's outputs (no kernel writes them): asynchronously now
        const int u = threadIdx.x - 32 * WARPS;
        const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(sscale));
        for (int i = u; i < (o1 - o0) / 8; i += 32 * QW) cp_async16(dst + 16 * i, rs + o0 + 8 * i, true);
        cp_async_commit();
        if (u < 32) scr->hist[u] = 0;  // the selection's counters; the staging barrier orders these stores
        if (u == 0) scr->hsum = 0;
    }

    // The issue cursor: this lane's 16 bytes of the next slot to load (src), of the meta records of its tile (mtile),
    // and of the ring slot they go to (in_slot, a shared-memory address); in_pair is the slot's pair within the tile.
    // Every slot brings its meta along (the second read of a record comes from L2). No branches: a warp past its last
    // slot keeps going through the motions with its copies switched off.
    const uint32_t ring0 = static_cast<uint32_t>(__cvta_generic_to_shared(ring)) + lane * 16;
    const uint32_t ring_last = ring0 + (DEPTH - 1) * SLOT;
    const uint8_t* src = qw + ((size_t)t_begin * S + 2 * lo) * STEP_BYTES + lane * 16;
    const size_t tstride = GREC ? TREC + (size_t)G * GREC : (size_t)G * TREC;  // meta bytes per tile
    const uint8_t* mtile = meta + (size_t)t_begin * tstride + lane * 16;
    // at a tile's end: from the start of this warp's last slot to the next tile's first (past the other warps' steps)
    const long long wrap_step = (long long)(S - 2 * (hi - lo) + 2) * STEP_BYTES;
    int in_pair = lo, issued = 0;
    uint32_t in_slot = ring0;
    // the byte offset of pair p's first record in its tile's meta (uniform weights)
    auto rec_off = [&](int p) { return (GSHIFT ? p >> (GSHIFT > 0 ? GSHIFT - 1 : 0) : 2 * p) * META_BYTES; };
    // Two pairs per slot: a slot is the warp's whole share of a tile (gemv.py's fits), so each issue copies the
    // next tile's from the same offsets: no cursor within the tile.
    const uint8_t* mrec = mtile + rec_off(lo);
    auto issue = [&]() {
        const bool live = issued++ < items, two = Q == 2 || 2 * in_pair + 1 < S;
        const int wbytes = Q == 2 ? Q * PAIR_BYTES : two ? PAIR_BYTES : STEP_BYTES;
#pragma unroll
        for (int j = 0; j < (Q * PAIR_BYTES + 511) / 512; j++)
            if constexpr (QW > 0)  // the streaming hint made the 8B QDEC decode 1.5-2% slower (H100, session 36)
                cp_async16(in_slot + 512 * j, src + 512 * j, live && 16 * lane + 512 * j < wbytes);
            else
                cp_async16_stream(in_slot + 512 * j, src + 512 * j, live && 16 * lane + 512 * j < wbytes);
        if constexpr (Q == 2) {  // two records (group size 128), four (64), or the one of their group (>= 256)
            cp_async16(in_slot + Q * PAIR_BYTES, mrec,
                       live && lane < (GSHIFT == 0 ? 4 : GSHIFT == 1 ? 2 : 1) * META_BYTES / 16);
            cp_async_commit();
            src += (size_t)S * STEP_BYTES;
            mrec += tstride;
        } else {
            // lanes past the tables (grouped tables) copy the pair's group record, which follows the tile's tables
            const int roff = LUT ? (GREC && lane >= TREC / 16 ? in_pair * GREC : 0) : rec_off(in_pair);
            const int rlanes = LUT ? (TREC + GREC) / 16 : GSHIFT || !two ? META_BYTES / 16 : 2 * META_BYTES / 16;
            cp_async16(in_slot + PAIR_BYTES, mtile + roff, live && lane < rlanes);
            cp_async_commit();
            const bool wrap = ++in_pair == hi;
            in_pair = wrap ? lo : in_pair;
            src += wrap ? wrap_step : PAIR_BYTES;
            mtile += wrap ? tstride : 0;
        }
        in_slot = in_slot == ring_last ? ring0 : in_slot + SLOT;
    };

    // The first DEPTH - 1 slots go out before the block stages x, or (x_first) right after the staging's last loads:
    // H100, 132 blocks staging 28 / 56 KB of x from L2 took 2.2 / 2.8 us behind 27 KB of weights each, 0.8 / 1.0 us
    // ahead of them.
    if (streamer && !x_first)
#pragma unroll
        for (int i = 0; i < DEPTH - 1; i++) issue();
    // The norm's weights of the staging's first round: nobody's output either, so they are in registers by the time
    // x is (after the wait, only x's own round trip is on the way to the staged input). Hopper only: where kernels
    // cannot launch early there is less to gain, and sm_89 spills under the 64-register cap.
#if __CUDA_ARCH__ >= 900
    constexpr bool PRELOAD = true;
#else
    constexpr bool PRELOAD = false;
#endif
    float2 nw[4];
    if (PRELOAD && norm_w != nullptr && streamer)
#pragma unroll
        for (int e = 0; e < 4; e++)
            nw[e] = threadIdx.x < S * 8 ? __ldg(reinterpret_cast<const float2*>(norm_w) + 4 * threadIdx.x + e)
                                        : make_float2(0.0f, 0.0f);
    // x merged from the attention's runs (runs_o): how many runs hold some of the context. The position was written
    // before the graph started.
    const int nruns = MR ? Runs((int)*runs_pos, runs_splits).count : 0;
    // Weights are nobody's output: they were requested before waiting for the kernel that produces x.
    wait_previous();
    if (!hold) start_next();  // else at the end of the block's stream
    if (threadIdx.x == 0) QDEC_MARK(1);
    if constexpr (MR == 8) {  // the runs merged into x in shared memory first; the staging reads it from there
        __shared__ float rw[GEMV_RUNS_HEADS * GEMV_RUNS_MAX], rl[GEMV_RUNS_HEADS];  // per head: weights, sum
        if (threadIdx.x < K / runs_d) run_weights(runs_ml, runs_splits, nruns, threadIdx.x, rw, rl);
        __syncthreads();
        for (int c = streamer ? threadIdx.x : K / 2; c < K / 2; c += 32 * WARPS)
            mx[c] = merged_pair(runs_o, runs_splits, runs_d, nruns, c, rw, rl);
        __syncthreads();
    }

    // The input transform: with norm_w, x becomes fp16(x * rsqrt(mean(x^2) + eps) * norm_w) (ops.rmsnorm); with
    // glu, x is [gate | up] (2K halves) and becomes fp16(silu(gate) * up) (ops.silu_mul). Each block redoes it:
    // K values from L2 cost less than a kernel launch.
    __shared__ float wsum[WARPS];
    float rnorm = 1.0f;
    if (norm_w != nullptr) {
        float ss = 0.0f;
        for (int i = streamer ? threadIdx.x : K; i < K / 8; i += 32 * WARPS) {
            const uint4 u = __ldg(reinterpret_cast<const uint4*>(x) + i);
            const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float2 f = __half22float2(h[e]);
                ss = fmaf(f.x, f.x, fmaf(f.y, f.y, ss));
            }
        }
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0 && streamer) wsum[warp] = ss;
        __syncthreads();
        ss = 0.0f;
#pragma unroll
        for (int k = 0; k < WARPS; k++) ss += wsum[k];
        rnorm = rsqrtf(ss / K + eps);
    }

    // Stage x: 8 threads per step, each 8 channels (4 words); word i of a step (channels 2i, 2i+1) goes to its
    // B-fragment place: mma tile m = i / 8, r = i % 8 -> column pair t = r % 4, register b0 (r < 4) or b1.
    // A thread's loads of two rounds go out together: down's 14336 channels take four rounds of 512 threads, each an
    // L2 round trip while only the prologue's pairs stream (two at a time: H100, down W3 65 -> 68% of copy bandwidth;
    // four spill under the 64-register cap).
    // (The attention's runs, 5 float4 a thread, a round at a time: o's 4096 channels are one round of 16 warps.)
    constexpr int SB = MR == 2 ? 1 : 2;
    for (int base0 = streamer ? 0 : S * 8; base0 < S * 8; base0 += SB * 32 * WARPS) {
        uint4 xin[SB], upin[SB];
        RunLoads rin[SB];
#pragma unroll
        for (int j = 0; j < SB; j++) {
            const int idx = base0 + j * 32 * WARPS + threadIdx.x;
            if (idx < S * 8) {
                if (MR == 2) {
                    rin[j] = load_runs(runs_o, runs_ml, runs_splits, runs_d, nruns, idx);
                } else if (MR == 8) {
                    xin[j] = reinterpret_cast<const uint4*>(mx)[idx];
                } else {
                    xin[j] = __ldg(reinterpret_cast<const uint4*>(x) + idx);
                    if (glu) upin[j] = __ldg(reinterpret_cast<const uint4*>(x + K) + idx);
                }
            }
        }
        if (x_first && base0 + SB * 32 * WARPS >= S * 8)  // the last round's loads are out: now the weights
#pragma unroll
            for (int i = 0; i < DEPTH - 1; i++) issue();
#pragma unroll
        for (int j = 0; j < SB; j++) {
            const int base = base0 + j * 32 * WARPS;
            if (base >= S * 8) break;  // the same for the whole block: every lane takes part in the shuffles below
            const int idx = base + threadIdx.x, s = idx >> 3, q = idx & 7, m = q >> 1;
            float sum = 0.0f, amax = 0.0f;
            uint32_t v[4] = {0u, 0u, 0u, 0u};
            if (s < S) {
                if (MR == 2) {
                    merged_x(rin[j], nruns, v);
                } else {
                    const uint4 u = xin[j];
                    v[0] = u.x, v[1] = u.y, v[2] = u.z, v[3] = u.w;
                    if (norm_w != nullptr) {
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const float2 w = PRELOAD && base0 + j == 0 ? nw[e]
                                                        : __ldg(reinterpret_cast<const float2*>(norm_w) + 4 * idx + e);
                            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&v[e]));
                            const __half2 h = __floats2half2_rn(f.x * rnorm * w.x, f.y * rnorm * w.y);
                            v[e] = *reinterpret_cast<const uint32_t*>(&h);
                        }
                    } else if (glu) {
                        const uint4 uu = upin[j];
                        const uint32_t up[4] = {uu.x, uu.y, uu.z, uu.w};
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const float2 g = __half22float2(*reinterpret_cast<const __half2*>(&v[e]));
                            const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&up[e]));
                            // fast division: the exact one made this staging compute-bound (down W4 71 -> 76% of
                            // copy bandwidth)
                            const __half2 h = __floats2half2_rn(__fdividef(g.x, 1.0f + __expf(-g.x)) * p.x,
                                                                __fdividef(g.y, 1.0f + __expf(-g.y)) * p.y);
                            v[e] = *reinterpret_cast<const uint32_t*>(&h);
                        }
                    }
                }
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int i = 4 * q + e, r = i & 7;
                    if (XH) xs[s * 32 + 8 * (r & 3) + 4 * (m >> 1) + 2 * (m & 1) + (r >> 2)] = v[e];
                    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&v[e]));
                    sum += f.x + f.y;
                    if (I8) amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
                }
            }
            float xm = 0.0f;  // I8: 2^-e of the thread's pair (its 16 threads: a warp's lanes 0-15 or 16-31)
            if constexpr (I8) {
#pragma unroll
                for (int d = 1; d < 16; d <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
                const int eb = (__float_as_uint(amax) >> 23) & 0xFF;  // amax < 2^(eb - 126)
                const float M = amax > 0.0f ? __uint_as_float((uint32_t)(275 - eb) << 23) : 1.0f;  // 2^(148 - eb)
                xm = 1.0f / M;  // exact: a power of two
                if (s < S) {
                    // channel 8q + 2e + hh of the step: mma tile q / 2, column t = e, byte hh + 2 (q % 2) of the
                    // lookups' word (lut_bytes); plane n at n * 64, lane t's 16 bytes at t * 16, word q / 2 in them
                    unsigned char* xb = xp + s * 192;
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&v[e]));
#pragma unroll
                        for (int hh = 0; hh < 2; hh++) {
                            const int X = __float2int_rn((hh ? f.y : f.x) * M);
                            // (uniform weights: columns 2t, 2t + 8, 2t + 1, 2t + 9, the nibbles' order)
                            const int o = e * 16 + (q >> 1) * 4 + (U8 ? 2 * hh + (q & 1) : hh + 2 * (q & 1));
                            xb[o] = (unsigned char)X;                             // l: X's low byte, signed
                            xb[64 + o] = (unsigned char)((X + 0x80) >> 8);        // m = (X - l) / 256, low byte
                            xb[128 + o] = (unsigned char)((X + 0x8080) >> 16);    // h = (X - l - 256 m) / 65536
                        }
                    }
                }
            }
            float off0 = 1024.0f * sum * inv_factor(BITS, m, 0), off1 = 1024.0f * sum * inv_factor(BITS, m, 1);
            // group size >= 128 and tables: the statistics of a pair of steps (a warp's lanes 8-15 hold the second
            // step of 0-7's)
            constexpr bool PAIRED = GSHIFT > 0 || LUT;
#pragma unroll
            for (int d = 1; d < (PAIRED ? 16 : 8); d <<= 1) {
                sum += __shfl_xor_sync(0xffffffffu, sum, d);
                if (!I8) {  // the offsets of the fp16 mma's 1024 + f * code
                    off0 += __shfl_xor_sync(0xffffffffu, off0, d);
                    off1 += __shfl_xor_sync(0xffffffffu, off1, d);
                }
            }
            if (s < S && q == 0 && (!PAIRED || (s & 1) == 0))
                xstat[PAIRED ? s >> 1 : s] = I8 ? make_float4(sum, xm, 0.0f, 0.0f) : make_float4(sum, off0, off1, 0.0f);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) QDEC_MARK(2);

    constexpr int NB = SHARED_LIMIT < 200 * 1024 ? 1 : 4;  // tiles per barrier: kernels.gemv.tiles_per_barrier
    __shared__ float red[2][NB][WARPS][16];
    const int g = lane >> 2, t = lane & 3;  // mma fragment coordinates: rows g and g + 8, columns 2t, 2t + 1
    int c_off = 0;  // the slot to compute from
    float acc0, acc1;
    // rows g, g + 8 += s * (V - 1024 sum_m X_m / f_m - z X), V = sum_m C_m / f_m: a group's record (rec) applied to
    // the mma sums c of its steps, with the steps' x statistics st = (X, offsets of rows g, g + 8)
    auto apply = [&](const float (&c)[4][4], const unsigned char* rec, float4 st) {
        const float2 sc = __half22float2(reinterpret_cast<const __half2*>(rec)[g]);  // rows g, g + 8 side by side
        const uint32_t zp = reinterpret_cast<const unsigned short*>(rec + 32)[g];
        float v0 = 0.0f, v1 = 0.0f;
#pragma unroll
        for (int m = 0; m < 4; m++) {
            v0 += c[m][0] * inv_factor(BITS, m, 0);
            v1 += c[m][2] * inv_factor(BITS, m, 1);
        }
        acc0 = fmaf(sc.x, fmaf(-(float)(zp & 0xFFu), st.x, v0 - st.y), acc0);
        acc1 = fmaf(sc.y, fmaf(-(float)(zp >> 8), st.x, v1 - st.z), acc1);
    };
    // pair p: its weights at slot, its meta at rec (the tile's tables, its group's record, or its steps' two records)
    auto compute = [&](int p, const unsigned char* slot, const unsigned char* rec) {
        const bool two = 2 * p + 1 < S;
        float c[4][4] = {};  // four independent accumulators: the mma instructions pipeline
        // step h of the pair: c += its weights (A fragments a) times its 64 channels of x, on the tensor cores
        auto mma_step = [&](int h, const uint32_t (&a)[4][4]) {
            const uint4* xq = reinterpret_cast<const uint4*>(xs + (2 * p + h) * 32);
            const uint4 b01 = xq[2 * t], b23 = xq[2 * t + 1];
            mma16816(c[0], a[0], b01.x, b01.y);
            mma16816(c[1], a[1], b01.z, b01.w);
            mma16816(c[2], a[2], b23.x, b23.y);
            mma16816(c[3], a[3], b23.z, b23.w);
        };
        int ci[2][4] = {};  // I8: the int32 sums of the planes
        // I8, step h: ci += its bytes v (v[m][r]: mma tile m, rows g + 8 r) times x's planes (column g: plane g < 3)
        auto mma_step_i8 = [&](int h, const uint32_t (&v)[4][2]) {
            uint4 b = make_uint4(0u, 0u, 0u, 0u);
            if (g < 3) b = *reinterpret_cast<const uint4*>(xp + (2 * p + h) * 192 + g * 64 + t * 16);
            mma16832(ci[0], v[0][0], v[0][1], v[1][0], v[1][1], b.x, b.y);  // mma tiles 0, 1
            mma16832(ci[1], v[2][0], v[2][1], v[3][0], v[3][1], b.z, b.w);  // 2, 3
        };
        // I8: rows g, g + 8's sums of v x (columns 2t, 2t + 1: planes l, m (t = 0), h (t = 1); lanes t = 0, 1 meet at
        // the tile's end) and the pair's sum of x X (lane t = 0's)
        auto sums_i8 = [&](float& v0, float& v1, float& X) {
            const float4 st = xstat[p];
            const float wa = t == 0 ? st.y : t == 1 ? 65536.0f * st.y : 0.0f, wb = t == 0 ? 256.0f * st.y : 0.0f;
            X = t == 0 ? st.x : 0.0f;
            v0 = fmaf((float)(ci[0][0] + ci[1][0]), wa, (float)(ci[0][1] + ci[1][1]) * wb);
            v1 = fmaf((float)(ci[0][2] + ci[1][2]), wa, (float)(ci[0][3] + ci[1][3]) * wb);
        };
        if constexpr (LUT) {  // every element looked up in its row's table
            uint32_t tg[lut_regs<BITS>()], tg8[lut_regs<BITS>()];
            lut_tables<BITS>(rec, g, tg, tg8);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (h && !two) break;
                uint32_t w[BITS];
                lane_words<BITS>(reinterpret_cast<const uint32_t*>(slot + h * STEP_BYTES) + lane * BITS, w);
                if constexpr (I8) {  // the bytes v multiplied as they are
                    uint32_t v[4][2];
                    lut_bytes<BITS>(w, tg, tg8, v);
                    mma_step_i8(h, v);
                } else {  // as half2s of 1024 + v
                    uint32_t a[4][4];
                    lut_fragments<BITS>(w, tg, tg8, magic, a);
                    mma_step(h, a);
                }
            }
            // v0, v1: rows g, g + 8's sum of v x; X: the pair's sum of x
            float X, v0, v1;
            if constexpr (I8) {  // the offsets' terms (X) are lane t = 0's
                sums_i8(v0, v1, X);
            } else {  // the mma sums are sum (1024 + v) x
                X = xstat[p].x;
                v0 = fmaf(-1024.0f, X, (c[0][0] + c[1][0]) + (c[2][0] + c[3][0]));
                v1 = fmaf(-1024.0f, X, (c[0][2] + c[1][2]) + (c[2][2] + c[3][2]));
            }
            float2 sc, of;
            lut_scales<BITS>(rec, g, sc, of);
            if constexpr (GREC > 0) {  // the pair's group: its scales and offsets of rows g, g + 8
                const float2 gs = __half22float2(reinterpret_cast<const __half2*>(rec + TREC)[g]);
                const float2 go = __half22float2(reinterpret_cast<const __half2*>(rec + TREC + 32)[g]);
                acc0 = fmaf(gs.x, fmaf(sc.x, v0, of.x * X), fmaf(go.x, X, acc0));
                acc1 = fmaf(gs.y, fmaf(sc.y, v1, of.y * X), fmaf(go.y, X, acc1));
            } else {
                acc0 = fmaf(sc.x, v0, fmaf(of.x, X, acc0));
                acc1 = fmaf(sc.y, v1, fmaf(of.y, X, acc1));
            }
        } else if constexpr (U8) {  // the codes as bytes, rows g and g + 8 times their factors (u8_operands)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (h && !two) break;
                uint32_t w[BITS], v[4][2];
                step_words<BITS>(reinterpret_cast<const uint32_t*>(slot + h * STEP_BYTES), lane, w);
                u8_operands<BITS>(w, v);
                mma_step_i8(h, v);
            }
            // the pair's group: rows += s * (sum code x - z X); the sums add every tile m, so one factor per row half
            static_assert(log2_factor(BITS, 0, 0) == log2_factor(BITS, 3, 0) &&
                          log2_factor(BITS, 0, 1) == log2_factor(BITS, 3, 1), "int8 path: a factor per row half");
            float v0, v1, X;
            sums_i8(v0, v1, X);
            v0 *= inv_factor(BITS, 0, 0);
            v1 *= inv_factor(BITS, 0, 1);
            const float2 sc = __half22float2(reinterpret_cast<const __half2*>(rec)[g]);
            const uint32_t zp = reinterpret_cast<const unsigned short*>(rec + 32)[g];
            acc0 = fmaf(sc.x, fmaf(-(float)(zp & 0xFFu), X, v0), acc0);
            acc1 = fmaf(sc.y, fmaf(-(float)(zp >> 8), X, v1), acc1);
        } else {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (h && !two) break;
                uint32_t w[BITS], a[4][4];
                step_words<BITS>(reinterpret_cast<const uint32_t*>(slot + h * STEP_BYTES), lane, w);
                decode<BITS>(w, magic, a);
                mma_step(h, a);
                if (GSHIFT == 0) {  // group size 64: a record and x statistics per step
                    apply(c, rec + h * META_BYTES, xstat[2 * p + h]);
#pragma unroll
                    for (int m = 0; m < 4; m++) c[m][0] = c[m][1] = c[m][2] = c[m][3] = 0.0f;
                }
            }
            if (GSHIFT) apply(c, rec, xstat[p]);  // the pair is within one group
        }
    };
    // the Q pairs of the next slot from p0 in turn (not unrolled: two pairs' bodies at once spill under the cap)
    auto compute_slot = [&](int p0) {
        const unsigned char* slot = ring + c_off;
        c_off = c_off + SLOT == DEPTH * SLOT ? 0 : c_off + SLOT;
#pragma unroll 1
        for (int j = 0; j < Q; j++)
            compute(p0 + j, slot + j * PAIR_BYTES,
                    slot + Q * PAIR_BYTES + (LUT ? 0 : rec_off(p0 + j) - rec_off(p0)));
    };
    uint32_t* flags = reinterpret_cast<uint32_t*>(state + 1);
    const int C = (K + QDEC_CHUNK - 1) / QDEC_CHUNK, n_seg = (N + QDEC_SEG - 1) / QDEC_SEG;
    // n_tb <= C: a compensating block takes whole chunks (blockIdx.x, + n_tb, ...); n_tb = C * p: chunk
    // blockIdx.x % C, its part blockIdx.x / C of p, ceil(n_seg / p) segments each (every part selects the chunk
    // itself: the same channels). One flag per (chunk, part).
    const int parts = nf > C ? nf / C : 1, per_part = (n_seg + parts - 1) / parts, n_flags = C * parts;
    if constexpr (QW > 0) {
        if (fetcher)  // the streaming warps select, every warp fetches
            for (int c = blockIdx.x % C; c < C; c += nf) {  // n_tb > C: one chunk per block
                const int j = blockIdx.x / C, g0 = j * per_part, g1 = min(n_seg, g0 + per_part);
                const int csize = min(QDEC_CHUNK, K - c * QDEC_CHUNK);
                const int k = min(csize, (k_chunk * csize + QDEC_CHUNK - 1) / QDEC_CHUNK);  // qdec.k_for_chunk
                if (streamer) qdec_select<32 * WARPS>(xs, c, csize, k, b0, b15, inv_hi, inv_lo, bk, scr, sel_idx, sel_x);
                __syncthreads();
                if (threadIdx.x == 0) QDEC_MARK(3);
                if (sel_out != nullptr && j == 0)  // the chosen channels, for tests and reports
                    for (int i = threadIdx.x; i < k_chunk; i += blockDim.x) {
                        sel_out[c * k_chunk + i] = i < k ? sel_idx[i] : -1;
                        sel_out[(C + c) * k_chunk + i] = i < k ? __float_as_int(sel_x[i]) : 0;
                    }
                qdec_fetch<WARPS + QW>(rq, part + (size_t)c * N, N, g0, g1, k, threadIdx.x, sel_idx, sel_x);
                if (threadIdx.x == 0) QDEC_MARK(4);
                __syncthreads();  // every partial stored (the release below is cumulative), sel_* free again
                if (threadIdx.x == 32 * WARPS) {
                    flag_release(flags + c + C * j, (uint32_t)(ticket / gridDim.x) + 1u);
                    QDEC_MARK(5);
                }
            }
    }

    if (streamer) {
        for (int tile = t_begin; tile < t_end; tile++) {
            acc0 = acc1 = 0.0f;
            for (int p = lo; p < hi; p += Q) {
                cp_async_wait<DEPTH - 2>();  // this slot's copies have landed (DEPTH - 2 younger ones may not have)
                if (threadIdx.x == 0 && tile == t_begin && p == lo) QDEC_MARK(15);  // empty unless QDEC_MARKS
                __syncwarp();  // ... every lane's, and every lane has read the slot computed last
                issue();  // the slot DEPTH - 1 ahead, into that one
#ifndef GEMV_LOADS_ONLY  // scripts/gemv_bound.py: the stream without its math
                compute_slot(p);
#endif
            }
            // Batches of NB tiles from the block's first, one barrier each (batches by tile index, where a block's
            // first may start mid-batch, made o and down take two: decode 2% slower). Batches alternate banks: no warp
            // writes a bank again before the threads reducing it, which must reach the next barrier first, have read it.
            const int nt = tile - t_begin, bank = (nt / NB) & 1, slot = nt % NB;
            if constexpr (I8) {  // lanes t = 0, 1 hold the planes' parts
                acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
                acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
            }
            if (t == 0) {
                red[bank][slot][warp][g] = acc0;
                red[bank][slot][warp][g + 8] = acc1;
            }
            if (slot == NB - 1 || tile == t_end - 1) {
                asm volatile("bar.sync 1, %0;\n" ::"n"(32 * WARPS) : "memory");  // the streaming warps only
                if (threadIdx.x == 0 && tile - t_begin < NB) QDEC_MARK(9);
                if (threadIdx.x < 16 * (slot + 1)) {
                    const int j = threadIdx.x >> 4, r = threadIdx.x & 15, n = (t_begin + (nt & ~(NB - 1)) + j) * 16 + r;
                    float v = 0.0f;
#pragma unroll
                    for (int k = 0; k < WARPS; k++) v += red[bank][j][k][r];
                    if (res != nullptr) v += __half2float(res[n]);  // fused residual add
                    if (QW)
                        ybuf[n - o0] = v;
                    else
                        y[n] = __float2half_rn(v);
                }
            }
        }
        // A held next kernel may launch now (where this one triggered at its start, a second trigger does nothing;
        // testing hold here cost the W4 kernels a spill). The streaming warps only, so that a block with QDEC warps
        // does not trigger before its stream ends, whether a block counts as triggered at its first thread's or its
        // last's.
        start_next();
        cp_async_wait<0>();
        if (threadIdx.x == 0) QDEC_MARK(6);
    } else if constexpr (QW > 0) {  // QDEC warps
        if (threadIdx.x == 32 * WARPS) seq = (uint32_t)(ticket / gridDim.x) + 1u;
        cp_async_wait<0>();  // the scales
    }
    if constexpr (QW > 0) {  // add scale * the partials of every item covering this block's outputs, round once
        __syncthreads();
        for (int f = threadIdx.x; f < (o1 > o0 ? n_flags : 0); f += blockDim.x) flag_wait(flags + f, seq);
        __syncthreads();
        if (threadIdx.x == 0) QDEC_MARK(7);
        for (int n = o0 + threadIdx.x; n < o1; n += blockDim.x) {
            float v = 0.0f;
            for (int cc = 0; cc < C; cc++) v += __ldcg(part + (size_t)cc * N + n);
            y[n] = __float2half_rn(fmaf(__half2float(sscale[n - o0]), v, ybuf[n - o0]));
        }
        if (threadIdx.x == 0) QDEC_MARK(8);
    } else if (threadIdx.x == 0) {
        QDEC_MARK(8);
    }
}

// W_hat as dense fp16 [N, K] (for prompts: cuBLAS then multiplies). One thread per (step, lane): the same decode
// as the GEMV, then (code - zero) * scale in fp32 rounded once to fp16, as quant.QuantWeight.dequantize.
template <int BITS>
__global__ void dequant(const uint32_t* __restrict__ qw, const uint8_t* __restrict__ meta, __half* __restrict__ out,
                        int N, int K, int G, int group_size) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    const int steps = K / 64;
    if (idx >= N / 16 * steps * 32) return;
    const int lane = idx & 31, step = (idx >> 5) % steps, tile = (idx >> 5) / steps;
    const int g = lane >> 2, t = lane & 3;
    uint32_t w[BITS], a[4][4];
    step_words<BITS>(qw + (size_t)(idx >> 5) * 32 * BITS, lane, w);
    decode<BITS>(w, 0x64006400u, a);
    const uint8_t* rec = meta + ((size_t)tile * G + step * 64 / group_size) * META_BYTES;
#pragma unroll
    for (int r = 0; r < 2; r++) {  // rows g + 8r: registers j = r and j = r + 2 (columns + 8)
        const int row = tile * 16 + g + 8 * r;
        const float s = __half2float(reinterpret_cast<const __half*>(rec)[2 * g + r]);
        const float z = rec[32 + 2 * g + r];
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int jj = 0; jj < 2; jj++) {
                const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&a[m][r + 2 * jj]));
                const float inv = inv_factor(BITS, m, r);  // exact: codes are small integers
                const int col = step * 64 + m * 16 + 2 * t + 8 * jj;
                *reinterpret_cast<__half2*>(out + (size_t)row * K + col) =
                    __floats2half2_rn(((f.x - 1024.0f) * inv - z) * s, ((f.y - 1024.0f) * inv - z) * s);
            }
    }
}
#ifndef __CUDACC_RTC__  // nvcc (resource checks) builds every variant; NVRTC only what kernels/cuda.py asks for
template __global__ void dequant<2>(const uint32_t*, const uint8_t*, __half*, int, int, int, int);
template __global__ void dequant<3>(const uint32_t*, const uint8_t*, __half*, int, int, int, int);
template __global__ void dequant<4>(const uint32_t*, const uint8_t*, __half*, int, int, int, int);
template __global__ void dequant<8>(const uint32_t*, const uint8_t*, __half*, int, int, int, int);
#endif

// Table weights as dense fp16 [N, K], as quant.QuantLUT.dequantize(torch.float16), from kernels.gemv.PackedLUT: one
// thread per (tile, step, lane); an entry is offset + scale * v in float64 (the product is exact, so a contraction into
// an fma changes nothing), rounded to fp32, then to fp16: quant.QuantLUT.values, then the cast. Grouped (G groups of
// group_size per tile record): o + s * entry in float64, uncontracted as on the CPU, then rounded.
template <int BITS>
__global__ void dequant_lut(const uint32_t* __restrict__ qw, const uint8_t* __restrict__ lut, __half* __restrict__ out,
                            int N, int K, int G, int group_size) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    const int steps = K / 64;
    if (idx >= N / 16 * steps * 32) return;
    const int lane = idx & 31, step = (idx >> 5) % steps, tile = (idx >> 5) / steps;
    const int g = lane >> 2, t = lane & 3;
    uint32_t w[BITS];
    lane_words<BITS>(qw + (size_t)idx * BITS, w);
    const uint8_t* rec = lut + (size_t)tile * (lut_record_bytes(BITS) + G * LUT_GROUP_BYTES);
    const __half* grp = reinterpret_cast<const __half*>(rec + lut_record_bytes(BITS) +
                                                        step * 64 / max(group_size, 1) * LUT_GROUP_BYTES);
    uint32_t tg[lut_regs<BITS>()], tg8[lut_regs<BITS>()], a[4][4];
    lut_tables<BITS>(rec, g, tg, tg8);
    lut_fragments<BITS>(w, tg, tg8, 0x64006400u, a);
    float2 sc, of;
    lut_scales<BITS>(rec, g, sc, of);
#pragma unroll
    for (int m = 0; m < 4; m++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = tile * 16 + lut_row(g, j), col = step * 64 + lut_col(t, m, j, h);
                const double v = (double)((a[m][j] >> (16 * h)) & 0x3FFu);  // 1024 + v: its low 10 bits are v
                double e = (j & 1) ? (double)of.y + (double)sc.y * v : (double)of.x + (double)sc.x * v;
                if (G > 0) {  // rows g, g + 8 side by side: 2g + (j & 1)
                    const int r = 2 * g + (j & 1);
                    e = __dadd_rn((double)__half2float(grp[16 + r]), __dmul_rn((double)__half2float(grp[r]), e));
                }
                out[(size_t)row * K + col] = __float2half_rn((float)e);
            }
}
#ifndef __CUDACC_RTC__  // nvcc (resource checks) builds every variant; NVRTC only what kernels/cuda.py asks for
template __global__ void dequant_lut<2>(const uint32_t*, const uint8_t*, __half*, int, int, int, int);
template __global__ void dequant_lut<3>(const uint32_t*, const uint8_t*, __half*, int, int, int, int);
template __global__ void dequant_lut<4>(const uint32_t*, const uint8_t*, __half*, int, int, int, int);
#endif

#ifndef __CUDACC_RTC__  // nvcc (resource checks) builds every variant; NVRTC only what kernels/cuda.py asks for
// (warps per block, ring depth, pairs per slot) variants, chosen by gemv.py: with and without QDEC (QW = 4) the first
// two (decode's; two pairs per slot at group sizes 64 and 128), the sweep's third
#define INST(B, W, D, GS, QW) INST_L(B, W, D, GS, QW, false, 1)
#define INST2(B, W, D, GS, QW) INST_L(B, W, D, GS, QW, false, 2)
#define INST_L(B, W, D, GS, QW, L, Q) INST_LU(B, W, D, GS, QW, L, Q, false)
#define INST_LU(B, W, D, GS, QW, L, Q, U) INST_LUM(B, W, D, GS, QW, L, Q, U, 0)
#define INST_LUM(B, W, D, GS, QW, L, Q, U, MR) template __global__ void gemv<B, W, D, GS, QW, L, Q, U, MR>( \
    const uint8_t*, const uint8_t*, const __half*, const __half*, __half*, int, int, int, uint32_t, const float*, \
    float, int, int, int, const uint32_t*, const __half*, float*, unsigned long long*, int*, int, int, float, float, \
    float, float, const float*, const float*, const long long*, int, int);
#define INST_GS(B, W, D, QW, I) I(B, W, D, 0, QW) I(B, W, D, 1, QW) I(B, W, D, 2, QW) I(B, W, D, 3, QW)
#define INST_BITS(W, D, QW, I) INST_GS(2, W, D, QW, I) INST_GS(3, W, D, QW, I) INST_GS(4, W, D, QW, I)
#define INST_BITS2(W, D, QW) INST2(2, W, D, 0, QW) INST2(2, W, D, 1, QW) INST2(3, W, D, 0, QW) INST2(3, W, D, 1, QW) \
    INST2(4, W, D, 0, QW) INST2(4, W, D, 1, QW)
INST_BITS(16, 3, 0, INST)
INST_BITS2(16, 2, 0)
// 4- and 3-bit weights on the int8 path (gemv.py's uses_int8): group 128, with and without QDEC (QW = 4), decode's
// two variants
#define INST_U8(B, D, Q, QW) INST_LU(B, 16, D, 1, QW, false, Q, true)
INST_U8(4, 3, 1, 0)
INST_U8(4, 2, 2, 0)
INST_U8(3, 3, 1, 0)
INST_U8(3, 2, 2, 0)
INST_U8(4, 3, 1, 4)
INST_U8(4, 2, 2, 4)
INST_U8(3, 3, 1, 4)
INST_U8(3, 2, 2, 4)
// x merged from the attention's runs (MR 2: o's GEMV in the pair graph; MR 8: small models' middle graph without
// clusters): decode's variants of 3- and 4-bit weights, on either path, with and without QDEC, and tables (NVRTC
// compiles whichever one a model's o asks for)
#define INST_MR(B, D, GS, Q, QW, L, U) INST_LUM(B, 16, D, GS, QW, L, Q, U, 2) INST_LUM(B, 16, D, GS, QW, L, Q, U, 8)
INST_MR(4, 2, 1, 2, 0, false, true) INST_MR(3, 2, 1, 2, 0, false, true) INST_MR(4, 3, 1, 1, 0, false, true)
INST_MR(3, 3, 1, 1, 0, false, true) INST_MR(4, 2, 1, 2, 4, false, false) INST_MR(3, 2, 1, 2, 4, false, false)
INST_MR(4, 3, 0, 1, 0, false, false) INST_MR(3, 3, 0, 1, 0, false, false) INST_MR(4, 3, 0, 1, 4, false, false)
INST_MR(3, 3, 0, 1, 4, false, false) INST_MR(3, 2, 1, 1, 0, true, false) INST_MR(4, 2, 1, 1, 0, true, false)
INST_MR(3, 2, 1, 1, 4, true, false)
INST_BITS(8, 5, 0, INST)
INST_BITS(16, 3, 4, INST)
INST_BITS2(16, 2, 4)
// 8 bits (the output head, quant.HEAD_BITS): gemv.py's HEAD_VARIANT, whose rings fit 99 KB of shared memory (sm_89)
INST_GS(8, 16, 2, 0, INST)
// table weights: gemv.py's TABLE_VARIANT, with and without QDEC, per row (GS 0) and grouped by 128 (GS 1)
#define INST_LUT(W, D, GS, QW) INST_L(2, W, D, GS, QW, true, 1) INST_L(3, W, D, GS, QW, true, 1) \
    INST_L(4, W, D, GS, QW, true, 1)
#define INST_LUTS(W, D) INST_LUT(W, D, 0, 0) INST_LUT(W, D, 0, 4) INST_LUT(W, D, 1, 0) INST_LUT(W, D, 1, 4)
INST_LUTS(16, 2)
// gemv.py's SMALLER_VARIANTS, for shapes whose rings and x exceed a GPU's shared memory per block (99 KB on sm_89)
#define INST_SMALLER(W, D) INST_BITS(W, D, 0, INST) INST_BITS(W, D, 4, INST) INST_GS(8, W, D, 0, INST) INST_LUTS(W, D)
INST_BITS(16, 2, 0, INST)
INST_BITS(16, 2, 4, INST)
INST_SMALLER(8, 3)
INST_SMALLER(8, 2)
#endif
