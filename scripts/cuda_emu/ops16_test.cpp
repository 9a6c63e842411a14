// The f32, bf16 and f16 stamps of every non-conv kernel, through one templated harness.
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
std::vector<float> rnd(size_t n, float lo = -2, float hi = 2) { std::uniform_real_distribution<float> U(lo, hi); std::vector<float> v(n); for (auto& x : v) x = U(rng); return v; }
template <class A, class B> void check(const char* ty, const char* what, const A& got, const B& want, double tol) {
    double maxerr = 0, scale = 1e-6;
    for (auto w : want) scale = std::max(scale, std::fabs((double)w));
    for (size_t i = 0; i < got.size(); i++) { double e = std::fabs((double)got[i] - (double)want[i]); if (!(e <= maxerr)) maxerr = e; }
    bool ok = maxerr <= tol * scale; if (!ok) fails++;
    printf("%-5s %-34s max abs err %.3g (scale %.3g, tol %.1e) %s\n", ty, what, maxerr, scale, tol, ok ? "ok" : "FAIL");
}
template <class T> struct Ty;
template <> struct Ty<float> { static float to(float f) { return f; } static float from(float f) { return f; } static constexpr double u = 0; static constexpr const char* name = "f32"; };
template <> struct Ty<gems_bf16> { static gems_bf16 to(float f) { return f32_to_bf16(f); } static float from(gems_bf16 v) { return bf16_to_f32(v); } static constexpr double u = 1.0 / 256; static constexpr const char* name = "bf16"; };
template <> struct Ty<gems_f16> { static gems_f16 to(float f) { return f32_to_f16(f); } static float from(gems_f16 v) { return f16_to_f32(v); } static constexpr double u = 1.0 / 2048; static constexpr const char* name = "f16"; };
template <class T> std::vector<T> to(const std::vector<float>& v) { std::vector<T> r(v.size()); for (size_t i = 0; i < v.size(); i++) r[i] = Ty<T>::to(v[i]); return r; }
template <class T> std::vector<float> from(const std::vector<T>& v) { std::vector<float> r(v.size()); for (size_t i = 0; i < v.size(); i++) r[i] = Ty<T>::from(v[i]); return r; }
template <class T> std::vector<float> rt(const std::vector<float>& v) { return from(to<T>(v)); }  // rounded to T
template <class T> std::vector<T> poison(size_t n) { return to<T>(std::vector<float>(n, NAN)); }

template <class T> struct K;
#define KSET(T, SUF) template <> struct K<T> { \
    static constexpr auto bn_stats = batchnorm_stats_##SUF, bn_apply = batchnorm_apply_##SUF, bn_apply_relu = batchnorm_apply_relu_##SUF; \
    static constexpr auto bn_red = batchnorm_backward_reduce_##SUF, bn_red_relu = batchnorm_backward_reduce_relu_##SUF; \
    static constexpr auto bn_dx = batchnorm_backward_dx_##SUF, bn_dx_relu = batchnorm_backward_dx_relu_##SUF; \
    static constexpr auto maxf = max_pool_forward_##SUF, maxb = max_pool_backward_##SUF, avgf = avg_pool_forward_##SUF, avgb = avg_pool_backward_##SUF; \
    static constexpr auto adaf = adaptive_avg_pool_forward_##SUF, adab = adaptive_avg_pool_backward_##SUF, glof = global_avg_pool_forward_##SUF, glob = global_avg_pool_backward_##SUF; \
    static constexpr auto sce = softmax_cross_entropy_##SUF, sceb = softmax_cross_entropy_backward_##SUF; \
    static constexpr auto add = add_##SUF, mul = mul_##SUF, add_assign = add_assign_##SUF, fill = fill_##SUF, copy = copy_channels_##SUF, dropout = dropout_mask_##SUF; \
    static constexpr auto bias = add_channel_bias_##SUF, csum = channel_sum_##SUF, reluf = relu_forward_##SUF, relub = relu_backward_##SUF; };
KSET(float, f32)
KSET(gems_bf16, bf16)
KSET(gems_f16, f16)

