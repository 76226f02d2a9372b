// Programmatic dependent launch (sm_90+; no-ops before): a kernel launched with cuda.launch(early=True) may start
// while the previous kernel in the stream still runs. It calls wait_previous() before it touches memory that earlier
// kernels write, and start_next() once the next kernel may begin its own independent prologue.
#pragma once

__device__ __forceinline__ void wait_previous() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void start_next() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
