// Choosing the next token at the end of a decode step (localllm/sampling.py defines the function: next_token, then
// the decoder's bookkeeping). Each kernel replaces a chain of torch launches; a single-row reduction or softmax over
// 128K logits took 14-34 us there, a kernel launch inside a CUDA graph ~1-2 us.
//
// params (float32 [4]): temperature (1 when greedy), top_p, top_k, repetition penalty. Every kernel ends by writing
// the token, marking it seen and advancing the draw counter, as Decoder does after next_token.
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

// Greedy: the first index of the largest penalized logit (torch.argmax's rule for ties). One block of 1024 threads,
// each taking 4 consecutive logits per load and 4 loads at a time (one at a time, latency-bound: 30 us at 128K).
__device__ __forceinline__ void better(float x, int i, float& best, int& at) {
    if (x > best || (x == best && i < at)) best = x, at = i;
}

__global__ void __launch_bounds__(1024) greedy_token(const float* __restrict__ logits, bool* seen,
                                                    const float* __restrict__ params, int V, int64* tok,
                                                    int64* drawn) {
    const float rep = params[3];
    float best = __int_as_float(0xff800000u);  // -inf (NVRTC has no INFINITY)
    int at = 0x7fffffff;
    for (int i0 = 4 * threadIdx.x; i0 < V; i0 += 16 * blockDim.x) {
        float x[16];
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int i = i0 + (j / 4) * 4 * blockDim.x + j % 4;
            x[j] = i < V ? penalize(logits[i], seen[i], rep) : __int_as_float(0xff800000u);
        }
#pragma unroll
        for (int j = 0; j < 16; j++) better(x[j], i0 + (j / 4) * 4 * blockDim.x + j % 4, best, at);
    }
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
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) better(wb[w], wa[w], best, at);
        commit(at < V ? at : 0, tok, seen, drawn);  // all NaN: token 0
    }
}

// z = penalized(logits) / temperature, the keys that torch sorts (descending, stable) between the two kernels.
__global__ void warped_logits(const float* __restrict__ logits, const bool* __restrict__ seen,
                              const float* __restrict__ params, float* __restrict__ z, int V) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < V) z[i] = penalize(logits[i], seen[i], params[3]) / params[0];
}

// From the sorted keys s (descending) and their token ids: e_i = exp(s_i - s_0), 0 past top-k; c = cumsum(e); the
// kept tokens are those whose preceding mass c_i - e_i is at most top_p times the total; the token is the first
// whose c_i exceeds u times the kept mass (u = draws[drawn]). One block of 32 warps over rows of 32 keys, in two
// levels: each warp sums a range of rows (the total, and the mass before each range); then only the range holding the
// end of the kept tokens, and the one holding the draw, are scanned, each split again over the 32 warps, each warp
// scanning its rows with shuffles. The same range is always split and summed the same way: the same c.
struct Keys {
    const float* s;
    int V;
    float s0, kth;
    bool topk;
    __device__ float mass(int i) const {
        if (i >= V) return 0.0f;
        const float v = s[i];
        return topk && v < kth ? 0.0f : expf(v - s0);
    }
    // the mass of rows [r0, r1), 8 rows' loads at a time, reduced over the warp
    __device__ float rows_mass(int r0, int r1, int lane) const {
        float m = 0.0f;
        for (int r = r0; r < r1; r += 8) {
            float e[8];
#pragma unroll
            for (int j = 0; j < 8; j++) e[j] = r + j < r1 ? mass(32 * (r + j) + lane) : 0.0f;
#pragma unroll
            for (int j = 0; j < 8; j++) m += e[j];
        }
        for (int o = 16; o > 0; o >>= 1) m += __shfl_xor_sync(0xffffffffu, m, o);
        return m;
    }
};

// The mass before each of the 32 parts of rows [a, b) (part w: rows a + w * per ...), starting from `before`, in
// pre[0..32]; every thread of the block calls it. Returns the rows per part.
__device__ int split(const Keys& k, int a, int b, float before, float* pre) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, per = (b - a + 31) / 32;
    const int r0 = min(b, a + warp * per), r1 = min(b, r0 + per);
    const float m = k.rows_mass(r0, r1, lane);
    __syncthreads();  // pre is free
    if (lane == 0) pre[warp + 1] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        float acc = before;
        pre[0] = acc;
        for (int w = 1; w <= 32; w++) pre[w] = acc = acc + pre[w];
    }
    __syncthreads();
    return per;
}

