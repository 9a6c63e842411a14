#include "emu.h"
#include "../../cuda/conv.cu"
#include <cstdio>
#include <random>
static float bfr(float f) { return bf16_to_f32(f32_to_bf16(f)); }
int fails = 0;
void check(const char* what, const std::vector<float>& got, const std::vector<double>& want, double tol) {
    double maxerr = 0, scale = 1e-6;
    for (auto w : want) scale = std::max(scale, std::fabs(w));
    for (size_t i = 0; i < got.size(); i++) maxerr = std::max(maxerr, std::fabs(got[i] - want[i]));
    bool ok = maxerr <= tol * scale;
    if (!ok) fails++;
    printf("%-40s max abs err %.3g (scale %.3g) %s\n", what, maxerr, scale, ok ? "ok" : "FAIL");
}
void run(GemsConvGeom g) {
    std::mt19937 rng(1); std::uniform_real_distribution<float> U(-1, 1);
    int cg = g.c_in / g.groups, mg = g.c_out / g.groups;
    size_t nx = (size_t)g.n * g.c_in * g.h * g.w, nw = (size_t)g.c_out * cg * g.kh * g.kw, ny = (size_t)g.n * g.c_out * g.h_out * g.w_out;
    std::vector<float> x(nx), w(nw), dy(ny);
    for (auto& v : x) v = bfr(U(rng)); for (auto& v : w) v = bfr(U(rng)); for (auto& v : dy) v = bfr(U(rng));
    std::vector<double> y_ref(ny, 0), dx_ref(nx, 0), dw_ref(nw, 0);
    for (int n = 0; n < g.n; n++) for (int k = 0; k < g.c_out; k++) for (int oh = 0; oh < g.h_out; oh++) for (int ow = 0; ow < g.w_out; ow++) {
        int grp = k / mg; size_t yi = (((size_t)n * g.c_out + k) * g.h_out + oh) * g.w_out + ow;
        for (int c = 0; c < cg; c++) for (int r = 0; r < g.kh; r++) for (int s = 0; s < g.kw; s++) {
            int ih = oh * g.stride_h - g.pad_h + r * g.dilation_h, iw = ow * g.stride_w - g.pad_w + s * g.dilation_w;
            if (ih < 0 || ih >= g.h || iw < 0 || iw >= g.w) continue;
            size_t xi = (((size_t)n * g.c_in + grp * cg + c) * g.h + ih) * g.w + iw;
            size_t wi = (((size_t)k * cg + c) * g.kh + r) * g.kw + s;
            y_ref[yi] += (double)x[xi] * w[wi]; dx_ref[xi] += (double)dy[yi] * w[wi]; dw_ref[wi] += (double)dy[yi] * x[xi];
        }
    }
    auto cdiv = [](long a, long b) { return (unsigned)((a + b - 1) / b); };
    long outpix = (long)g.n * g.h_out * g.w_out, inpix = (long)g.n * g.h * g.w;
    char name[128];
    for (int math = 0; math < 3; math++) {
        const char* m = math == 0 ? "f32" : math == 1 ? "tf32" : "bf16";
        double tol = math == 0 ? 1e-5 : 1e-2;
        std::vector<float> y(ny, NAN), dx(nx, NAN), dw(nw, 0.5f), partial(3 * nw, NAN);
        std::vector<gems_bf16> xb(nx), wb(nw), dyb(ny), yb(ny, 0x7fc0), dxb(nx, 0x7fc0);
        for (size_t i = 0; i < nx; i++) xb[i] = f32_to_bf16(x[i]);
        for (size_t i = 0; i < nw; i++) wb[i] = f32_to_bf16(w[i]);
        for (size_t i = 0; i < ny; i++) dyb[i] = f32_to_bf16(dy[i]);
        uint3 gf{cdiv(outpix, 64), cdiv(mg, 64), (unsigned)g.groups};
        uint3 gd{cdiv(inpix, 64), cdiv(cg, 64), (unsigned)g.groups};
        uint3 gw{cdiv((long)cg * g.kh * g.kw, 64), cdiv(mg, 64), (unsigned)g.groups * 3};
        if (math == 0) {
            launch(gf, 256, [&] { conv2d_forward_f32(x.data(), w.data(), y.data(), g); });
            launch(gd, 256, [&] { conv2d_backward_data_f32(dy.data(), w.data(), dx.data(), g); });
            launch(gw, 256, [&] { conv2d_backward_filter_f32(x.data(), dy.data(), partial.data(), g); });
        } else if (math == 1) {
            launch(gf, 256, [&] { conv2d_forward_tf32(x.data(), w.data(), y.data(), g); });
            launch(gd, 256, [&] { conv2d_backward_data_tf32(dy.data(), w.data(), dx.data(), g); });
            launch(gw, 256, [&] { conv2d_backward_filter_tf32(x.data(), dy.data(), partial.data(), g); });
        } else {
            launch(gf, 256, [&] { conv2d_forward_bf16(xb.data(), wb.data(), yb.data(), g); });
            launch(gd, 256, [&] { conv2d_backward_data_bf16(dyb.data(), wb.data(), dxb.data(), g); });
            launch(gw, 256, [&] { conv2d_backward_filter_bf16(xb.data(), dyb.data(), partial.data(), g); });
            for (size_t i = 0; i < ny; i++) y[i] = bf16_to_f32(yb[i]);
            for (size_t i = 0; i < nx; i++) dx[i] = bf16_to_f32(dxb[i]);
        }
        launch(uint3{cdiv(nw, 256), 1, 1}, 256, [&] { conv2d_reduce_splits_f32(partial.data(), dw.data(), (int64_t)nw, 3); });
        std::vector<double> dwr(dw_ref); for (auto& v : dwr) v += 0.5;
        snprintf(name, sizeof name, "%s forward", m); check(name, y, y_ref, tol);
        snprintf(name, sizeof name, "%s backward-data", m); check(name, dx, dx_ref, tol);
        snprintf(name, sizeof name, "%s backward-filter (+=, 3 splits)", m); check(name, dw, dwr, tol);
    }
}
int main() {
    // n c h w k kh kw sh sw ph pw dh dw groups ho wo
    GemsConvGeom cases[] = {
        {2, 3, 9, 11, 5, 3, 3, 1, 1, 1, 1, 1, 1, 1, 9, 11},
        {2, 8, 10, 9, 6, 3, 2, 2, 1, 1, 0, 1, 1, 2, 5, 8},
        {1, 4, 12, 12, 70, 3, 3, 2, 2, 2, 2, 2, 2, 1, 6, 6},
        {3, 70, 5, 5, 8, 1, 1, 1, 1, 0, 0, 1, 1, 1, 5, 5},
    };
    for (auto g : cases) {
        // h_out = (h + 2p - d(k-1) - 1)/s + 1
        int ho = (g.h + 2 * g.pad_h - g.dilation_h * (g.kh - 1) - 1) / g.stride_h + 1;
        int wo = (g.w + 2 * g.pad_w - g.dilation_w * (g.kw - 1) - 1) / g.stride_w + 1;
        if (ho != g.h_out || wo != g.w_out) { printf("bad case %d %d\n", ho, wo); g.h_out = ho; g.w_out = wo; }
        printf("case n%d c%d %dx%d k%d %dx%d s%d,%d p%d,%d d%d,%d g%d\n", g.n, g.c_in, g.h, g.w, g.c_out, g.kh, g.kw, g.stride_h, g.stride_w, g.pad_h, g.pad_w, g.dilation_h, g.dilation_w, g.groups);
        run(g);
    }
    printf(fails ? "FAILURES: %d\n" : "all ok\n", fails);
    return fails != 0;
}
