// The memory and race checks (racecheck.cpp) on kernels of cuda/*.cu, found on the include path
// first in build.rs's planted folder (race_test_planted) or not (race_test). The planted
// copies: conv.cu whose tile loop lacks the __syncthreads that ends each tile, gems_device.h
// whose block_sum lacks the __syncthreads between writing and reading its scratch, and
// elementwise.cu whose fill writes one element past its output. One line per check:
//   - the forward convolution in its f32, TF32 and bf16 stamps, on five K-tiles: whether its
//     output matches a reference (what the emulator shows without the race check), and the
//     report or "no race";
//   - two tiny launches of 16-bit stores from two blocks (device_check);
//   - batchnorm_stats_f32 (two block_sums), fill_f32, and add_f32 called with its output
//     overlapping its input one block's worth of elements further on (block 0 reads what
//     block 1 writes: a cross-block read-write race, in both builds), and on disjoint buffers.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "batchnorm.cu"
#undef STAMP
#include "conv.cu"
#undef STAMP
#include "elementwise.cu"
#undef STAMP
EMU_F16_IMPL
#include "racecheck.h"

namespace {
// The buffers a kernel may touch (device memory, here), and the race check's shadows of them.
std::vector<std::pair<const char*, std::size_t>> g_device;
std::vector<std::vector<RaceUnit>> g_shadows;
// Not instrumented: the checks call it.
EMU_INTERNAL bool device(const void* p, bool, RaceDevice* d) {
    auto a = reinterpret_cast<std::uintptr_t>(p);
    *d = RaceDevice{0, 0, nullptr, false};
    std::uintptr_t best = ~std::uintptr_t(0);
    for (std::size_t i = 0; i < g_device.size(); i++) {
        auto lo = reinterpret_cast<std::uintptr_t>(g_device[i].first), hi = lo + g_device[i].second;
        std::uintptr_t dist = a < lo ? lo - a : a >= hi ? a - hi + 1 : 0;
        if (dist < best) {
            best = dist;
            *d = RaceDevice{lo, hi, g_shadows[i].data(), false};
        }
    }
    return best == 0;
}
// Makes `buffers` the device memory (fresh shadows) and begins a launch of `name`.
template <typename... V> void begin(const char* name, std::vector<V>&... buffers) {
    g_device = {{reinterpret_cast<const char*>(buffers.data()), buffers.size() * sizeof(V)}...};
    g_shadows = {std::vector<RaceUnit>((buffers.size() * sizeof(V) + 1) / 2)...};
    racecheck_begin(name);
}
const char* outcome() { return racecheck_report() ? racecheck_report() : "no race"; }

template <typename T> void check(const char* name, void (*k)(const T*, const float*, T*, GemsConvGeom),
                                 float (*widen)(T), T (*narrow)(float), double tol) {
    // n c h w k kh kw sh sw ph pw dh dw groups ho wo: K = 70 (five tiles of 16), M = 8, N = 75.
    GemsConvGeom g{3, 70, 5, 5, 8, 1, 1, 1, 1, 0, 0, 1, 1, 1, 5, 5};
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> u(-1, 1);
    std::vector<float> x(3 * 70 * 25), w(8 * 70);
    for (float& v : x) v = widen(narrow(u(rng)));
    for (float& v : w) v = widen(narrow(u(rng)));
    std::vector<T> xt(x.size()), y(3 * 8 * 25, narrow(NAN));
    for (std::size_t i = 0; i < x.size(); i++) xt[i] = narrow(x[i]);
    begin(name, xt, w, y);
    launch(uint3{2, 1, 1}, 256, [k, xp = xt.data(), wp = w.data(), yp = y.data(), g] { k(xp, wp, yp, g); });
    double err = 0, scale = 0;
    for (int n = 0; n < 3; n++)
        for (int m = 0; m < 8; m++)
            for (int p = 0; p < 25; p++) {
                double want = 0;
                for (int c = 0; c < 70; c++) want += (double)w[m * 70 + c] * x[(n * 70 + c) * 25 + p];
                err = std::fmax(err, std::fabs(widen(y[(n * 8 + m) * 25 + p]) - want));
                scale = std::fmax(scale, std::fabs(want));
            }
    std::printf("%s: values %s (max error %.3g of %.3g); %s\n", name, err <= tol * scale ? "right" : "wrong", err,
                scale, outcome());
}
float same(float v) { return v; }

// The device check on a launch of two blocks of 32 threads storing 16-bit values, thread t of
// block b at element b * step + t (t < 31): for step 0 both blocks store elements 0..30 (a
// race), for step 31 elements 0..61, adjacent, block 0's last and block 1's first sharing a
// 4-byte word (no race).
void device_check(const char* name, unsigned step) {
    std::vector<unsigned short> y(64);
    begin(name, y);
    unsigned short* out = y.data();
    launch(uint3{2, 1, 1}, 32, [out, step] {
        if (threadIdx.x < 31) out[blockIdx.x * step + threadIdx.x] = 1;
    });
    std::printf("%s: %s\n", name, outcome());
}

// Batch statistics of 4 channels (one block of 512 threads each, 16 warps to reduce).
void block_sum_check() {
    GemsBatchNorm bn{{2, 4, 300}, 1e-5};
    std::vector<float> x(2 * 4 * 300), mean(4), var(4);
    for (std::size_t i = 0; i < x.size(); i++) x[i] = float(i % 7);
    begin("batchnorm_stats_f32", x, mean, var);
    launch(uint3{4, 1, 1}, 512, [xp = x.data(), m = mean.data(), v = var.data(), bn] { batchnorm_stats_f32(xp, m, v, bn); });
    std::printf("batchnorm_stats_f32: %s\n", outcome());
}

// fill_f32 over 1000 elements.
void fill_check() {
    std::vector<float> y(1000 + 64);  // the device allocation is the first 1000
    begin("fill_f32", y);
    g_device[0].second = 1000 * sizeof(float);
    launch(uint3{4, 1, 1}, 256, [yp = y.data()] { fill_f32(yp, 1.0f, 1000); });
    std::printf("fill_f32: %s\n", outcome());
}

// add_f32 on 512 elements in two blocks of 256: y = a + b with y = a - 256 elements (block 0
// reads the a[i] = y[i + 256] block 1 writes) or disjoint.
void add_check(bool overlap) {
    std::vector<float> buf(768, 1.0f), b(512, 1.0f), out(512);
    const char* name = overlap ? "add_f32_overlapping" : "add_f32_disjoint";
    begin(name, buf, b, out);
    float* a = overlap ? buf.data() + 256 : buf.data();
    float* y = overlap ? buf.data() : out.data();
    launch(uint3{2, 1, 1}, 256, [a, bp = b.data(), y] { add_f32(a, bp, y, 512); });
    std::printf("%s: %s\n", name, outcome());
}
}  // namespace

int main() {
    racecheck_init(device, nullptr, true);
    check<float>("conv2d_forward_f32", conv2d_forward_f32, same, same, 1e-5);
    check<float>("conv2d_forward_tf32", conv2d_forward_tf32, same, same, 2e-3);
    check<gems_bf16>("conv2d_forward_bf16", conv2d_forward_bf16, bf16_to_f32, f32_to_bf16, 1e-2);
    device_check("two_blocks_one_element", 0);
    device_check("two_blocks_adjacent_halves", 31);
    block_sum_check();
    fill_check();
    add_check(true);
    add_check(false);
}