__global__ void __launch_bounds__(1024, 1) sample_sorted(const float* __restrict__ s, const int64* __restrict__ order,
                                                     const float* __restrict__ params,
                                                     const float* __restrict__ draws, int V, int64* tok, bool* seen,
                                                     int64* drawn) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float top_p = params[1], top_k = params[2];
    const Keys k{s, V, s[0], s[min(max((int)top_k - 1, 0), V - 1)], top_k > 0.0f};
    const int rows = (V + 31) / 32;
    __shared__ float top[33], pre[33], wc[32], v;
    __shared__ int wi[32], last, target, range;

    // level 1: the mass before each warp's range; the range where the kept tokens end (the last one starting at or
    // below top_p of the total)
    const int per1 = split(k, 0, rows, 0.0f, top);
    if (threadIdx.x == 0) {
        const float thr = top_p * top[32];
        int b = 0;
        for (int w = 1; w < 32; w++)
            if (w * per1 < rows && (top_p >= 1.0f || top[w] <= thr)) b = w;
        range = b;
    }
    __syncthreads();

    // level 2 in that range: the last kept token, and c there
    {
        const int a = range * per1, b = min(rows, a + per1);
        const int per = split(k, a, b, top[range], pre);
        const float thr = top_p * top[32];
        const int r0 = min(b, a + warp * per), r1 = min(b, r0 + per);
        float carry = pre[warp], c_at = 0.0f;
        int kept = -1;
        for (int r = r0; r < r1; r++) {
            const int i = 32 * r + lane;
            const float e = k.mass(i);
            float sc = e;
            for (int o = 1; o < 32; o <<= 1) {
                const float y = __shfl_up_sync(0xffffffffu, sc, o);
                if (lane >= o) sc += y;
            }
            const float c = carry + sc;
            if (i < V && (top_p >= 1.0f || c - e <= thr)) kept = i, c_at = c;
            carry = carry + __shfl_sync(0xffffffffu, sc, 31);
        }
        for (int o = 16; o > 0; o >>= 1) {
            const int j = __shfl_xor_sync(0xffffffffu, kept, o);
            const float cc = __shfl_xor_sync(0xffffffffu, c_at, o);
            if (j > kept) kept = j, c_at = cc;
        }
        if (lane == 0) wi[warp] = kept, wc[warp] = c_at;
        __syncthreads();
        if (threadIdx.x == 0) {
            int j = 32 * a - 1;  // none in this range (rounding): the one before it
            float cc = top[range];
            for (int w = 0; w < 32; w++)
                if (wi[w] > j) j = wi[w], cc = wc[w];
            last = max(j, 0);  // j >= 0: token 0 is always kept (no mass before it)
            v = draws[drawn[0]] * cc;
            int t = range;
            for (int w = range - 1; w >= 0; w--)
                if (top[w + 1] > v) t = w;  // the first range whose mass reaches past v
            target = t;
        }
        __syncthreads();
    }

    // level 2 in the draw's range: the first c_i > v
    {
        const int a = target * per1, b = min(rows, a + per1);
        const int per = split(k, a, b, top[target], pre);
        const int r0 = min(b, a + warp * per), r1 = min(b, r0 + per);
        float carry = pre[warp];
        int found = 0x7fffffff;
        for (int r = r0; r < r1; r++) {
            const int i = 32 * r + lane;
            float sc = k.mass(i);
            for (int o = 1; o < 32; o <<= 1) {
                const float y = __shfl_up_sync(0xffffffffu, sc, o);
                if (lane >= o) sc += y;
            }
            const unsigned hit = __ballot_sync(0xffffffffu, i < V && carry + sc > v);
            if (hit) {
                found = 32 * r + __ffs(hit) - 1;
                break;
            }
            carry = carry + __shfl_sync(0xffffffffu, sc, 31);
        }
        if (lane == 0) wi[warp] = found;
        __syncthreads();
        if (threadIdx.x == 0) {
            int f = min(V, 32 * b) - 1;  // none (rounding): the range's last
            for (int w = 0; w < 32; w++) f = min(f, wi[w]);
            commit(order[min(f, last)], tok, seen, drawn);
        }
    }
}