template <class T> void bn() {
    const char* ty = Ty<T>::name; const double u = Ty<T>::u;
    GemsChannelGeom g{3, 5, 37}; GemsBatchNorm b{g, 1e-5};
    size_t N = (size_t)g.n * g.c * g.hw; auto x = rnd(N), dy = rt<T>(rnd(N)), gamma = rnd(g.c), beta = rnd(g.c);
    for (auto& v : x) v = v * 3 + 1;
    x = rt<T>(x);
    auto xt = to<T>(x), dyt = to<T>(dy);
    std::vector<float> mean(g.c), var(g.c); auto yt = poison<T>(N), yrt = poison<T>(N);
    launch(uint3{(unsigned)g.c, 1, 1}, 512, [&] { K<T>::bn_stats(xt.data(), mean.data(), var.data(), b); });
    std::vector<double> m_ref(g.c, 0), v_ref(g.c, 0); double M = g.n * g.hw;
    for (int c = 0; c < g.c; c++) { for (int n = 0; n < g.n; n++) for (int j = 0; j < g.hw; j++) m_ref[c] += x[(n * g.c + c) * g.hw + j]; m_ref[c] /= M;
        for (int n = 0; n < g.n; n++) for (int j = 0; j < g.hw; j++) { double d = x[(n * g.c + c) * g.hw + j] - m_ref[c]; v_ref[c] += d * d; } v_ref[c] /= M; }
    check(ty, "bn stats mean", mean, m_ref, 1e-6); check(ty, "bn stats var", var, v_ref, 1e-6);
    launch(uint3{4, 1, 1}, 256, [&] { K<T>::bn_apply(xt.data(), gamma.data(), beta.data(), mean.data(), var.data(), yt.data(), b); });
    launch(uint3{4, 1, 1}, 256, [&] { K<T>::bn_apply_relu(xt.data(), gamma.data(), beta.data(), mean.data(), var.data(), yrt.data(), b); });
    auto y = from(yt), yr = from(yrt);
    std::vector<double> y_ref(N), yr_ref(N);
    for (size_t i = 0; i < N; i++) { int c = (i / g.hw) % g.c; y_ref[i] = (x[i] - m_ref[c]) / std::sqrt(v_ref[c] + 1e-5) * gamma[c] + beta[c]; yr_ref[i] = std::max(0.0, y_ref[i]); }
    check(ty, "bn apply", y, y_ref, 1e-5 + u); check(ty, "bn apply relu", yr, yr_ref, 1e-5 + u);
    for (int relu = 0; relu < 2; relu++) {
        std::vector<float> dg(g.c, 1), db(g.c, 1), sums(2 * g.c); auto dxt = poison<T>(N);
        if (relu) {
            launch(uint3{(unsigned)g.c, 1, 1}, 512, [&] { K<T>::bn_red_relu(xt.data(), gamma.data(), beta.data(), dyt.data(), mean.data(), var.data(), dg.data(), db.data(), sums.data(), b); });
            launch(uint3{3, 1, 1}, 256, [&] { K<T>::bn_dx_relu(xt.data(), gamma.data(), beta.data(), dyt.data(), mean.data(), var.data(), sums.data(), dxt.data(), b); });
        } else {
            launch(uint3{(unsigned)g.c, 1, 1}, 512, [&] { K<T>::bn_red(xt.data(), dyt.data(), mean.data(), var.data(), dg.data(), db.data(), sums.data(), b); });
            launch(uint3{3, 1, 1}, 256, [&] { K<T>::bn_dx(xt.data(), dyt.data(), gamma.data(), mean.data(), var.data(), sums.data(), dxt.data(), b); });
        }
        auto dx = from(dxt);
        // analytic reference in double (the mask from the stored y: the kernels recompute it
        // from x in f32, which differs only where a positive value rounds to 0 in 16 bits)
        std::vector<double> dx_ref(N), db_ref(g.c, 1), dg_ref(g.c, 1), sdy(g.c, 0), sdyx(g.c, 0);
        for (size_t i = 0; i < N; i++) { int c = (i / g.hw) % g.c; double xh = (x[i] - m_ref[c]) / std::sqrt(v_ref[c] + 1e-5); double d = dy[i]; if (relu && !(yr[i] > 0)) d = 0; sdy[c] += d; sdyx[c] += d * xh; }
        for (int c = 0; c < g.c; c++) { db_ref[c] += sdy[c]; dg_ref[c] += sdyx[c]; }
        for (size_t i = 0; i < N; i++) { int c = (i / g.hw) % g.c; double is = 1 / std::sqrt(v_ref[c] + 1e-5), xh = (x[i] - m_ref[c]) * is; double d = dy[i]; if (relu && !(yr[i] > 0)) d = 0; dx_ref[i] = gamma[c] * is / M * (M * d - sdy[c] - xh * sdyx[c]); }
        check(ty, relu ? "bn+relu backward dx" : "bn backward dx", dx, dx_ref, 1e-4 + u);
        check(ty, relu ? "bn+relu backward dbeta (+=)" : "bn backward dbeta (+=)", db, db_ref, 1e-5);
        check(ty, relu ? "bn+relu backward dgamma (+=)" : "bn backward dgamma (+=)", dg, dg_ref, 1e-5);
    }
}
template <class T> void pools(GemsPoolGeom g) {
    const char* ty = Ty<T>::name; const double u = Ty<T>::u;
    size_t NI = (size_t)g.n * g.c * g.h * g.w, NO = (size_t)g.n * g.c * g.h_out * g.w_out;
    auto x = rt<T>(rnd(NI)), dy = rt<T>(rnd(NO)); auto xt = to<T>(x), dyt = to<T>(dy);
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
    auto y = poison<T>(NO), dx = poison<T>(NI);
    launch(uint3{3, 1, 1}, 256, [&] { K<T>::maxf(xt.data(), y.data(), g); }); check(ty, "max pool forward", from(y), ymax, 0);
    launch(uint3{3, 1, 1}, 256, [&] { K<T>::maxb(xt.data(), dyt.data(), dx.data(), g); }); check(ty, "max pool backward", from(dx), dxmax, 1e-6 + u);
    launch(uint3{3, 1, 1}, 256, [&] { K<T>::avgf(xt.data(), y.data(), g); }); check(ty, "avg pool forward", from(y), yavg, 1e-6 + u);
    launch(uint3{3, 1, 1}, 256, [&] { K<T>::avgb(dyt.data(), dx.data(), g); }); check(ty, "avg pool backward", from(dx), dxavg, 1e-6 + u);
}
template <class T> void adaptive_t(int n, int c, int h, int w, int ho, int wo) {
    const char* ty = Ty<T>::name; const double u = Ty<T>::u;
    GemsPoolGeom g{n, c, h, w, 0, 0, 0, 0, 0, 0, ho, wo};
    size_t NI = (size_t)n * c * h * w, NO = (size_t)n * c * ho * wo; auto x = rt<T>(rnd(NI)), dy = rt<T>(rnd(NO)); auto xt = to<T>(x), dyt = to<T>(dy);
    std::vector<double> yr(NO), dxr(NI, 0);
    for (int p = 0; p < n * c; p++) for (int oh = 0; oh < ho; oh++) for (int ow = 0; ow < wo; ow++) {
        int h0 = oh * h / ho, h1 = ((oh + 1) * h + ho - 1) / ho, w0 = ow * w / wo, w1 = ((ow + 1) * w + wo - 1) / wo; double a = (h1 - h0) * (w1 - w0), s = 0;
        size_t o = ((size_t)p * ho + oh) * wo + ow;
        for (int ih = h0; ih < h1; ih++) for (int iw = w0; iw < w1; iw++) { s += x[((size_t)p * h + ih) * w + iw]; dxr[((size_t)p * h + ih) * w + iw] += dy[o] / a; }
        yr[o] = s / a; }
    auto y = poison<T>(NO), dx = poison<T>(NI);
    launch(uint3{2, 1, 1}, 256, [&] { K<T>::adaf(xt.data(), y.data(), g); }); check(ty, "adaptive avg forward", from(y), yr, 1e-6 + u);
    launch(uint3{2, 1, 1}, 256, [&] { K<T>::adab(dyt.data(), dx.data(), g); }); check(ty, "adaptive avg backward", from(dx), dxr, 1e-6 + u);
    if (ho == 1 && wo == 1) {
        y = poison<T>(NO); dx = poison<T>(NI);
        launch(uint3{(unsigned)(n * c), 1, 1}, 256, [&] { K<T>::glof(xt.data(), y.data(), g); }); check(ty, "global avg forward", from(y), yr, 1e-6 + u);
        launch(uint3{2, 1, 1}, 256, [&] { K<T>::glob(dyt.data(), dx.data(), g); }); check(ty, "global avg backward", from(dx), dxr, 1e-6 + u);
    }
}
uint64_t sm(uint64_t z) { z += 0x9E3779B97F4A7C15ull; z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull; z = (z ^ (z >> 27)) * 0x94D049BB133111EBull; return z ^ (z >> 31); }
template <class T> void misc() {
    const char* ty = Ty<T>::name; const double u = Ty<T>::u;
    int n = 5, k = 300; auto logits = rt<T>(rnd(n * k)); auto lt = to<T>(logits); std::vector<uint32_t> labels{0, 299, 17, 150, 3};
    std::vector<float> weights{1.0f, 0.5f, 0.0f, 2.0f, 1.0f}, probs(n * k, NAN), block(1, NAN); auto dl = poison<T>(n * k); GemsLoss l{n, k, 1, 1.0 / n};
    launch(uint3{1, 1, 1}, 256, [&] { K<T>::sce(lt.data(), labels.data(), weights.data(), probs.data(), block.data(), l); });
    std::vector<double> pr(n * k), lr(n);
    for (int i = 0; i < n; i++) { double m = -INFINITY, s = 0; for (int j = 0; j < k; j++) m = std::max(m, (double)logits[i * k + j]); for (int j = 0; j < k; j++) s += std::exp(logits[i * k + j] - m); for (int j = 0; j < k; j++) pr[i * k + j] = std::exp(logits[i * k + j] - m) / s; lr[i] = std::log(s) - (logits[i * k + labels[i]] - m); }
    std::vector<double> wl{0.0}; for (int i = 0; i < n; i++) wl[0] += weights[i] * lr[i];
    check(ty, "softmax probs (f32)", probs, pr, 1e-5); check(ty, "cross-entropy weighted loss sum", block, wl, 1e-5);
    launch(uint3{2, 1, 1}, 256, [&] { K<T>::sceb(probs.data(), labels.data(), weights.data(), dl.data(), l); });
    std::vector<double> dr(n * k); for (int i = 0; i < n; i++) for (int j = 0; j < k; j++) dr[i * k + j] = weights[i] * (pr[i * k + j] - (labels[i] == (uint32_t)j)) / n;
    check(ty, "cross-entropy backward", from(dl), dr, 1e-5 + u);
    // elementwise
    size_t N = 1000; auto a = rt<T>(rnd(N)), b = rt<T>(rnd(N)); auto at = to<T>(a), bt = to<T>(b); auto yt = poison<T>(N);
    std::vector<double> r(N);
    launch(uint3{2, 1, 1}, 256, [&] { K<T>::add(at.data(), bt.data(), yt.data(), (int64_t)N); }); for (size_t i = 0; i < N; i++) r[i] = Ty<T>::from(Ty<T>::to(a[i] + b[i])); check(ty, "add (rounded once)", from(yt), r, 0);
    launch(uint3{2, 1, 1}, 256, [&] { K<T>::mul(at.data(), bt.data(), yt.data(), (int64_t)N); }); for (size_t i = 0; i < N; i++) r[i] = Ty<T>::from(Ty<T>::to(a[i] * b[i])); check(ty, "mul (rounded once)", from(yt), r, 0);
    auto acc = at; launch(uint3{2, 1, 1}, 256, [&] { K<T>::add_assign(acc.data(), bt.data(), (int64_t)N); }); for (size_t i = 0; i < N; i++) r[i] = Ty<T>::from(Ty<T>::to(a[i] + b[i])); check(ty, "add_assign", from(acc), r, 0);
    launch(uint3{2, 1, 1}, 256, [&] { K<T>::fill(yt.data(), 0.1f, (int64_t)N); }); for (size_t i = 0; i < N; i++) r[i] = Ty<T>::from(Ty<T>::to(0.1f)); check(ty, "fill", from(yt), r, 0);
    launch(uint3{2, 1, 1}, 256, [&] { K<T>::reluf(at.data(), yt.data(), (int64_t)N); }); for (size_t i = 0; i < N; i++) r[i] = std::max(0.0f, a[i]); check(ty, "relu forward", from(yt), r, 0);
    auto dxt = poison<T>(N); launch(uint3{2, 1, 1}, 256, [&] { K<T>::relub(yt.data(), bt.data(), dxt.data(), (int64_t)N); }); for (size_t i = 0; i < N; i++) r[i] = a[i] > 0 ? b[i] : 0; check(ty, "relu backward", from(dxt), r, 0);
    // dropout mask
    size_t ND = 5000; auto mask = poison<T>(ND); GemsDropout d{(int64_t)ND, 0.3, 42, 1, (int64_t)ND, 0, 0, 1, (int64_t)ND};
    launch(uint3{3, 1, 1}, 256, [&] { K<T>::dropout(mask.data(), d); });
    std::vector<float> mr(ND); float keep = Ty<T>::from(Ty<T>::to((float)(1.0 / 0.7)));
    for (size_t i = 0; i < ND; i++) { double uu = (double)(sm(42 ^ sm(i)) >> 11) / 9007199254740992.0; mr[i] = uu < 0.3 ? 0.0f : keep; }
    check(ty, "dropout mask (keep rounded to T)", from(mask), mr, 0);
    // copy channels, channel bias, channel sum
    GemsCopyChannels cc{2, 7, 3, 1, 5, 2, 2}; auto src = rt<T>(rnd(2 * 3 * 7)); auto srct = to<T>(src); auto dst = to<T>(std::vector<float>(2 * 5 * 7, -9)); std::vector<float> dr2(2 * 5 * 7, -9);
    launch(uint3{1, 1, 1}, 256, [&] { K<T>::copy(srct.data(), dst.data(), cc); });
    for (int i = 0; i < 2; i++) for (int c = 0; c < 2; c++) for (int j = 0; j < 7; j++) dr2[(i * 5 + 2 + c) * 7 + j] = src[(i * 3 + 1 + c) * 7 + j];
    check(ty, "copy channels", from(dst), dr2, 0);
    GemsChannelGeom cg{3, 4, 50}; auto dyy = rt<T>(rnd(600)); auto dyyt = to<T>(dyy); std::vector<float> db(4, 1); std::vector<double> dbr(4, 1);
    for (size_t i = 0; i < 600; i++) dbr[(i / 50) % 4] += dyy[i];
    launch(uint3{4, 1, 1}, 256, [&] { K<T>::csum(dyyt.data(), db.data(), cg); }); check(ty, "channel sum (+=, f32 db)", db, dbr, 1e-6);
    auto bias = rnd(4); auto yb = dyyt; std::vector<double> ybr(600);
    for (size_t i = 0; i < 600; i++) ybr[i] = Ty<T>::from(Ty<T>::to(dyy[i] + bias[(i / 50) % 4]));
    launch(uint3{2, 1, 1}, 256, [&] { K<T>::bias(yb.data(), bias.data(), cg); }); check(ty, "add channel bias (f32 bias)", from(yb), ybr, 0);
}
void casts_and_optim() {
    // casts: rounding to nearest even, NaN/inf kept, exact widening
    std::vector<float> x = rnd(3000, -70000, 70000); auto small = rnd(1000, -1e-4, 1e-4); x.insert(x.end(), small.begin(), small.end());
    x.push_back(INFINITY); x.push_back(-INFINITY); x.push_back(NAN); x.push_back(65504.f); x.push_back(65520.f); x.push_back(1e-8f);
    size_t N = x.size(); std::vector<gems_bf16> b(N); std::vector<gems_f16> h(N); std::vector<float> back(N);
    launch(uint3{3, 1, 1}, 256, [&] { cast_f32_bf16(x.data(), b.data(), (int64_t)N); });
    int bad = 0; for (size_t i = 0; i < N; i++) if (b[i].bits != f32_to_bf16(x[i]).bits) bad++;
    launch(uint3{3, 1, 1}, 256, [&] { cast_bf16_f32(b.data(), back.data(), (int64_t)N); });
    for (size_t i = 0; i < N; i++) { uint32_t u; memcpy(&u, &back[i], 4); if (u != (uint32_t)b[i].bits << 16) bad++; }
    launch(uint3{3, 1, 1}, 256, [&] { cast_f32_f16(x.data(), h.data(), (int64_t)N); });
    for (size_t i = 0; i < N; i++) { _Float16 r = (_Float16)x[i]; uint16_t rb; memcpy(&rb, &r, 2); if (h[i].bits != rb) bad++; }
    launch(uint3{3, 1, 1}, 256, [&] { cast_f16_f32(h.data(), back.data(), (int64_t)N); });
    for (size_t i = 0; i < N; i++) { _Float16 r; memcpy(&r, &h[i].bits, 2); float f = (float)r; if (memcmp(&f, &back[i], 4) != 0 && !(std::isnan(f) && std::isnan(back[i]))) bad++; }
    if (bad) fails++; printf("casts f32<->bf16, f32<->f16 (%zu values, bit-exact): %d mismatches %s\n", N, bad, bad ? "FAIL" : "ok");
    // f32_to_bf16 ties: 1 + 2^-8 (tie, even below) -> 1; 1 + 3 * 2^-8 -> 1 + 2^-6 (tie, even above)
    float t1 = 1.0f + 1.0f / 256, t2 = 1.0f + 3.0f / 256; bool tok = bf16_to_f32(f32_to_bf16(t1)) == 1.0f && bf16_to_f32(f32_to_bf16(t2)) == 1.0f + 4.0f / 256 && std::isnan(bf16_to_f32(f32_to_bf16(NAN)));
    if (!tok) fails++; printf("bf16 ties to even, NaN: %s\n", tok ? "ok" : "FAIL");
    // nonfinite
    auto run_nf = [&](std::vector<float> v, uint32_t start) { uint32_t found = start; launch(uint3{3, 1, 1}, 256, [&] { nonfinite_f32(v.data(), (int64_t)v.size(), &found); }); return found; };
    auto clean = rnd(2000, -1e30f, 1e30f); auto withinf = clean; withinf[1777] = -INFINITY; auto withnan = clean; withnan[3] = NAN; auto tail = clean; tail.push_back(INFINITY);
    bool nok = run_nf(clean, 0) == 0 && run_nf(withinf, 0) == 1 && run_nf(withnan, 0) == 1 && run_nf(tail, 0) == 1 && run_nf(clean, 1) == 1;
    if (!nok) fails++; printf("nonfinite_f32 (clean, -inf, NaN, inf past the grid's first pass, never writes 0): %s\n", nok ? "ok" : "FAIL");
    // SGD with grad_scale: 1 is the old formula bit for bit; 1/1024 unscales exactly
    for (double gsd : {1.0, 1.0 / 1024}) for (int nest = 0; nest < 2; nest++) {
        size_t M = 1000; auto w = rnd(M), g = rnd(M), bb = rnd(M); auto w2 = w, b2 = bb;
        GemsSgdStep s{(int64_t)M, 0.1, 0.9, 5e-4, gsd, 0.0, nest, 0};
        launch(uint3{2, 1, 1}, 256, [&] { sgd_f32(w.data(), g.data(), bb.data(), s); });
        float lr_ = 0.1f, mom = 0.9f, wd = (float)5e-4, gs = (float)gsd;
        for (size_t i = 0; i < M; i++) { volatile float gg = gs * g[i]; gg = gg + wd * w2[i]; volatile float b3 = mom * b2[i] + gg; b2[i] = b3; volatile float st = nest ? gg + mom * b3 : b3; w2[i] -= lr_ * st; }
        char nm[64]; snprintf(nm, sizeof nm, "sgd grad_scale %g%s (bit-exact)", gsd, nest ? " nesterov" : "");
        check("f32", nm, w, w2, 0); check("f32", "sgd buffer (bit-exact)", bb, b2, 0);
    }
}
template <class T> void all() {
    bn<T>();
    pools<T>(GemsPoolGeom{2, 3, 9, 10, 3, 3, 2, 2, 1, 1, 5, 5});
    pools<T>(GemsPoolGeom{1, 2, 8, 8, 2, 2, 2, 2, 0, 0, 4, 4});
    pools<T>(GemsPoolGeom{1, 2, 7, 7, 3, 3, 2, 2, 0, 0, 4, 4});
    adaptive_t<T>(2, 3, 7, 9, 3, 4); adaptive_t<T>(1, 2, 3, 2, 5, 5); adaptive_t<T>(2, 3, 6, 5, 1, 1);
    misc<T>();
}
int main() {
    all<float>(); all<gems_bf16>(); all<gems_f16>();
    casts_and_optim();
    printf(fails ? "FAILURES: %d\n" : "all ok\n", fails);
    return fails != 0;
}
