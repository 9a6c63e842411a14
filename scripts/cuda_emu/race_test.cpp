// The race check on one kernel: the forward convolution of conv.cu (the one the include path
// finds first: cuda/, or build.rs's planted copy whose tile loop lacks the __syncthreads that
// ends each tile) in its f32, TF32 and bf16 stamps, on a convolution of five K-tiles. For each
// stamp it prints one line: the kernel, whether its output matches a reference (what the
// emulator shows without the race check), and the race report or "no race". Then the check of
// device memory on two tiny launches (device_check), a line each.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "conv.cu"
EMU_F16_IMPL
#include "racecheck.h"

namespace {
// The buffers a kernel may write, and the race check's shadows of them.
std::vector<std::pair<const char*, std::size_t>> g_device;
std::vector<std::vector<std::uint64_t>> g_shadows;
bool device(const void* p, RaceDevice* d) {
    for (std::size_t i = 0; i < g_device.size(); i++) {
        auto [b, n] = g_device[i];
        if (static_cast<const char*>(p) >= b && static_cast<const char*>(p) < b + n) {
            *d = RaceDevice{reinterpret_cast<std::uintptr_t>(b), reinterpret_cast<std::uintptr_t>(b + n),
                            g_shadows[i].data()};
            return true;
        }
    }
    return false;
}
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
    g_device = {{reinterpret_cast<const char*>(y.data()), y.size() * sizeof(T)}};
    g_shadows = {std::vector<std::uint64_t>((y.size() * sizeof(T) + 1) / 2)};
    racecheck_begin(name);
    launch(uint3{2, 1, 1}, 256, [&] { k(xt.data(), w.data(), y.data(), g); });
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
                scale, racecheck_report() ? racecheck_report() : "no race");
}
float same(float v) { return v; }

// The device check on a launch of two blocks of 32 threads storing 16-bit values, thread t of
// block b at element b * step + t (t < 31): for step 0 both blocks store elements 0..30 (a
// race), for step 31 elements 0..61, adjacent, block 0's last and block 1's first sharing a
// 4-byte word (no race).
void device_check(const char* name, unsigned step) {
    std::vector<unsigned short> y(64);
    g_device = {{reinterpret_cast<const char*>(y.data()), y.size() * sizeof(unsigned short)}};
    g_shadows = {std::vector<std::uint64_t>(y.size())};
    racecheck_begin(name);
    unsigned short* out = y.data();
    launch(uint3{2, 1, 1}, 32, [out, step] {
        if (threadIdx.x < 31) out[blockIdx.x * step + threadIdx.x] = 1;
    });
    std::printf("%s: %s\n", name, racecheck_report() ? racecheck_report() : "no race");
}
}  // namespace

int main() {
    racecheck_init(device);
    check<float>("conv2d_forward_f32", conv2d_forward_f32, same, same, 1e-5);
    check<float>("conv2d_forward_tf32", conv2d_forward_tf32, same, same, 2e-3);
    check<gems_bf16>("conv2d_forward_bf16", conv2d_forward_bf16, bf16_to_f32, f32_to_bf16, 1e-2);
    device_check("two_blocks_one_element", 0);
    device_check("two_blocks_adjacent_halves", 31);
}
