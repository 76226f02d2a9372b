// Plain streams through device memory: the references the benchmarks divide by (localllm.bench.read_bandwidth) and
// the bound of any kernel at a GEMV's size (scripts/gemv_bound.py).
#include "pdl.cuh"

typedef unsigned int uint32_t;

constexpr int READ_UNROLL = 8;  // 16-byte loads a thread keeps in flight (47 registers)

// A read of n16 16-byte words. mode 0: plain launch; 1: launched early, waits for the previous kernel before its
// write; 2: launched early, waits before its reads. Writes only if the words' XOR hits a constant, so that the loads
// stay and nothing else is written.
extern "C" __global__ void __launch_bounds__(1024, 1) read_stream(const uint4* __restrict__ p, unsigned long long n16,
                                                                  uint32_t* out, int mode) {
    if (mode) start_next();
    if (mode == 2) wait_previous();
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    uint32_t acc = 0;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16;
         i += READ_UNROLL * stride) {
        uint4 v[READ_UNROLL];
#pragma unroll
        for (int u = 0; u < READ_UNROLL; u++)  // past the end: the last word again (no branch between the loads)
            v[u] = __ldcs(p + min(i + u * stride, n16 - 1));
#pragma unroll
        for (int u = 0; u < READ_UNROLL; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (mode == 1) wait_previous();
    if (acc == 0x9E3779B9u) out[blockIdx.x] = acc;
}
