// cp.async: copies from global to shared memory that run in the background (sm_80+), so a thread issues a whole
// tile's loads and holds no registers for them; commit groups them, wait<N> blocks until at most N groups are left.
#pragma once

// A predicated 16-byte copy (no branch, so no divergence bookkeeping around it); through L2 only.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool on) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16;\n}\n" ::"r"(dst),
        "l"(src), "r"((int)on));
}
// The same for bytes read once (a GEMV's weights): marked evict_first in L2, so that a stream larger than L2 does not
// push out what is read again soon (the next GEMV's x, the KV cache), and with a 256-byte L2 fetch. H100: down 86 /
// 76% -> 90 / 80% of copy bandwidth at W4 / W3 (kernels/NOTES.md, session 36). The compiler hoists the createpolicy.
__device__ __forceinline__ void cp_async16_stream(unsigned dst, const void* src, bool on) {
    unsigned long long pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n"
        " @p cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %3;\n}\n" ::"r"(dst),
        "l"(src), "r"((int)on), "l"(pol));
}
// A predicated 4-byte copy (cg takes 16 bytes only; ca goes through L1).
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, bool on) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.ca.shared.global [%0], [%1], 4;\n}\n" ::"r"(dst),
        "l"(src), "r"((int)on));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
