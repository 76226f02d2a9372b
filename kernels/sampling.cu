// Choosing the next token at the end of a decode step (localllm/sampling.py defines the function: next_token, then
// the decoder's bookkeeping). Each kernel replaces a chain of torch launches; a single-row reduction or softmax over
// 128K logits took 14-34 us there, a kernel launch inside a CUDA graph ~1-2 us.
//
// params (float32 [5]): temperature (1 when greedy), top_p, top_k, repetition penalty, min_p. Every kernel ends by
// writing the token, marking it seen and advancing the draw counter, as Decoder does after next_token.
typedef long long int64;

// sampling.penalized: the same IEEE operations as the torch reference, so the same bits
__device__ __forceinline__ float penalize(float x, bool seen, float rep) {
    return seen ? (x > 0.0f ? x / rep : x * rep) : x;
}

__device__ __forceinline__ void commit(int64 token, int64* tok, bool* seen, int64* drawn) {
    tok[0] = token;
    seen[token] = true;
    drawn[0] += 1;
}

// Whether this block is the last of the grid to get here (every thread calls it; `done` starts at zero). Writes
// before it, of every block, are seen by the last one (which reads them with __ldcg, past its SM's L1).
__device__ bool last_to_finish(unsigned int* done) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// Greedy: the first index of the largest penalized logit (torch.argmax's rule for ties). Blocks of 1024 threads take
// 16K logits a round, each thread 4 consecutive ones per load and 4 loads at a time; the last block to finish reduces
// the blocks' picks (one block alone was latency-bound: 10 / 20 us at 49K / 128K).
constexpr int GREEDY_SPAN = 16 * 1024;  // logits per block per round

__device__ __forceinline__ void better(float x, int i, float& best, int& at) {
    if (x > best || (x == best && i < at)) best = x, at = i;
}

// the block's pick into (best, at) of thread 0
__device__ __forceinline__ void block_best(float& best, int& at) {
    for (int o = 16; o > 0; o >>= 1) {
        const float b = __shfl_xor_sync(0xffffffffu, best, o);
        const int a = __shfl_xor_sync(0xffffffffu, at, o);
        better(b, a, best, at);
    }
    __shared__ float wb[32];
    __shared__ int wa[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) wb[warp] = best, wa[warp] = at;
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) better(wb[w], wa[w], best, at);
}

__global__ void __launch_bounds__(1024) greedy_token(const float* __restrict__ logits, bool* seen,
                                                    const float* __restrict__ params, int V, float* part_best,
                                                    int* part_at, unsigned int* done, int64* tok, int64* drawn) {
    const float rep = params[3];
    float best = __int_as_float(0xff800000u);  // -inf (NVRTC has no INFINITY)
    int at = 0x7fffffff;
    for (int i0 = blockIdx.x * GREEDY_SPAN + 4 * threadIdx.x; i0 < V; i0 += gridDim.x * GREEDY_SPAN) {
        float x[16];
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int i = i0 + (j / 4) * 4 * blockDim.x + j % 4;
            x[j] = i < V ? penalize(logits[i], seen[i], rep) : __int_as_float(0xff800000u);
        }
#pragma unroll
        for (int j = 0; j < 16; j++) better(x[j], i0 + (j / 4) * 4 * blockDim.x + j % 4, best, at);
    }
    block_best(best, at);
    if (threadIdx.x == 0) part_best[blockIdx.x] = best, part_at[blockIdx.x] = at;
    if (!last_to_finish(done)) return;
    best = __int_as_float(0xff800000u), at = 0x7fffffff;
    for (int b = threadIdx.x; b < (int)gridDim.x; b += blockDim.x)
        better(__ldcg(&part_best[b]), __ldcg(&part_at[b]), best, at);
    block_best(best, at);
    if (threadIdx.x == 0) commit(at < V ? at : 0, tok, seen, drawn);  // all NaN: token 0
}

