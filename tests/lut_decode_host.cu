// Host harness for tests/test_lut_decode.py, with the GEMV's own lut.cuh and codes.cuh functions. Input "mode bits n
// k", then the int32 words as unsigned; mode 1 also the tiles' record bytes (PackedLUT.lut). Output, one a line: mode 0
// the n x k codes of the mma-v3 layout (lut_slot / lut_code / lut_row / lut_col); mode 1 the n x k fp16 bit patterns
// (1024 + v) that lut_fragments builds from the select layout; from Packed's words, the n x k codes that mode 2
// decode's half2s (1024 + f * code) and mode 3 u8_operands' bytes (f * code) hold, -1 where a value is no multiple of
// its factor f or (mode 2) not 1024 + a value below 1024.
#include <cstdint>
#include <cstdio>
#include "codes.cuh"
#include <vector>
template <int B>
void run(int mode, int n, int k) {
    const int steps = k / 64, entries = 1 << B;
    std::vector<uint32_t> q((size_t)n / 16 * steps * 32 * B);
    for (auto& v : q) if (scanf("%u", &v) != 1) return;
    const int rec = lut_record_bytes(B);
    std::vector<unsigned> tab(mode == 1 ? (size_t)n / 16 * rec : 0);
    for (auto& v : tab) if (scanf("%u", &v) != 1) return;
    std::vector<int> out((size_t)n * k, -1);
    for (int tile = 0; tile < n / 16; tile++)
        for (int step = 0; step < steps; step++)
            for (int lane = 0; lane < 32; lane++) {
                const int g = lane >> 2, t = lane & 3;
                uint32_t w[B];
                const uint32_t* at = &q[((size_t)tile * steps + step) * 32 * B];  // the step's words
                if (mode >= 2) step_words<B>(at, lane, w);  // Packed's words
                else for (int b = 0; b < B; b++) w[b] = at[lane * B + b];
                uint32_t a[4][4] = {};
                if (mode == 1) {
                    constexpr int R = lut_regs<B>();  // rows g, g + 8: 4 entries' bytes a register
                    uint32_t tg[2][R];
                    for (int r = 0; r < 2; r++)
                        for (int i = 0; i < R; i++) {
                            const unsigned* row = &tab[(size_t)tile * rec + (g + 8 * r) * entries];
                            uint32_t v = 0;
                            for (int e = 0; e < 4 && 4 * i + e < entries; e++) v |= row[4 * i + e] << (8 * e);
                            tg[r][i] = v;
                        }
                    lut_fragments<B>(w, tg[0], tg[1], 0x64006400u, a);
                }
                uint32_t v[4][2] = {};
                if (mode == 2) decode<B>(w, 0x64006400u, a);
                if constexpr (B != 2) if (mode == 3) u8_operands<B>(w, v);
                for (int m = 0; m < 4; m++) for (int j = 0; j < 4; j++) for (int h = 0; h < 2; h++) {
                    const int f = 1 << log2_factor(B, m, j & 1);
                    int o = mode == 0 ? (int)lut_code<B>(w, m, j, h) : (int)((a[m][j] >> (16 * h)) & 0xFFFFu);
                    if (mode == 2) o = (o >> 10) == 0x19 && (o & 1023) % f == 0 ? (o & 1023) / f : -1;
                    if (mode == 3) o = (v[m][j & 1] >> (8 * ((j >> 1) + 2 * h))) & 0xFFu, o = o % f == 0 ? o / f : -1;
                    out[(size_t)(tile * 16 + lut_row(g, j)) * k + step * 64 + lut_col(t, m, j, h)] = o;
                }
            }
    for (size_t i = 0; i < out.size(); i++) printf("%d\n", out[i]);
}
int main() {
    int mode, bits, n, k;
    if (scanf("%d %d %d %d", &mode, &bits, &n, &k) != 4) return 1;
    if (bits == 2) run<2>(mode, n, k); else if (bits == 3) run<3>(mode, n, k); else run<4>(mode, n, k);
    return 0;
}
