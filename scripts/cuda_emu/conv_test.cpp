#include "emu.h"
#include "../../cuda/conv.cu"
#include <cstdio>
#include <random>
EMU_F16_IMPL
static float bfr(float f) { return bf16_to_f32(f32_to_bf16(f)); }
static float hfr(float f) { return f16_to_f32(f32_to_f16(f)); }
int fails = 0;
void check(const char* what, const std::vector<float>& got, const std::vector<double>& want, double tol) {
    double maxerr = 0, scale = 1e-6;
    for (auto w : want) scale = std::max(scale, std::fabs(w));
    for (size_t i = 0; i < got.size(); i++) { double e = std::fabs(got[i] - want[i]); if (!(e <= maxerr)) maxerr = e; }
    bool ok = maxerr <= tol * scale;
    if (!ok) fails++;
    printf("%-44s max abs err %.3g (scale %.3g, tol %.1e) %s\n", what, maxerr, scale, tol, ok ? "ok" : "FAIL");
}
template <class T, class C> std::vector<T> to(const std::vector<float>& v, C conv) { std::vector<T> r(v.size()); for (size_t i = 0; i < v.size(); i++) r[i] = conv(v[i]); return r; }
template <class T, class C> std::vector<float> from(const std::vector<T>& v, C conv) { std::vector<float> r(v.size()); for (size_t i = 0; i < v.size(); i++) r[i] = conv(v[i]); return r; }
void run(GemsConvGeom g) {
    std::mt19937 rng(1); std::uniform_real_distribution<float> U(-1, 1);
    int cg = g.c_in / g.groups, mg = g.c_out / g.groups;
    size_t nx = (size_t)g.n * g.c_in * g.h * g.w, nw = (size_t)g.c_out * cg * g.kh * g.kw, ny = (size_t)g.n * g.c_out * g.h_out * g.w_out;
    std::vector<float> x(nx), w(nw), dy(ny);
    // activations: bf16 values (exact in f32, bf16, and, in [-1, 1], nearly in f16); weights: raw f32
    for (auto& v : x) v = bfr(U(rng)); for (auto& v : w) v = U(rng); for (auto& v : dy) v = bfr(U(rng));
    auto cdiv = [](long a, long b) { return (unsigned)((a + b - 1) / b); };
    long outpix = (long)g.n * g.h_out * g.w_out, inpix = (long)g.n * g.h * g.w;
    char name[128];
    for (int math = 0; math < 4; math++) {
        const char* m = math == 0 ? "f32" : math == 1 ? "tf32" : math == 2 ? "bf16" : "f16";
        // what the kernel sees: activations as stored in T, weights rounded to T at packing
        std::vector<float> xs = x, dys = dy, wr = w;
        if (math == 2) for (auto& v : wr) v = bfr(v);
        if (math == 3) { for (auto& v : wr) v = hfr(v); for (auto& v : xs) v = hfr(v); for (auto& v : dys) v = hfr(v); }
        std::vector<double> y_ref(ny, 0), dx_ref(nx, 0), dw_ref(nw, 0);
        for (int n = 0; n < g.n; n++) for (int k = 0; k < g.c_out; k++) for (int oh = 0; oh < g.h_out; oh++) for (int ow = 0; ow < g.w_out; ow++) {
            int grp = k / mg; size_t yi = (((size_t)n * g.c_out + k) * g.h_out + oh) * g.w_out + ow;
            for (int c = 0; c < cg; c++) for (int r = 0; r < g.kh; r++) for (int s = 0; s < g.kw; s++) {
                int ih = oh * g.stride_h - g.pad_h + r * g.dilation_h, iw = ow * g.stride_w - g.pad_w + s * g.dilation_w;
                if (ih < 0 || ih >= g.h || iw < 0 || iw >= g.w) continue;
                size_t xi = (((size_t)n * g.c_in + grp * cg + c) * g.h + ih) * g.w + iw;
                size_t wi = (((size_t)k * cg + c) * g.kh + r) * g.kw + s;
                y_ref[yi] += (double)xs[xi] * wr[wi]; dx_ref[xi] += (double)dys[yi] * wr[wi]; dw_ref[wi] += (double)dys[yi] * xs[xi];
            }
        }
        // y and dx are rounded once to T: unit roundoff 2^-8 (bf16), 2^-11 (f16) of the largest
        double tol = math == 0 ? 1e-5 : math == 1 ? 1e-2 : math == 2 ? 4e-3 : 6e-4;
        double tolw = math == 1 ? 1e-2 : 1e-5;
        std::vector<float> y(ny, NAN), dx(nx, NAN), dw(nw, 0.5f), partial(3 * nw, NAN);
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
        } else if (math == 2) {
            auto xb = to<gems_bf16>(x, f32_to_bf16), dyb = to<gems_bf16>(dy, f32_to_bf16);
            std::vector<gems_bf16> yb(ny, gems_bf16{0x7fc0}), dxb(nx, gems_bf16{0x7fc0});
            launch(gf, 256, [&] { conv2d_forward_bf16(xb.data(), w.data(), yb.data(), g); });
            launch(gd, 256, [&] { conv2d_backward_data_bf16(dyb.data(), w.data(), dxb.data(), g); });
            launch(gw, 256, [&] { conv2d_backward_filter_bf16(xb.data(), dyb.data(), partial.data(), g); });
            y = from(yb, bf16_to_f32); dx = from(dxb, bf16_to_f32);
        } else {
            auto xh = to<gems_f16>(x, f32_to_f16), dyh = to<gems_f16>(dy, f32_to_f16);
            std::vector<gems_f16> yh(ny, gems_f16{0x7e00}), dxh(nx, gems_f16{0x7e00});
            launch(gf, 256, [&] { conv2d_forward_f16(xh.data(), w.data(), yh.data(), g); });
            launch(gd, 256, [&] { conv2d_backward_data_f16(dyh.data(), w.data(), dxh.data(), g); });
            launch(gw, 256, [&] { conv2d_backward_filter_f16(xh.data(), dyh.data(), partial.data(), g); });
            y = from(yh, f16_to_f32); dx = from(dxh, f16_to_f32);
        }
        launch(uint3{cdiv(nw, 256), 1, 1}, 256, [&] { conv2d_reduce_splits_f32(partial.data(), dw.data(), (int64_t)nw, 3); });
        std::vector<double> dwr(dw_ref); for (auto& v : dwr) v += 0.5;
        snprintf(name, sizeof name, "%s forward", m); check(name, y, y_ref, tol);
        snprintf(name, sizeof name, "%s backward-data", m); check(name, dx, dx_ref, tol);
        snprintf(name, sizeof name, "%s backward-filter (+=, 3 splits)", m); check(name, dw, dwr, tolw);
        if (math >= 2) {
            // the weights really are rounded to T: against unrounded weights the error is larger
            std::vector<double> y_raw(ny, 0);
            for (int n = 0; n < g.n; n++) for (int k = 0; k < g.c_out; k++) for (int oh = 0; oh < g.h_out; oh++) for (int ow = 0; ow < g.w_out; ow++) {
                int grp = k / mg; size_t yi = (((size_t)n * g.c_out + k) * g.h_out + oh) * g.w_out + ow;
                for (int c = 0; c < cg; c++) for (int r = 0; r < g.kh; r++) for (int s = 0; s < g.kw; s++) {
                    int ih = oh * g.stride_h - g.pad_h + r * g.dilation_h, iw = ow * g.stride_w - g.pad_w + s * g.dilation_w;
                    if (ih < 0 || ih >= g.h || iw < 0 || iw >= g.w) continue;
                    y_raw[yi] += (double)xs[(((size_t)n * g.c_in + grp * cg + c) * g.h + ih) * g.w + iw] * w[(((size_t)k * cg + c) * g.kh + r) * g.kw + s];
                }
            }
            double e1 = 0, e2 = 0; for (size_t i = 0; i < ny; i++) { e1 = std::max(e1, std::fabs(y[i] - y_ref[i])); e2 = std::max(e2, std::fabs(y[i] - y_raw[i])); }
            printf("   %s y vs rounded-weight ref %.3g, vs raw-weight ref %.3g\n", m, e1, e2);
        }
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
        int ho = (g.h + 2 * g.pad_h - g.dilation_h * (g.kh - 1) - 1) / g.stride_h + 1;
        int wo = (g.w + 2 * g.pad_w - g.dilation_w * (g.kw - 1) - 1) / g.stride_w + 1;
        if (ho != g.h_out || wo != g.w_out) { printf("bad case %d %d\n", ho, wo); g.h_out = ho; g.w_out = wo; }
        printf("case n%d c%d %dx%d k%d %dx%d s%d,%d p%d,%d d%d,%d g%d\n", g.n, g.c_in, g.h, g.w, g.c_out, g.kh, g.kw, g.stride_h, g.stride_w, g.pad_h, g.pad_w, g.dilation_h, g.dilation_w, g.groups);
        run(g);
    }
    printf(fails ? "FAILURES: %d\n" : "all ok\n", fails);
    return fails != 0;
}