// ---- The sampled choice without sorting the vocabulary: one kernel, sample_token ----
//
// sampling.nucleus only needs the descending order of the warped logits z near three points: the top-k-th token, the
// top-p crossing (or min-p's last kept token, where that comes first) and the draw. The grid (at most one block per
// SM, all resident: it meets at grid barriers):
// 1. z = penalized logits / temperature, and the maximum m;
// 2. a histogram of z over bins of 1/16 nat below m: each bin's count and mass (and the mass min-p keeps);
// 3. every block reads off the histogram's prefix sums which bins can hold the three points (make_plan), gathers their
//    tokens, and the last block to finish sorts them and reads the choice off (choose_gathered). Bins follow the
//    sort's order (z descending, ties in index order), so the bins before the gathered ones count by their sums.
// Masses are integers, q = rint(exp(z - m) * 2^39): exact, order-free sums, so the same bits on every replay (a token
// more than ~27 nats below the top gets 0, where the reference's share is < 1e-12). Where the gathered bins hold more
// than `cap` tokens (flat distributions) the grid instead selects each point over the whole vocabulary by radix
// selection of its key (grid_first), a barrier per 8 bits.
typedef unsigned long long u64;
typedef unsigned int u32;

constexpr int NBINS = 512;       // 1/16 nat each; the last also takes everything further down
constexpr int THREADS = 1024;    // per block
constexpr int CHUNK = 4 * THREADS;  // tokens of a chunk; block b takes chunks b, b + gridDim.x, ...
constexpr int CAP = 2048;        // the most gathered tokens the last block sorts (kernels/sampling.py CAP)
constexpr int NONE = 0x7fffffff;
constexpr int RADIX_SETS = 4;    // digit histograms of the slow path: one per selection (each 4 passes of 8 bits)

__device__ __forceinline__ u64 mass_of(float z, float m) {
    const float e = expf(z - m) * 549755813888.0f;  // 2^39
    return e > 0.0f ? __float2ull_rn(e) : 0ull;      // NaN: 0
}

// min-p keeps a token whose probability relative to the largest is at least min_p (sampling.nucleus's e >= min_p)
__device__ __forceinline__ bool minp_keeps(float z, float m, float min_p) { return expf(z - m) >= min_p; }

__device__ __forceinline__ int bin_of(float z, float m) {
    const float d = (m - z) * 16.0f;  // monotone in z, so bins keep the sort's order
    return d < (float)(NBINS - 1) ? max((int)d, 0) : NBINS - 1;
}

// A 32-bit key whose ascending order is z's descending order (-0 counts as +0: torch's sort sees them equal)
__device__ __forceinline__ u32 key_of(float z) {
    const u32 u = __float_as_uint(z == 0.0f ? 0.0f : z);
    return (u & 0x80000000u) ? u : ~(u | 0x80000000u);
}
__device__ __forceinline__ float z_of(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? k : ~k & 0x7fffffffu);
}

// Global memory the kernel shares across blocks (one zeroed buffer per call: a memset node in a CUDA graph)
struct Work {
    u32 barrier, done, gathered, pad;
    u32 hist_count[NBINS];
    u64 hist_mass[NBINS];
    u32 radix_count[RADIX_SETS][4][256];
    u64 radix_mass[RADIX_SETS][4][256];
    u64 kept_mass;
    u64 minp_mass;  // the mass of the tokens min-p keeps (min_p > 0)
    int found;
};
static_assert(sizeof(Work) <= 56 * 1024, "kernels/sampling.py's WORK_BYTES");

// Lanes add 1 and their mass q to bin b of a block's histogram (b = n: none). The mass goes into two 32-bit halves
// (q <= 2^39: bits 0-19 and 20-38; 4096 tokens' sums fit): 64-bit atomics on shared memory stalled where many tokens
// share a bin (flat logits: 2.7x slower). A warp whose lanes all share one bin (flat distributions) adds once.
__device__ __forceinline__ void add_to(u32* count, u32* lo, u32* hi, int b, int n, u64 q, int lane) {
    const u32 ql = (u32)(q & 0xfffffu), qh = (u32)(q >> 20);
    if (__all_sync(0xffffffffu, b == __shfl_sync(0xffffffffu, b, 0))) {
        const u32 sl = __reduce_add_sync(0xffffffffu, ql), sh = __reduce_add_sync(0xffffffffu, qh);
        if (lane == 0 && b < n) atomicAdd(&count[b], 32u), atomicAdd(&lo[b], sl), atomicAdd(&hi[b], sh);
    } else if (b < n) {
        atomicAdd(&count[b], 1u);
        if (q) atomicAdd(&lo[b], ql), atomicAdd(&hi[b], qh);
    }
}
__device__ __forceinline__ u64 joined(u32 lo, u32 hi) { return ((u64)hi << 20) + lo; }

