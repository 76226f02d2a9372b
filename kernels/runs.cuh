// How the decode attention (attention.cu) cuts the context up to a position into runs of 128-position chunks, one
// block's work each: read the same way by the attention's kernels and by a GEMV that merges the runs (gemv.cu).
#pragma once

constexpr int CHUNK = 128;  // positions per chunk

// `used` chunks, `per` chunks a run, `count` runs (splits past them have nothing to do)
struct Runs {
    int used, per, count;
    __device__ Runs(int pos, int splits)
        : used(pos / CHUNK + 1), per((used + splits - 1) / splits), count((used + per - 1) / per) {}
};
