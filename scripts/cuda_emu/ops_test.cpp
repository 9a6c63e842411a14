#include "emu.h"
#include "../../cuda/batchnorm.cu"
#include "../../cuda/pool.cu"
#include "../../cuda/loss.cu"
#include "../../cuda/optim.cu"
#include "../../cuda/elementwise.cu"
#include "../../cuda/activation.cu"
#include <cstdio>
#include <random>
#include <algorithm>
EMU_F16_IMPL
int fails = 0;
std::mt19937 rng(7);
std::vector<float> rnd(size_t n) { std::uniform_real_distribution<float> U(-2, 2); std::vector<float> v(n); for (auto& x : v) x = U(rng); return v; }
template <class A, class B> void check(const char* what, const A& got, const B& want, double tol) {
    double maxerr = 0, scale = 1e-6;
    for (auto w : want) scale = std::max(scale, std::fabs((double)w));
    for (size_t i = 0; i < got.size(); i++) { double e = std::fabs((double)got[i] - (double)want[i]); if (!(e <= maxerr)) maxerr = e; }
    bool ok = maxerr <= tol * scale; if (!ok) fails++;
    printf("%-34s max abs err %.3g (scale %.3g) %s\n", what, maxerr, scale, ok ? "ok" : "FAIL");
}
void bn() {
    GemsChannelGeom g{3, 5, 37}; GemsBatchNorm b{g, 1e-5};
    size_t N = (size_t)g.n * g.c * g.hw; auto x = rnd(N), dy = rnd(N), gamma = rnd(g.c), beta = rnd(g.c);
    for (auto& v : x) v = v * 3 + 1;
    std::vector<float> mean(g.c), var(g.c), y(N, NAN), yr(N, NAN);
    launch(uint3{(unsigned)g.c, 1, 1}, 512, [&] { batchnorm_stats_f32(x.data(), mean.data(), var.data(), b); });
    std::vector<double> m_ref(g.c, 0), v_ref(g.c, 0); double M = g.n * g.hw;
    for (int c = 0; c < g.c; c++) { for (int n = 0; n < g.n; n++) for (int j = 0; j < g.hw; j++) m_ref[c] += x[(n * g.c + c) * g.hw + j]; m_ref[c] /= M;
        for (int n = 0; n < g.n; n++) for (int j = 0; j < g.hw; j++) { double d = x[(n * g.c + c) * g.hw + j] - m_ref[c]; v_ref[c] += d * d; } v_ref[c] /= M; }
    check("bn stats mean", mean, m_ref, 1e-6); check("bn stats var", var, v_ref, 1e-6);
    launch(uint3{4, 1, 1}, 256, [&] { batchnorm_apply_f32(x.data(), gamma.data(), beta.data(), mean.data(), var.data(), y.data(), b); });
    launch(uint3{4, 1, 1}, 256, [&] { batchnorm_apply_relu_f32(x.data(), gamma.data(), beta.data(), mean.data(), var.data(), yr.data(), b); });
    std::vector<double> y_ref(N), yr_ref(N);
    for (size_t i = 0; i < N; i++) { int c = (i / g.hw) % g.c; y_ref[i] = (x[i] - m_ref[c]) / std::sqrt(v_ref[c] + 1e-5) * gamma[c] + beta[c]; yr_ref[i] = std::max(0.0, y_ref[i]); }
    check("bn apply", y, y_ref, 1e-5); check("bn apply relu", yr, yr_ref, 1e-5);
    for (int relu = 0; relu < 2; relu++) {
        std::vector<float> dg(g.c, 1), db(g.c, 1), sums(2 * g.c), dx(N, NAN);
        if (relu) {
            launch(uint3{(unsigned)g.c, 1, 1}, 512, [&] { batchnorm_backward_reduce_relu_f32(x.data(), gamma.data(), beta.data(), dy.data(), mean.data(), var.data(), dg.data(), db.data(), sums.data(), b); });
            launch(uint3{3, 1, 1}, 256, [&] { batchnorm_backward_dx_relu_f32(x.data(), gamma.data(), beta.data(), dy.data(), mean.data(), var.data(), sums.data(), dx.data(), b); });
        } else {
            launch(uint3{(unsigned)g.c, 1, 1}, 512, [&] { batchnorm_backward_reduce_f32(x.data(), dy.data(), mean.data(), var.data(), dg.data(), db.data(), sums.data(), b); });
            launch(uint3{3, 1, 1}, 256, [&] { batchnorm_backward_dx_f32(x.data(), dy.data(), gamma.data(), mean.data(), var.data(), sums.data(), dx.data(), b); });
        }
        // reference by finite differences of L = sum dy * f(x) in double
        auto fwd = [&](const std::vector<double>& xx, std::vector<double>& out) {
            for (int c = 0; c < g.c; c++) { double m = 0, v = 0; for (int n = 0; n < g.n; n++) for (int j = 0; j < g.hw; j++) m += xx[(n * g.c + c) * g.hw + j]; m /= M;
                for (int n = 0; n < g.n; n++) for (int j = 0; j < g.hw; j++) { double d = xx[(n * g.c + c) * g.hw + j] - m; v += d * d; } v /= M;
                for (int n = 0; n < g.n; n++) for (int j = 0; j < g.hw; j++) { size_t i = (n * g.c + c) * g.hw + j; double o = (xx[i] - m) / std::sqrt(v + 1e-5) * gamma[c] + beta[c]; out[i] = relu ? std::max(0.0, o) : o; } } };
        std::vector<double> xd(x.begin(), x.end()), o1(N), o2(N), dx_ref(N);
        for (size_t i = 0; i < N; i++) { double h = 1e-6; xd[i] += h; fwd(xd, o1); xd[i] -= 2 * h; fwd(xd, o2); xd[i] += h; double s = 0; for (size_t k = 0; k < N; k++) s += dy[k] * (o1[k] - o2[k]); dx_ref[i] = s / (2 * h); }
        std::vector<double> db_ref(g.c, 1), dg_ref(g.c, 1);
        for (size_t i = 0; i < N; i++) { int c = (i / g.hw) % g.c; double xh = (x[i] - m_ref[c]) / std::sqrt(v_ref[c] + 1e-5); double d = dy[i]; if (relu && !(yr[i] > 0)) d = 0; db_ref[c] += d; dg_ref[c] += d * xh; }
        check(relu ? "bn+relu backward dx" : "bn backward dx", dx, dx_ref, 1e-4);
        check(relu ? "bn+relu backward dbeta (+=)" : "bn backward dbeta (+=)", db, db_ref, 1e-5);
        check(relu ? "bn+relu backward dgamma (+=)" : "bn backward dgamma (+=)", dg, dg_ref, 1e-5);
    }
    std::vector<float> rm(g.c, 0.5f), rv(g.c, 2.0f); GemsBnRunning r{g.c, (int64_t)M, 0.1};
    launch(uint3{1, 1, 1}, 32, [&] { batchnorm_update_running_f32(rm.data(), rv.data(), mean.data(), var.data(), r); });
    std::vector<float> rm_ref(g.c), rv_ref(g.c); float mo = 0.1f, unb = (float)(M / (M - 1));
    for (int c = 0; c < g.c; c++) { rm_ref[c] = (1 - mo) * 0.5f + mo * mean[c]; rv_ref[c] = (1 - mo) * 2.0f + mo * var[c] * unb; }
    check("bn update running mean", rm, rm_ref, 0); check("bn update running var", rv, rv_ref, 0);
}
// CPU-backend reference pools
struct PG { int n, c, h, w, kh, kw, sh, sw, ph, pw, ho, wo; };
void pools(GemsPoolGeom g) {
    size_t NI = (size_t)g.n * g.c * g.h * g.w, NO = (size_t)g.n * g.c * g.h_out * g.w_out;
    auto x = rnd(NI), dy = rnd(NO);
    auto win = [&](int o, int s, int k, int p, int n, int& a, int& b) { int st = o * s - p; a = std::max(st, 0); b = std::max(std::min(st + k, n), 0); };
    auto areaf = [&](int oh, int ow) { int sh = oh * g.stride_h, sw = ow * g.stride_w; return (double)((std::min(sh + g.kh, g.h + 2 * g.pad_h) - sh) * (std::min(sw + g.kw, g.w + 2 * g.pad_w) - sw)); };
    std::vector<double> ymax(NO), yavg(NO), dxmax(NI, 0), dxavg(NI, 0);
    for (int p = 0; p < g.n * g.c; p++) for (int oh = 0; oh < g.h_out; oh++) for (int ow = 0; ow < g.w_out; ow++) {
        int h0, h1, w0, w1; win(oh, g.stride_h, g.kh, g.pad_h, g.h, h0, h1); win(ow, g.stride_w, g.kw, g.pad_w, g.w, w0, w1);
        size_t o = ((size_t)p * g.h_out + oh) * g.w_out + ow; double best = -INFINITY; long bi = -1; double s = 0;
        for (int ih = h0; ih < h1; ih++) for (int iw = w0; iw < w1; iw++) { size_t i = ((size_t)p * g.h + ih) * g.w + iw; if (bi < 0 || x[i] > best) { best = x[i]; bi = i; } s += x[i]; }
        ymax[o] = best; yavg[o] = s / areaf(oh, ow); dxmax[bi] += dy[o];
        for (int ih = h0; ih < h1; ih++) for (int iw = w0; iw < w1; iw++) dxavg[((size_t)p * g.h + ih) * g.w + iw] += dy[o] / areaf(oh, ow);
    }
    std::vector<float> y(NO, NAN), dx(NI, NAN);
    launch(uint3{3, 1, 1}, 256, [&] { max_pool_forward_f32(x.data(), y.data(), g); }); check("max pool forward", y, ymax, 0);
    launch(uint3{3, 1, 1}, 256, [&] { max_pool_backward_f32(x.data(), dy.data(), dx.data(), g); }); check("max pool backward", dx, dxmax, 1e-6);
    launch(uint3{3, 1, 1}, 256, [&] { avg_pool_forward_f32(x.data(), y.data(), g); }); check("avg pool forward", y, yavg, 1e-6);
    launch(uint3{3, 1, 1}, 256, [&] { avg_pool_backward_f32(dy.data(), dx.data(), g); }); check("avg pool backward", dx, dxavg, 1e-6);
}
void adaptive(int n, int c, int h, int w, int ho, int wo) {
    GemsPoolGeom g{n, c, h, w, 0, 0, 0, 0, 0, 0, ho, wo};
    size_t NI = (size_t)n * c * h * w, NO = (size_t)n * c * ho * wo; auto x = rnd(NI), dy = rnd(NO);
    std::vector<double> yr(NO), dxr(NI, 0);
    for (int p = 0; p < n * c; p++) for (int oh = 0; oh < ho; oh++) for (int ow = 0; ow < wo; ow++) {
        int h0 = oh * h / ho, h1 = ((oh + 1) * h + ho - 1) / ho, w0 = ow * w / wo, w1 = ((ow + 1) * w + wo - 1) / wo; double a = (h1 - h0) * (w1 - w0), s = 0;
        size_t o = ((size_t)p * ho + oh) * wo + ow;
        for (int ih = h0; ih < h1; ih++) for (int iw = w0; iw < w1; iw++) { s += x[((size_t)p * h + ih) * w + iw]; dxr[((size_t)p * h + ih) * w + iw] += dy[o] / a; }
        yr[o] = s / a; }
    std::vector<float> y(NO, NAN), dx(NI, NAN);
    launch(uint3{2, 1, 1}, 256, [&] { adaptive_avg_pool_forward_f32(x.data(), y.data(), g); }); check("adaptive avg forward", y, yr, 1e-6);
    launch(uint3{2, 1, 1}, 256, [&] { adaptive_avg_pool_backward_f32(dy.data(), dx.data(), g); }); check("adaptive avg backward", dx, dxr, 1e-6);
    if (ho == 1 && wo == 1) {
        launch(uint3{(unsigned)(n * c), 1, 1}, 256, [&] { global_avg_pool_forward_f32(x.data(), y.data(), g); }); check("global avg forward", y, yr, 1e-6);
        launch(uint3{2, 1, 1}, 256, [&] { global_avg_pool_backward_f32(dy.data(), dx.data(), g); }); check("global avg backward", dx, dxr, 1e-6);
    }
}
uint64_t sm(uint64_t z) { z += 0x9E3779B97F4A7C15ull; z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull; z = (z ^ (z >> 27)) * 0x94D049BB133111EBull; return z ^ (z >> 31); }
void misc() {
    int n = 5, k = 300; auto logits = rnd(n * k); std::vector<uint32_t> labels{0, 299, 17, 150, 3};
    std::vector<float> weights{1.0f, 0.5f, 0.0f, 2.0f, 1.0f}, probs(n * k, NAN), block(1, NAN), dl(n * k, NAN); GemsLoss l{n, k, 1, 1.0 / n};
    launch(uint3{1, 1, 1}, 256, [&] { softmax_cross_entropy_f32(logits.data(), labels.data(), weights.data(), probs.data(), block.data(), l); });
    std::vector<double> pr(n * k), lr(n);
    for (int i = 0; i < n; i++) { double m = -INFINITY, s = 0; for (int j = 0; j < k; j++) m = std::max(m, (double)logits[i * k + j]); for (int j = 0; j < k; j++) s += std::exp(logits[i * k + j] - m); for (int j = 0; j < k; j++) pr[i * k + j] = std::exp(logits[i * k + j] - m) / s; lr[i] = std::log(s) - (logits[i * k + labels[i]] - m); }
    std::vector<double> wl{0.0}; for (int i = 0; i < n; i++) wl[0] += weights[i] * lr[i];
    check("softmax probs", probs, pr, 1e-5); check("cross-entropy weighted loss sum", block, wl, 1e-5);
    launch(uint3{2, 1, 1}, 256, [&] { softmax_cross_entropy_backward_f32(probs.data(), labels.data(), weights.data(), dl.data(), l); });
    std::vector<double> dr(n * k); for (int i = 0; i < n; i++) for (int j = 0; j < k; j++) dr[i * k + j] = weights[i] * (pr[i * k + j] - (labels[i] == (uint32_t)j)) / n;
    check("cross-entropy backward", dl, dr, 1e-5);
    // SGD, bit for bit the CPU formula (no FMA)
    for (int nest = 0; nest < 2; nest++) {
        size_t N = 1000; auto w = rnd(N), g = rnd(N), b = rnd(N); auto w2 = w, b2 = b;
        GemsSgdStep s{(int64_t)N, 0.1, 0.9, 5e-4, 1.0, 0.0, nest, 0};
        launch(uint3{2, 1, 1}, 256, [&] { sgd_f32(w.data(), g.data(), b.data(), s); });
        float lr_ = 0.1f, mom = 0.9f, wd = (float)5e-4;
        for (size_t i = 0; i < N; i++) { volatile float gg = g[i] + wd * w2[i]; volatile float bb = mom * b2[i] + gg; b2[i] = bb; volatile float st = nest ? gg + mom * bb : bb; w2[i] -= lr_ * st; }
        check(nest ? "sgd nesterov (bit-exact)" : "sgd (bit-exact)", w, w2, 0); check("sgd buffer (bit-exact)", b, b2, 0);
    }
    // dropout mask
    size_t N = 5000; std::vector<float> mask(N, NAN); GemsDropout d{(int64_t)N, 0.3, 42, 1, (int64_t)N, 0, 0, 1, (int64_t)N};
    launch(uint3{3, 1, 1}, 256, [&] { dropout_mask_f32(mask.data(), d); });
    std::vector<float> mr(N); float keep = (float)(1.0 / 0.7); size_t zeros = 0;
    for (size_t i = 0; i < N; i++) { double u = (double)(sm(42 ^ sm(i)) >> 11) / 9007199254740992.0; mr[i] = u < 0.3 ? 0.0f : keep; zeros += mr[i] == 0; }
    check("dropout mask", mask, mr, 0); printf("   dropout zeros %zu of %zu\n", zeros, N);
    // copy channels, channel sum, relu
    GemsCopyChannels cc{2, 7, 3, 1, 5, 2, 2}; auto src = rnd(2 * 3 * 7); std::vector<float> dst(2 * 5 * 7, -9), dr2(2 * 5 * 7, -9);
    launch(uint3{1, 1, 1}, 256, [&] { copy_channels_f32(src.data(), dst.data(), cc); });
    for (int i = 0; i < 2; i++) for (int c = 0; c < 2; c++) for (int j = 0; j < 7; j++) dr2[(i * 5 + 2 + c) * 7 + j] = src[(i * 3 + 1 + c) * 7 + j];
    check("copy channels", dst, dr2, 0);
    GemsChannelGeom cg{3, 4, 50}; auto dyy = rnd(600); std::vector<float> db(4, 1); std::vector<double> dbr(4, 1);
    for (size_t i = 0; i < 600; i++) dbr[(i / 50) % 4] += dyy[i];
    launch(uint3{4, 1, 1}, 256, [&] { channel_sum_f32(dyy.data(), db.data(), cg); }); check("channel sum (+=)", db, dbr, 1e-6);
}
int main() {
    bn();
    pools(GemsPoolGeom{2, 3, 9, 10, 3, 3, 2, 2, 1, 1, 5, 5});
    pools(GemsPoolGeom{1, 2, 8, 8, 2, 2, 2, 2, 0, 0, 4, 4});
    pools(GemsPoolGeom{1, 2, 7, 7, 3, 3, 2, 2, 0, 0, 4, 4}); // ceil-mode last window
    adaptive(2, 3, 7, 9, 3, 4); adaptive(1, 2, 3, 2, 5, 5); adaptive(2, 3, 6, 5, 1, 1);
    misc();
    printf(fails ? "FAILURES: %d\n" : "all ok\n", fails);
    return fails != 0;
}