// All blocks meet: writes before it are seen by every block after it (reads of other blocks' data use __ldcg, past
// the SM's L1). A block that never comes (not all resident: SMs held by another process's kernels) traps after
// ~10 s instead of hanging the GPU, as qdec.cuh's flag_wait.
__device__ void grid_sync(Work* w, u32& target) {
    target += gridDim.x;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(&w->barrier, 1u);
        long long spins = 0;
        while (*(volatile u32*)&w->barrier < target) {
            if (++spins > 20000000LL) __trap();  // ~0.5 us an L2 round trip
        }
        __threadfence();
    }
    __syncthreads();
}

struct Plan {
    int lo, hi, cnt, k;
    u64 before, total, minp;  // minp: the mass of the tokens min-p keeps (total when it is off)
};

// first b in [0, NBINS) with a[b] > x (a ascending), NBINS if none
template <typename T>
__device__ int first_above(const T* a, T x) {
    int lo = 0, hi = NBINS;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (a[mid] > x) hi = mid; else lo = mid + 1;
    }
    return lo;
}

// floor(f x), f in [0, 1]
__device__ __forceinline__ u64 times(float f, u64 x) { return (u64)((double)f * (double)x); }

// top-p keeps the tokens whose mass before them is below top_p C (transformers' rule), so its last kept token is the
// first whose running mass reaches top_p C: passes ceil(top_p C) - 1, as the masses are whole numbers
__device__ __forceinline__ u64 top_p_mark(float top_p, u64 C) {
    const u64 t = (u64)ceil((double)top_p * (double)C);
    return t ? t - 1 : 0;
}

struct Shared {
    u32 ccnt[NBINS];
    u64 cmass[NBINS];
    Plan P;
    union {
        u64 keys[CAP];  // the gathered tokens, sorted
        struct {
            u32 count[NBINS], lo[NBINS], hi[NBINS];
        } hist;  // this block's share of the histogram, per chunk
        struct {
            u32 count[256], lo[256], hi[256];
        } digits;  // this block's share of a radix pass, per chunk
    };
    u32 wsum[THREADS / 32], total;
    u64 wmass[THREADS / 32];
    float m, top_p, top_k, min_p, u;  // (the settings and the draw, loaded while the logits are read)
    u64 c_last, sum;
    int at, cut, drop;
    u32 prefix;
    u64 before;
    bool ok;
};

// Which bins to gather, from the histogram's prefix sums: [lo, hi], cnt tokens, `before` the mass of the bins before
// lo.
// - top-k on: bins 0.. the one holding the k-th token (the kept mass needs every kept token, ties with the k-th too);
// - else min-p keeps mass M <= top_p * C (its last kept token comes first; C the total): from M's bin back to the
//   draw's, u * M;
// - else top-p < 1: from the bin where the mass passes top_p_mark (the crossing) back to the one where it passes
//   u times that mark (the draw is at or after it, as the kept mass is above the mark);
// - else: the draw's bin alone (u * M).
__device__ void make_plan(const Work* w, int V, Shared& S) {
    if (threadIdx.x < 32) {  // inclusive prefix sums over the bins, 16 per lane
        constexpr int L = NBINS / 32;
        const int lane = threadIdx.x;
        u32 c[L], ca = 0;
        u64 s[L], sa = 0;
#pragma unroll
        for (int j = 0; j < L; j++) {
            ca += __ldcg(&w->hist_count[lane * L + j]), sa += __ldcg(&w->hist_mass[lane * L + j]);
            c[j] = ca, s[j] = sa;
        }
        u32 co = ca;
        u64 so = sa;
        for (int o = 1; o < 32; o <<= 1) {
            const u32 cy = __shfl_up_sync(0xffffffffu, co, o);
            const u64 sy = __shfl_up_sync(0xffffffffu, so, o);
            if (lane >= o) co += cy, so += sy;
        }
        co -= ca, so -= sa;  // exclusive
#pragma unroll
        for (int j = 0; j < L; j++) S.ccnt[lane * L + j] = c[j] + co, S.cmass[lane * L + j] = s[j] + so;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        Plan& P = S.P;
        const float top_p = S.top_p, top_k = S.top_k, u = S.u;
        const u64 total = S.cmass[NBINS - 1];
        const u64 M = S.min_p > 0.0f ? __ldcg(&w->minp_mass) : total;
        const int k = top_k > 0.0f ? (int)fminf(top_k, (float)V) : 0;
        int lo = -1, hi = -1;
        if (k > 0) {
            lo = 0, hi = min(first_above<u32>(S.ccnt, (u32)k - 1), NBINS - 1);
        } else if (top_p < 1.0f) {
            const u64 thr = top_p_mark(top_p, total);
            if (M <= thr && M > 0) {  // min-p's last kept token: the mass through it is M
                hi = first_above<u64>(S.cmass, M - 1), lo = min(first_above<u64>(S.cmass, times(u, M)), hi);
            } else {
                const int b = first_above<u64>(S.cmass, thr);
                if (b < NBINS) hi = b, lo = min(first_above<u64>(S.cmass, times(u, thr)), b);
            }
        }
        if (hi < 0) {
            int b = first_above<u64>(S.cmass, times(u, M));
            if (b == NBINS) b = first_above<u32>(S.ccnt, S.ccnt[NBINS - 1] - 1);  // rounding: the last bin with tokens
            lo = hi = min(b, NBINS - 1);
        }
        P.lo = lo, P.hi = hi, P.k = k, P.total = total, P.minp = M;
        P.before = lo ? S.cmass[lo - 1] : 0;
        P.cnt = (int)(S.ccnt[hi] - (lo ? S.ccnt[lo - 1] : 0u));
    }
    __syncthreads();
}

