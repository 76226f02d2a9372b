// Host harness for tests/test_lut_decode.py: decode packed codes with the table GEMV's own lut_slot / lut_code /
// lut_row / lut_col (input: "bits n k" then the int32 words as unsigned; output: the n x k codes, one a line).
#include <cstdint>
#include <cstdio>
#include "lut.cuh"
#include <vector>
template <int B>
void run(int n, int k) {
    const int steps = k / 64;
    std::vector<uint32_t> q((size_t)n / 16 * steps * 32 * B);
    for (auto& v : q) if (scanf("%u", &v) != 1) return;
    std::vector<int> out((size_t)n * k, -1);
    for (int tile = 0; tile < n / 16; tile++)
        for (int step = 0; step < steps; step++)
            for (int lane = 0; lane < 32; lane++) {
                uint32_t w[B];
                for (int b = 0; b < B; b++) w[b] = q[(((size_t)tile * steps + step) * 32 + lane) * B + b];
                for (int m = 0; m < 4; m++) for (int j = 0; j < 4; j++) for (int h = 0; h < 2; h++)
                    out[(size_t)(tile * 16 + lut_row(lane >> 2, j)) * k + step * 64 + lut_col(lane & 3, m, j, h)] =
                        (int)lut_code<B>(w, m, j, h);
            }
    for (size_t i = 0; i < out.size(); i++) printf("%d\n", out[i]);
}
int main() {
    int bits, n, k;
    if (scanf("%d %d %d", &bits, &n, &k) != 3) return 1;
    if (bits == 2) run<2>(n, k); else if (bits == 3) run<3>(n, k); else run<4>(n, k);
    return 0;
}