// The block's exclusive prefix sum of x (every thread calls it), in thread order; the block's total into `total`.
// warp_sums: THREADS / 32 shared slots.
template <typename T>
__device__ T block_exclusive(T x, T* warp_sums, T& total) {
    const int lane = threadIdx.x & 31;
    T incl = x;
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) warp_sums[threadIdx.x >> 5] = incl;
    __syncthreads();
    if (threadIdx.x == 0) {
        T a = 0;
        for (int w = 0; w < THREADS / 32; w++) {
            const T s = warp_sums[w];
            warp_sums[w] = a;
            a += s;
        }
        total = a;
    }
    __syncthreads();
    return warp_sums[threadIdx.x >> 5] + incl - x;
}

// The first of a thread's 4 sorted tokens i0.. (of n) whose running mass c passes target, into *slot (the least over
// the block)
__device__ __forceinline__ void first_past(const u64 (&c)[4], int i0, int n, u64 target, int* slot) {
#pragma unroll
    for (int e = 0; e < 4; e++)
        if (i0 + e < n && c[e] > target) {
            atomicMin(slot, i0 + e);
            return;
        }
}

// The last block: the n gathered tokens sorted, then nucleus() and the draw over them
__device__ int choose_gathered(const u64* cand, int n, Shared& S) {
    const Plan& P = S.P;
    int N = 2;
    while (N < n) N <<= 1;
    for (int i = threadIdx.x; i < N; i += THREADS) S.keys[i] = i < n ? __ldcg(&cand[i]) : ~0ull;
    __syncthreads();
    for (int k = 2; k <= N; k <<= 1)  // bitonic sort, ascending: z descending, then the index
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < N; i += THREADS) {
                const int l = i ^ j;
                if (l > i) {
                    const u64 a = S.keys[i], b = S.keys[l];
                    if ((a > b) == ((i & k) == 0)) S.keys[i] = b, S.keys[l] = a;
                }
            }
            __syncthreads();
        }
    // each thread: 4 consecutive tokens of the sorted list, their running masses (top-k: 0 past the k-th one's key)
    const u32 kkey = P.k > 0 ? (u32)(S.keys[P.k - 1] >> 32) : 0xffffffffu;
    const int i0 = 4 * threadIdx.x;
    u64 c[4], a = 0;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const int i = i0 + e;
        const u32 k = (u32)(S.keys[min(i, N - 1)] >> 32);
        a += i < n && k <= kkey ? mass_of(z_of(k), S.m) : 0ull;
        c[e] = a;
    }
    if (threadIdx.x == 0) S.cut = S.at = S.drop = NONE;
    const u64 off = P.before + block_exclusive(a, S.wmass, S.sum);  // S.sum: the gathered tokens' mass
#pragma unroll
    for (int e = 0; e < 4; e++) c[e] += off;
    const u64 C = P.k > 0 ? S.sum : P.total;  // top-k: the gathered bins hold every kept token
    // min-p's kept tokens and top-k's are both prefixes of the order, so those both keep are the shorter one
    const u64 M = min(P.minp, C);
    if (S.top_p < 1.0f) first_past(c, i0, n, top_p_mark(S.top_p, C), &S.cut);  // top-p's last kept token
    if (S.min_p > 0.0f)  // the first gathered token min-p drops
#pragma unroll
        for (int e = 0; e < 4; e++)
            if (i0 + e < n && !minp_keeps(z_of((u32)(S.keys[i0 + e] >> 32)), S.m, S.min_p)) {
                atomicMin(&S.drop, i0 + e);
                break;
            }
    __syncthreads();
    const bool crossed = S.cut != NONE;
#pragma unroll
    for (int e = 0; e < 4; e++)
        if (crossed && i0 + e == S.cut) S.c_last = min(c[e], M);
    if (!crossed && threadIdx.x == 0) S.c_last = M;  // every token top-p sees kept
    __syncthreads();
    first_past(c, i0, n, times(S.u, S.c_last), &S.at);  // the draw: where the running mass passes u times the kept
    __syncthreads();
    const int last = min(crossed ? S.cut : n - 1, S.drop == NONE ? n - 1 : max(S.drop - 1, 0));
    return (int)(u32)S.keys[min(S.at, last)];  // (S.at NONE only by rounding)
}

// The first token in sorted order whose running count (by_mass false) or mass (0 for keys past kkey: top-k) passes
// target, over the whole vocabulary: its key by radix selection, 8 bits a pass (digit histograms in w->radix_*[set]),
// then its place among the tokens of that key (all of one mass, in index order). False where the total does not pass
// target. The same in every block. Returns the token in `idx`, the running mass through it in `c`.
__device__ bool grid_first(const float* z, int V, Work* w, u32& bar, int set, u32 kkey, bool by_mass, u64 target,
                           Shared& S, int& idx, u64& c) {
    const float m = S.m;
    const int lane = threadIdx.x & 31;
    u32 prefix = 0;
    u64 before = 0;
    for (int pass = 0; pass < 4; pass++) {
        const int shift = 24 - 8 * pass;
        for (int c0 = blockIdx.x * CHUNK; c0 < V; c0 += gridDim.x * CHUNK) {
            for (int b = threadIdx.x; b < 256; b += THREADS) S.digits.count[b] = S.digits.lo[b] = S.digits.hi[b] = 0;
            __syncthreads();
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int i = c0 + j * THREADS + threadIdx.x;
                int d = 256;  // none
                u64 q = 0;
                if (i < V) {
                    const float v = __ldcg(&z[i]);
                    const u32 k = key_of(v);
                    if (pass == 0 || (k >> (shift + 8)) == prefix) {
                        d = (k >> shift) & 255;
                        q = by_mass ? (k > kkey ? 0ull : mass_of(v, m)) : 1ull;
                    }
                }
                add_to(S.digits.count, S.digits.lo, S.digits.hi, d, 256, q, lane);
            }
            __syncthreads();
            for (int b = threadIdx.x; b < 256; b += THREADS)
                if (S.digits.count[b]) {
                    atomicAdd(&w->radix_count[set][pass][b], S.digits.count[b]);
                    const u64 s = joined(S.digits.lo[b], S.digits.hi[b]);
                    if (s) atomicAdd(&w->radix_mass[set][pass][b], s);
                }
            __syncthreads();
        }
        grid_sync(w, bar);
        if (threadIdx.x < 32) {  // the digit: 8 per lane, the first whose running total passes target
            u64 s[8], a = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int b = 8 * lane + j;
                a += by_mass ? __ldcg(&w->radix_mass[set][pass][b]) : (u64)__ldcg(&w->radix_count[set][pass][b]);
                s[j] = a;
            }
            u64 incl = a;
            for (int o = 1; o < 32; o <<= 1) {
                const u64 y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            const u64 ex = before + incl - a;
            int first = 8;
#pragma unroll
            for (int j = 7; j >= 0; j--)
                if (ex + s[j] > target) first = j;
            const u32 hit = __ballot_sync(0xffffffffu, first < 8);
            if (lane == 0) S.ok = hit != 0;
            if (hit && lane == __ffs(hit) - 1) {
                S.prefix = (prefix << 8) | (u32)(8 * lane + first);
                S.before = ex + (first ? s[first - 1] : 0ull);
            }
        }
        __syncthreads();
        if (!S.ok) return false;  // the same in every block
        prefix = S.prefix, before = S.before;
        __syncthreads();
    }
    // among the tokens of key `prefix`, the j-th in index order: counts per chunk, then the owner of the chunk finds it
    const u64 g = by_mass ? mass_of(z_of(prefix), m) : 1ull;
    const u64 j = (target - before) / max(g, 1ull);
    const int nchunks = (V + CHUNK - 1) / CHUNK;
    u32* chunk_count = (u32*)w->radix_count[set][0];  // pass 0's digits are read; the slots serve as scratch
    for (int c0 = blockIdx.x * CHUNK; c0 < V; c0 += gridDim.x * CHUNK) {
        u32 n = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int i = c0 + 4 * threadIdx.x + e;
            n += i < V && key_of(__ldcg(&z[i])) == prefix;
        }
        block_exclusive(n, S.wsum, S.total);
        if (threadIdx.x == 0) chunk_count[c0 / CHUNK] = S.total;
        __syncthreads();
    }
    grid_sync(w, bar);
    if (threadIdx.x == 0) {
        u64 a = 0;
        int ch = nchunks - 1;
        for (int q = 0; q < nchunks; q++) {
            const u32 t = __ldcg(&chunk_count[q]);
            if (a + t > j) {
                ch = q;
                break;
            }
            a += t;
        }
        S.at = ch, S.before = j - a;  // the chunk, and the rank within it
    }
    __syncthreads();
    const int ch = S.at;
    if (ch % (int)gridDim.x == (int)blockIdx.x) {
        const int i0 = ch * CHUNK + 4 * threadIdx.x;
        u32 n = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) n += i0 + e < V && key_of(__ldcg(&z[i0 + e])) == prefix;
        const u64 r = S.before, ex = block_exclusive(n, S.wsum, S.total);
        if (r >= ex && r < ex + n) {
            u64 left = r - ex;
            for (int e = 0; e < 4; e++)
                if (i0 + e < V && key_of(__ldcg(&z[i0 + e])) == prefix && left-- == 0) {
                    w->found = i0 + e;
                    break;
                }
        }
    }
    grid_sync(w, bar);
    idx = __ldcg(&w->found), c = before + (j + 1) * g;
    return true;
}

// sampling.nucleus and next_token's draw over the whole vocabulary (the gathered bins would not fit)
__device__ int choose_whole(const float* z, int V, Work* w, u32& bar, Shared& S) {
    const Plan& P = S.P;
    int idx;
    u64 c, C = P.total;
    u32 kkey = 0xffffffffu;  // no top-k: every key kept
    if (P.k > 0) {
        grid_first(z, V, w, bar, 0, kkey, false, (u64)(P.k - 1), S, idx, c);
        kkey = key_of(__ldcg(&z[idx]));
        u64 s = 0;
        for (int c0 = blockIdx.x * CHUNK; c0 < V; c0 += gridDim.x * CHUNK)
            for (int e = 0; e < 4; e++) {
                const int i = c0 + e * THREADS + threadIdx.x;
                if (i < V) {
                    const float v = __ldcg(&z[i]);
                    if (key_of(v) <= kkey) s += mass_of(v, S.m);
                }
            }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if ((threadIdx.x & 31) == 0 && s) atomicAdd(&w->kept_mass, s);
        grid_sync(w, bar);
        C = __ldcg(&w->kept_mass);
    }
    u64 c_last = C;
    int cut = -1;
    if (S.top_p < 1.0f && grid_first(z, V, w, bar, 1, kkey, true, top_p_mark(S.top_p, C), S, idx, c)) c_last = c, cut = idx;
    const u64 M = min(P.minp, C);  // min-p's kept mass (of the tokens top-k keeps: both are prefixes)
    if (M < c_last) c_last = M, cut = -1;  // min-p's last kept token comes first
    if (grid_first(z, V, w, bar, 2, kkey, true, times(S.u, c_last), S, idx, c)) return idx;
    if (cut >= 0) return cut;
    grid_first(z, V, w, bar, 3, kkey, true, c_last - 1, S, idx, c);  // rounding: the last kept token with mass
    return idx;
}

__global__ void __launch_bounds__(THREADS, 1) sample_token(const float* __restrict__ logits, bool* seen,
                                                           const float* __restrict__ params,
                                                           const float* __restrict__ draws, float* z, float* block_max,
                                                           u64* cand, Work* w, int cap, int V, int64* tok,
                                                           int64* drawn) {
    __shared__ Shared S;
    u32 bar = 0;
    const int lane = threadIdx.x & 31;
    if (threadIdx.x == 0) S.top_p = params[1], S.top_k = params[2], S.min_p = params[4], S.u = draws[drawn[0]];
    // 1. z and the maximum
    {
        const float t = params[0], rep = params[3];
        float mx = __int_as_float(0xff800000u);
        for (int c0 = blockIdx.x * CHUNK; c0 < V; c0 += gridDim.x * CHUNK)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = c0 + e * THREADS + threadIdx.x;
                if (i < V) {
                    const float v = penalize(logits[i], seen[i], rep) / t;
                    z[i] = v;
                    mx = fmaxf(mx, v);
                }
            }
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        if (lane == 0) S.wmass[threadIdx.x >> 5] = __float_as_uint(mx);
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int q = 1; q < THREADS / 32; q++) mx = fmaxf(mx, __uint_as_float((u32)S.wmass[q]));
            block_max[blockIdx.x] = mx;
        }
        grid_sync(w, bar);
        if (threadIdx.x < 32) {
            mx = __int_as_float(0xff800000u);
            for (int b = threadIdx.x; b < (int)gridDim.x; b += 32) mx = fmaxf(mx, __ldcg(&block_max[b]));
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            if (threadIdx.x == 0) S.m = mx;
        }
    }
    // 2. the histogram
    __syncthreads();
    const float m = S.m, min_p = S.min_p;
    u64 kept = 0;  // the mass of this thread's tokens that min-p keeps
    for (int c0 = blockIdx.x * CHUNK; c0 < V; c0 += gridDim.x * CHUNK) {
        for (int b = threadIdx.x; b < NBINS; b += THREADS) S.hist.count[b] = S.hist.lo[b] = S.hist.hi[b] = 0;
        __syncthreads();
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int i = c0 + e * THREADS + threadIdx.x;
            int b = NBINS;  // none
            u64 q = 0;
            if (i < V) {
                const float v = z[i];  // this thread's own write
                b = bin_of(v, m), q = mass_of(v, m);
                if (min_p > 0.0f && minp_keeps(v, m, min_p)) kept += q;
            }
            add_to(S.hist.count, S.hist.lo, S.hist.hi, b, NBINS, q, lane);
        }
        __syncthreads();
        for (int b = threadIdx.x; b < NBINS; b += THREADS)
            if (S.hist.count[b]) {
                atomicAdd(&w->hist_count[b], S.hist.count[b]);
                const u64 s = joined(S.hist.lo[b], S.hist.hi[b]);
                if (s) atomicAdd(&w->hist_mass[b], s);
            }
        __syncthreads();
    }
    if (min_p > 0.0f) {
        for (int o = 16; o > 0; o >>= 1) kept += __shfl_xor_sync(0xffffffffu, kept, o);
        if (lane == 0 && kept) atomicAdd(&w->minp_mass, kept);
    }
    grid_sync(w, bar);
    // 3. the plan; gather the bins, the last block chooses; or select over the whole vocabulary
    make_plan(w, V, S);
    const Plan& P = S.P;
    if (P.cnt > cap || P.cnt < 1) {
        const int t = choose_whole(z, V, w, bar, S);
        if (blockIdx.x == 0 && threadIdx.x == 0) commit(t, tok, seen, drawn);
        return;
    }
    for (int c0 = blockIdx.x * CHUNK; c0 < V; c0 += gridDim.x * CHUNK)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int i = c0 + e * THREADS + threadIdx.x;
            float v = 0.0f;
            bool in = false;
            if (i < V) {
                v = z[i];
                const int b = bin_of(v, m);
                in = b >= P.lo && b <= P.hi;
            }
            const u32 mask = __ballot_sync(0xffffffffu, in);
            if (!mask) continue;
            const int leader = __ffs(mask) - 1;
            u32 base = 0;
            if (lane == leader) base = atomicAdd(&w->gathered, __popc(mask));
            base = __shfl_sync(0xffffffffu, base, leader);
            if (in) cand[base + __popc(mask & ((1u << lane) - 1u))] = (u64)key_of(v) << 32 | (u32)i;
        }
    if (!last_to_finish(&w->done)) return;
    const int t = choose_gathered(cand, P.cnt, S);
    if (threadIdx.x == 0) commit(t, tok, seen, drawn);
}
