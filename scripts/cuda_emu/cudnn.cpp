// A stand-in for cuDNN 9 (libcudnn.so.9) beside driver.cpp: the calls src/backend/cuda/cudnn.rs
// makes (descriptors, the convolution passes with their algorithm queries and workspace, batch
// normalization's training forward and backward, cudnnScaleTensor), computed by plain loops in
// double that follow cuDNN's documented semantics, queued on the handle's stream (through the
// emulated driver's cuLaunchHostFunc, as cublas.cpp does) so that stream order, event waits and
// chaos mode apply.
//
// It checks what cuDNN checks (descriptor agreement, the output size, data types, the blend
// factors' pointers, the workspace size against the algorithm's) and a little more: every
// buffer must lie in one live allocation of the emulated device, as far as its descriptor
// reaches. The workspace an algorithm asks for is poisoned (NaN) when it runs, so a workspace
// that overlaps live data shows.
//
// The algorithms are a model, not cuDNN's: each pass offers a few of cuDNN's algorithm codes,
// with a workspace need, a determinism flag and a time from a fixed cost model (work × a factor
// per algorithm), so that the backend's choice (fastest, deterministic within a slack, within
// the workspace limit) is exercised and repeatable; all of them compute the same reference.
// The FFT algorithms need a large workspace (every operand's spectrum), which big images push
// past the backend's limit. Only float tensors are computed (half and bfloat16 descriptors are
// accepted, as cuDNN does, and their use is NOT_SUPPORTED). FMA math computes from the f32
// inputs; the other math types round the inputs to TF32 first, as tensor cores take them.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

extern "C" int cuLaunchHostFunc(void* stream, void (*f)(void*), void* data);
extern "C" int cuStreamSynchronize(void* stream);
extern "C" std::size_t gems_emu_device_bytes(const void* p);

typedef int Status;
// cuDNN 9's codes (cudnn_graph.h); only these are returned, all of them known to cudarc.
enum : Status {
    SUCCESS = 0,
    BAD_PARAM = 2000,
    BAD_PARAM_NULL_POINTER = 2002,
    BAD_PARAM_SIZE_INSUFFICIENT = 2006,
    NOT_SUPPORTED = 3000,
    NOT_SUPPORTED_DATA_TYPE = 3003,
    NOT_SUPPORTED_LAYOUT = 3004,
    ALLOCATION_FAILED = 4004,  // CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED
    EXECUTION_FAILED_CUDA_DRIVER = 5001,
};
enum { FLOAT = 0, HALF = 2, BFLOAT16 = 9 };         // cudnnDataType_t
enum { NCHW = 0, NHWC = 1 };                         // cudnnTensorFormat_t
enum { CONVOLUTION = 0, CROSS_CORRELATION = 1 };     // cudnnConvolutionMode_t
enum { DEFAULT_MATH = 0, FMA_MATH = 3 };             // cudnnMathType_t (0 to 3)
enum { PER_ACTIVATION = 0, SPATIAL = 1, SPATIAL_PERSISTENT = 2 };  // cudnnBatchNormMode_t

namespace {

thread_local std::string g_last_error;

// Records why a call failed (cudnnGetLastErrorString hands it out) and returns the status.
Status fail(Status s, const char* what) {
    g_last_error = std::string("emulated cuDNN: ") + what;
    return s;
}

struct Handle { void* stream = nullptr; };

// A 4-d tensor (or filter) as dims and element strides, n c h w order.
struct Tensor {
    bool set = false;
    int dtype = FLOAT;
    int dim[4] = {0, 0, 0, 0};
    long long stride[4] = {0, 0, 0, 0};
    std::size_t at(int n, int c, int h, int w) const {
        return std::size_t(n * stride[0] + c * stride[1] + h * stride[2] + w * stride[3]);
    }
    // Elements from the first to one past the last (what the buffer must hold).
    std::size_t extent() const {
        long long e = 1;
        for (int i = 0; i < 4; i++) e += (dim[i] - 1) * stride[i];
        return std::size_t(e);
    }
};
struct Conv {
    bool set = false;
    int pad[2] = {0, 0}, stride[2] = {1, 1}, dil[2] = {1, 1};
    int mode = CROSS_CORRELATION, compute = FLOAT, groups = 1, math = DEFAULT_MATH;
};

Status set_dims(Tensor* t, int format, int dtype, int n, int c, int h, int w) {
    if (!t) return fail(BAD_PARAM_NULL_POINTER, "a null descriptor");
    if (n <= 0 || c <= 0 || h <= 0 || w <= 0) return fail(BAD_PARAM, "a dimension below 1");
    if (dtype != FLOAT && dtype != HALF && dtype != BFLOAT16)
        return fail(NOT_SUPPORTED_DATA_TYPE, "a data type other than float, half or bfloat16");
    if (format != NCHW && format != NHWC) return fail(NOT_SUPPORTED_LAYOUT, "a format other than NCHW or NHWC");
    *t = Tensor{true, dtype, {n, c, h, w}, {}};
    long long hw = (long long)h * w;
    if (format == NCHW) {
        t->stride[0] = c * hw, t->stride[1] = hw, t->stride[2] = w, t->stride[3] = 1;
    } else {
        t->stride[0] = c * hw, t->stride[1] = 1, t->stride[2] = (long long)w * c, t->stride[3] = c;
    }
    return SUCCESS;
}

// The output size cuDNN documents: 1 + (in + 2 pad - ((k - 1) dilation + 1)) / stride.
int out_size(int in, int pad, int k, int dil, int stride) {
    int span = (k - 1) * dil + 1;
    return in + 2 * pad < span ? 0 : 1 + (in + 2 * pad - span) / stride;
}

// One convolution: x (n, ci, h, w) with filter w (co, ci / groups, kh, kw) into y (n, co, ho,
// wo), as the descriptors give them.
struct Geom {
    Tensor x, w, y;
    Conv c;
    int n, ci, h, wd, co, kh, kw, ho, wo, cig, cog;
    bool tf32;
    double work() const { return 2.0 * n * co * ho * wo * cig * kh * kw; }
};

Status geometry(const Tensor* x, const Tensor* w, const Conv* c, const Tensor* y, Geom* g) {
    if (!x || !w || !c || !y) return fail(BAD_PARAM_NULL_POINTER, "a null descriptor");
    if (!x->set || !w->set || !c->set || !y->set) return fail(BAD_PARAM, "a descriptor that was never set");
    if (x->dtype != w->dtype || x->dtype != y->dtype)
        return fail(BAD_PARAM, "x, w and y of different data types");
    if (x->dtype != FLOAT || c->compute != FLOAT)
        return fail(NOT_SUPPORTED_DATA_TYPE, "only float convolutions are emulated");
    if (x->dim[1] != w->dim[1] * c->groups || w->dim[0] % c->groups)
        return fail(BAD_PARAM, "channels that do not match the filter and group count");
    int ho = out_size(x->dim[2], c->pad[0], w->dim[2], c->dil[0], c->stride[0]);
    int wo = out_size(x->dim[3], c->pad[1], w->dim[3], c->dil[1], c->stride[1]);
    if (y->dim[0] != x->dim[0] || y->dim[1] != w->dim[0] || y->dim[2] != ho || y->dim[3] != wo)
        return fail(BAD_PARAM, "an output descriptor that is not the convolution's output size");
    *g = Geom{*x, *w, *y, *c, x->dim[0], x->dim[1], x->dim[2], x->dim[3], w->dim[0], w->dim[2], w->dim[3],
              ho, wo, w->dim[1], w->dim[0] / c->groups, c->math != FMA_MATH};
    return SUCCESS;
}

// `t`'s elements at `p` lie in one live allocation of the emulated device.
Status inside(const void* p, const Tensor& t, const char* what) {
    if (!p) return fail(BAD_PARAM_NULL_POINTER, what);
    if (gems_emu_device_bytes(p) < t.extent() * sizeof(float)) {
        g_last_error = std::string("emulated cuDNN: ") + what + " reaches past its device allocation";
        return BAD_PARAM;
    }
    return SUCCESS;
}

// The workspace `bytes` at `p`: the algorithm's need at least, and device memory.
Status workspace(void* p, std::size_t bytes, std::size_t need) {
    if (bytes < need) return fail(BAD_PARAM_SIZE_INSUFFICIENT, "a workspace smaller than the algorithm's");
    if (bytes && (!p || gems_emu_device_bytes(p) < bytes))
        return fail(BAD_PARAM, "a workspace that is not that many bytes of device memory");
    return SUCCESS;
}

// y = alpha v + beta y; beta 0 ignores y (it may hold NaN), as cuDNN documents.
inline void blend(float* y, double v, float alpha, float beta) {
    *y = float(alpha * v + (beta == 0.0f ? 0.0 : double(beta) * *y));
}
inline double in(float v, bool tf32) {
    if (!tf32) return v;
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u = (u + 0x1000u) & ~0x1fffu;  // round to TF32's 10-bit mantissa (emu.h's to_tf32)
    std::memcpy(&v, &u, 4);
    return v;
}

// The filter tap (ky, kx) as stored: CONVOLUTION mode flips the filter.
inline std::size_t tap(const Geom& g, int o, int i, int ky, int kx) {
    bool flip = g.c.mode == CONVOLUTION;
    return g.w.at(o, i, flip ? g.kh - 1 - ky : ky, flip ? g.kw - 1 - kx : kx);
}

// The three passes, by gathering into each output element.
void forward(const Geom& g, const float* x, const float* w, float* y, float alpha, float beta) {
    for (int n = 0; n < g.n; n++)
        for (int o = 0; o < g.co; o++)
            for (int oy = 0; oy < g.ho; oy++)
                for (int ox = 0; ox < g.wo; ox++) {
                    double s = 0;
                    int grp = o / g.cog;
                    for (int i = 0; i < g.cig; i++)
                        for (int ky = 0; ky < g.kh; ky++) {
                            int iy = oy * g.c.stride[0] - g.c.pad[0] + ky * g.c.dil[0];
                            if (iy < 0 || iy >= g.h) continue;
                            for (int kx = 0; kx < g.kw; kx++) {
                                int ix = ox * g.c.stride[1] - g.c.pad[1] + kx * g.c.dil[1];
                                if (ix < 0 || ix >= g.wd) continue;
                                s += in(x[g.x.at(n, grp * g.cig + i, iy, ix)], g.tf32) *
                                     in(w[tap(g, o, i, ky, kx)], g.tf32);
                            }
                        }
                    blend(&y[g.y.at(n, o, oy, ox)], s, alpha, beta);
                }
}

void backward_data(const Geom& g, const float* w, const float* dy, float* dx, float alpha, float beta) {
    for (int n = 0; n < g.n; n++)
        for (int c = 0; c < g.ci; c++)
            for (int iy = 0; iy < g.h; iy++)
                for (int ix = 0; ix < g.wd; ix++) {
                    double s = 0;
                    int grp = c / g.cig, i = c % g.cig;
                    for (int ky = 0; ky < g.kh; ky++) {
                        int ty = iy + g.c.pad[0] - ky * g.c.dil[0];
                        if (ty < 0 || ty % g.c.stride[0] || ty / g.c.stride[0] >= g.ho) continue;
                        for (int kx = 0; kx < g.kw; kx++) {
                            int tx = ix + g.c.pad[1] - kx * g.c.dil[1];
                            if (tx < 0 || tx % g.c.stride[1] || tx / g.c.stride[1] >= g.wo) continue;
                            for (int o = grp * g.cog; o < (grp + 1) * g.cog; o++)
                                s += in(dy[g.y.at(n, o, ty / g.c.stride[0], tx / g.c.stride[1])], g.tf32) *
                                     in(w[tap(g, o, i, ky, kx)], g.tf32);
                        }
                    }
                    blend(&dx[g.x.at(n, c, iy, ix)], s, alpha, beta);
                }
}

void backward_filter(const Geom& g, const float* x, const float* dy, float* dw, float alpha, float beta) {
    for (int o = 0; o < g.co; o++)
        for (int i = 0; i < g.cig; i++)
            for (int ky = 0; ky < g.kh; ky++)
                for (int kx = 0; kx < g.kw; kx++) {
                    double s = 0;
                    int c = o / g.cog * g.cig + i;
                    for (int n = 0; n < g.n; n++)
                        for (int oy = 0; oy < g.ho; oy++) {
                            int iy = oy * g.c.stride[0] - g.c.pad[0] + ky * g.c.dil[0];
                            if (iy < 0 || iy >= g.h) continue;
                            for (int ox = 0; ox < g.wo; ox++) {
                                int ix = ox * g.c.stride[1] - g.c.pad[1] + kx * g.c.dil[1];
                                if (ix < 0 || ix >= g.wd) continue;
                                s += in(x[g.x.at(n, c, iy, ix)], g.tf32) * in(dy[g.y.at(n, o, oy, ox)], g.tf32);
                            }
                        }
                    blend(&dw[tap(g, o, i, ky, kx)], s, alpha, beta);
                }
}

// --- the algorithm model ------------------------------------------------------------------
enum Pass { FWD, DATA, FILTER };
const int COUNT[3] = {8, 6, 7};  // cuDNN's algorithm counts per pass

// One algorithm of a pass: whether it runs `g`, its workspace, determinism and cost factor.
struct Algo {
    bool ok;
    std::size_t bytes;
    bool deterministic;
    double factor;
};

Algo model(Pass pass, int algo, const Geom& g) {
    std::size_t col = sizeof(float) * std::size_t(g.cig) * g.kh * g.kw * g.ho * g.wo;  // one image's columns
    // FFT: every operand's spectrum (complex, half the last axis) on the padded plane; plain
    // convolutions only.
    bool fft_ok = g.c.stride[0] == 1 && g.c.stride[1] == 1 && g.c.dil[0] == 1 && g.c.dil[1] == 1 &&
                  g.c.groups == 1 && g.kh > 1;
    std::size_t plane = std::size_t(g.h + 2 * g.c.pad[0]) * ((g.wd + 2 * g.c.pad[1]) / 2 + 1);
    std::size_t fft = 8 * plane * (std::size_t(g.n) * g.ci + std::size_t(g.co) * g.ci + std::size_t(g.n) * g.co);
    switch (pass) {
        case FWD:
            if (algo == 0) return {true, 0, true, 1.3};                                   // IMPLICIT_GEMM
            if (algo == 1) return {true, sizeof(int) * std::size_t(g.cig) * g.kh * g.kw, true, 1.0};  // IMPLICIT_PRECOMP_GEMM
            if (algo == 2) return {true, col, true, 1.15};                                // GEMM
            if (algo == 4) return {fft_ok, fft, true, 0.6};                               // FFT
            break;
        case DATA:
            if (algo == 0) return {true, 0, false, 1.0};    // ALGO_0 (atomic adds)
            if (algo == 1) return {true, col, true, 1.03};  // ALGO_1
            if (algo == 2) return {fft_ok, fft, true, 0.6};  // FFT
            break;
        case FILTER:
            if (algo == 0) return {true, 0, false, 1.0};       // ALGO_0 (atomic adds)
            if (algo == 1) return {true, col, true, 1.04};     // ALGO_1
            if (algo == 3) return {true, col / 4, false, 1.1};  // ALGO_3
            if (algo == 2) return {fft_ok, fft, true, 0.7};     // FFT
            break;
    }
    return {false, 0, true, 0};
}

// cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t.
struct Perf {
    int algo;
    Status status;
    float time;
    std::size_t memory;
    int determinism;
    int math;
    int reserved[3];
};

// Every algorithm of `pass`, usable ones first by modelled time: timed (Find, with `limit`
// bytes of workspace) or ranked by heuristics (time -1, no limit).
Status rank(Pass pass, const Geom& g, bool timed, std::size_t limit, int want, int* got, Perf* out) {
    if (!got || !out || want < 1) return fail(BAD_PARAM, "no room for the results");
    std::vector<Perf> all;
    for (int a = 0; a < COUNT[pass]; a++) {
        Algo m = model(pass, a, g);
        Perf p{a, m.ok ? SUCCESS : NOT_SUPPORTED, -1.0f, m.bytes, m.deterministic ? 1 : 0, g.c.math, {0, 0, 0}};
        if (m.ok && timed && m.bytes > limit) p.status = ALLOCATION_FAILED;
        if (m.ok && timed && p.status == SUCCESS) p.time = float(g.work() * m.factor * 1e-9);  // ms at 1 TFLOP/s
        if (!timed) p.time = -1.0f;
        all.push_back(p);
    }
    auto key = [&](const Perf& p) { return p.status == SUCCESS ? model(pass, p.algo, g).factor : 1e9; };
    std::stable_sort(all.begin(), all.end(), [&](const Perf& a, const Perf& b) { return key(a) < key(b); });
    *got = std::min(want, int(all.size()));
    std::copy(all.begin(), all.begin() + *got, out);
    return SUCCESS;
}

// Queues `f` on the handle's stream (the null stream: run here, after the blocking streams).
Status queue(Handle* h, std::function<void()> f) {
    auto* job = new std::function<void()>(std::move(f));
    auto run = [](void* p) {
        auto* j = static_cast<std::function<void()>*>(p);
        (*j)();
        delete j;
    };
    return cuLaunchHostFunc(h->stream, run, job) ? fail(EXECUTION_FAILED_CUDA_DRIVER, "the stream refused the work")
                                                  : SUCCESS;
}

// The operands of a pass: a and b in, out blended; which tensor each is depends on the pass.
Status run(Handle* h, Pass pass, const Geom& g, int algo, const void* alpha, const void* a, const void* b,
           const void* beta, void* out, void* ws, std::size_t ws_bytes) {
    if (!h) return fail(BAD_PARAM_NULL_POINTER, "a null handle");
    if (!alpha || !beta) return fail(BAD_PARAM_NULL_POINTER, "a null alpha or beta");
    const Tensor* t[3][3] = {{&g.x, &g.w, &g.y}, {&g.w, &g.y, &g.x}, {&g.x, &g.y, &g.w}};
    const char* names[3][3] = {{"x", "w", "y"}, {"w", "dy", "dx"}, {"x", "dy", "dw"}};
    const void* p[3] = {a, b, out};
    for (int i = 0; i < 3; i++)
        if (Status s = inside(p[i], *t[pass][i], names[pass][i])) return s;
    if (algo < 0 || algo >= COUNT[pass]) return fail(BAD_PARAM, "an algorithm code out of range");
    Algo m = model(pass, algo, g);
    if (!m.ok) return fail(NOT_SUPPORTED, "an algorithm that does not run this convolution");
    if (Status s = workspace(ws, ws_bytes, m.bytes)) return s;
    float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
    auto x = static_cast<const float*>(a), y = static_cast<const float*>(b);
    auto o = static_cast<float*>(out);
    std::size_t need = m.bytes;
    return queue(h, [=] {
        if (need) std::memset(ws, 0xff, need);  // the algorithm's scratch: nothing may rely on it
        if (pass == FWD) forward(g, x, y, o, al, be);
        else if (pass == DATA) backward_data(g, x, y, o, al, be);
        else backward_filter(g, x, y, o, al, be);
    });
}

// Find*Ex: the pass run once on the caller's buffers (which cuDNN may overwrite), waited for as
// cuDNN's search blocks the host; then the modelled times.
Status find(Handle* h, Pass pass, const Geom& g, const void* a, const void* b, void* out, int want, int* got,
            Perf* perf, void* ws, std::size_t ws_bytes) {
    const float one = 1.0f, zero = 0.0f;
    if (Status s = workspace(ws, ws_bytes, 0)) return s;
    if (Status s = run(h, pass, g, 0, &one, a, b, &zero, out, ws, ws_bytes)) return s;
    if (cuStreamSynchronize(h->stream)) return fail(EXECUTION_FAILED_CUDA_DRIVER, "the stream failed");
    return rank(pass, g, true, ws_bytes, want, got, perf);
}

Status workspace_size(Pass pass, const Geom& g, int algo, std::size_t* bytes) {
    if (!bytes) return fail(BAD_PARAM_NULL_POINTER, "a null size");
    if (algo < 0 || algo >= COUNT[pass]) return fail(BAD_PARAM, "an algorithm code out of range");
    Algo m = model(pass, algo, g);
    if (!m.ok) return fail(NOT_SUPPORTED, "an algorithm that does not run this convolution");
    *bytes = m.bytes;
    return SUCCESS;
}

// --- batch normalization (spatial: statistics per channel over n, h and w) ----------------
Status bn_check(int mode, const Tensor* x, const Tensor* y, const Tensor* ch) {
    if (!x || !y || !ch) return fail(BAD_PARAM_NULL_POINTER, "a null descriptor");
    if (!x->set || !y->set || !ch->set) return fail(BAD_PARAM, "a descriptor that was never set");
    if (mode != SPATIAL && mode != SPATIAL_PERSISTENT)
        return fail(NOT_SUPPORTED, "a batch-norm mode other than spatial");
    if (std::memcmp(x->dim, y->dim, sizeof x->dim))
        return fail(BAD_PARAM, "x and y (or dy, dx) of different shapes");
    if (ch->dim[0] != 1 || ch->dim[1] != x->dim[1] || ch->dim[2] != 1 || ch->dim[3] != 1)
        return fail(BAD_PARAM, "a parameter descriptor that is not 1 x C x 1 x 1");
    if (x->dtype != FLOAT || y->dtype != FLOAT || ch->dtype != FLOAT)
        return fail(NOT_SUPPORTED_DATA_TYPE, "only float batch norm is emulated");
    return SUCCESS;
}

// Per channel c: the mean and the biased variance of t's elements at p.
void moments(const Tensor& t, const float* p, int c, double* mean, double* var) {
    double s = 0, q = 0, m = double(t.dim[0]) * t.dim[2] * t.dim[3];
    for (int n = 0; n < t.dim[0]; n++)
        for (int h = 0; h < t.dim[2]; h++)
            for (int w = 0; w < t.dim[3]; w++) s += p[t.at(n, c, h, w)];
    *mean = s / m;
    for (int n = 0; n < t.dim[0]; n++)
        for (int h = 0; h < t.dim[2]; h++)
            for (int w = 0; w < t.dim[3]; w++) q += (p[t.at(n, c, h, w)] - *mean) * (p[t.at(n, c, h, w)] - *mean);
    *var = q / m;
}

}  // namespace

extern "C" {

std::size_t cudnnGetVersion() { return 90201; }  // 9.2.1, the headers cudarc's bindings come from

void cudnnGetLastErrorString(char* message, std::size_t max) {
    if (!message || !max) return;
    std::snprintf(message, max, "%s", g_last_error.c_str());
    g_last_error.clear();
}

Status cudnnCreate(Handle** h) {
    if (!h) return fail(BAD_PARAM_NULL_POINTER, "a null handle pointer");
    *h = new Handle;
    return SUCCESS;
}
Status cudnnDestroy(Handle* h) { delete h; return SUCCESS; }
Status cudnnSetStream(Handle* h, void* stream) {
    if (!h) return fail(BAD_PARAM_NULL_POINTER, "a null handle");
    h->stream = stream;
    return SUCCESS;
}

Status cudnnCreateTensorDescriptor(Tensor** t) { *t = new Tensor; return SUCCESS; }
Status cudnnDestroyTensorDescriptor(Tensor* t) { delete t; return SUCCESS; }
Status cudnnSetTensor4dDescriptor(Tensor* t, int format, int dtype, int n, int c, int h, int w) {
    return set_dims(t, format, dtype, n, c, h, w);
}
Status cudnnCreateFilterDescriptor(Tensor** t) { *t = new Tensor; return SUCCESS; }
Status cudnnDestroyFilterDescriptor(Tensor* t) { delete t; return SUCCESS; }
// NCHW filters are k c r s in memory, NHWC ones k r s c.
Status cudnnSetFilter4dDescriptor(Tensor* t, int dtype, int format, int k, int c, int h, int w) {
    return set_dims(t, format, dtype, k, c, h, w);
}

Status cudnnCreateConvolutionDescriptor(Conv** c) { *c = new Conv; return SUCCESS; }
Status cudnnDestroyConvolutionDescriptor(Conv* c) { delete c; return SUCCESS; }
Status cudnnSetConvolution2dDescriptor(Conv* c, int pad_h, int pad_w, int u, int v, int dil_h, int dil_w, int mode,
                                       int compute) {
    if (!c) return fail(BAD_PARAM_NULL_POINTER, "a null descriptor");
    if (pad_h < 0 || pad_w < 0 || u < 1 || v < 1 || dil_h < 1 || dil_w < 1)
        return fail(BAD_PARAM, "a negative padding, or a stride or dilation below 1");
    if (mode != CONVOLUTION && mode != CROSS_CORRELATION) return fail(BAD_PARAM, "an unknown convolution mode");
    if (compute != FLOAT && compute != HALF && compute != BFLOAT16)
        return fail(NOT_SUPPORTED_DATA_TYPE, "a compute type other than float, half or bfloat16");
    int groups = c->groups, math = c->math;  // set by their own calls
    *c = Conv{true, {pad_h, pad_w}, {u, v}, {dil_h, dil_w}, mode, compute, groups, math};
    return SUCCESS;
}
Status cudnnSetConvolutionGroupCount(Conv* c, int groups) {
    if (!c) return fail(BAD_PARAM_NULL_POINTER, "a null descriptor");
    if (groups < 1) return fail(BAD_PARAM, "a group count below 1");
    c->groups = groups;
    return SUCCESS;
}
Status cudnnSetConvolutionMathType(Conv* c, int math) {
    if (!c) return fail(BAD_PARAM_NULL_POINTER, "a null descriptor");
    if (math < 0 || math > 3) return fail(BAD_PARAM, "an unknown math type");
    c->math = math;
    return SUCCESS;
}
Status cudnnGetConvolution2dForwardOutputDim(const Conv* c, const Tensor* x, const Tensor* w, int* n, int* k,
                                             int* h, int* wd) {
    if (!c || !x || !w || !n || !k || !h || !wd) return fail(BAD_PARAM_NULL_POINTER, "a null argument");
    if (!c->set || !x->set || !w->set) return fail(BAD_PARAM, "a descriptor that was never set");
    if (x->dim[1] != w->dim[1] * c->groups) return fail(BAD_PARAM, "channels that do not match the filter");
    int ho = out_size(x->dim[2], c->pad[0], w->dim[2], c->dil[0], c->stride[0]);
    int wo = out_size(x->dim[3], c->pad[1], w->dim[3], c->dil[1], c->stride[1]);
    if (ho < 1 || wo < 1) return fail(BAD_PARAM, "a filter larger than the padded input");
    *n = x->dim[0], *k = w->dim[0], *h = ho, *wd = wo;
    return SUCCESS;
}

#define GEOM(x, w, c, y)                                    \
    Geom g;                                                 \
    if (Status s = geometry(x, w, c, y, &g)) return s;

Status cudnnGetConvolutionForwardAlgorithm_v7(Handle*, const Tensor* x, const Tensor* w, const Conv* c,
                                              const Tensor* y, int want, int* got, Perf* perf) {
    GEOM(x, w, c, y);
    return rank(FWD, g, false, 0, want, got, perf);
}
Status cudnnGetConvolutionBackwardDataAlgorithm_v7(Handle*, const Tensor* w, const Tensor* dy, const Conv* c,
                                                   const Tensor* dx, int want, int* got, Perf* perf) {
    GEOM(dx, w, c, dy);
    return rank(DATA, g, false, 0, want, got, perf);
}
Status cudnnGetConvolutionBackwardFilterAlgorithm_v7(Handle*, const Tensor* x, const Tensor* dy, const Conv* c,
                                                     const Tensor* dw, int want, int* got, Perf* perf) {
    GEOM(x, dw, c, dy);
    return rank(FILTER, g, false, 0, want, got, perf);
}

Status cudnnFindConvolutionForwardAlgorithmEx(Handle* h, const Tensor* xd, const void* x, const Tensor* wd,
                                              const void* w, const Conv* c, const Tensor* yd, void* y, int want,
                                              int* got, Perf* perf, void* ws, std::size_t ws_bytes) {
    GEOM(xd, wd, c, yd);
    return find(h, FWD, g, x, w, y, want, got, perf, ws, ws_bytes);
}
Status cudnnFindConvolutionBackwardDataAlgorithmEx(Handle* h, const Tensor* wd, const void* w, const Tensor* dyd,
                                                   const void* dy, const Conv* c, const Tensor* dxd, void* dx,
                                                   int want, int* got, Perf* perf, void* ws, std::size_t ws_bytes) {
    GEOM(dxd, wd, c, dyd);
    return find(h, DATA, g, w, dy, dx, want, got, perf, ws, ws_bytes);
}
Status cudnnFindConvolutionBackwardFilterAlgorithmEx(Handle* h, const Tensor* xd, const void* x, const Tensor* dyd,
                                                     const void* dy, const Conv* c, const Tensor* dwd, void* dw,
                                                     int want, int* got, Perf* perf, void* ws,
                                                     std::size_t ws_bytes) {
    GEOM(xd, dwd, c, dyd);
    return find(h, FILTER, g, x, dy, dw, want, got, perf, ws, ws_bytes);
}

Status cudnnGetConvolutionForwardWorkspaceSize(Handle*, const Tensor* x, const Tensor* w, const Conv* c,
                                               const Tensor* y, int algo, std::size_t* bytes) {
    GEOM(x, w, c, y);
    return workspace_size(FWD, g, algo, bytes);
}
Status cudnnGetConvolutionBackwardDataWorkspaceSize(Handle*, const Tensor* w, const Tensor* dy, const Conv* c,
                                                    const Tensor* dx, int algo, std::size_t* bytes) {
    GEOM(dx, w, c, dy);
    return workspace_size(DATA, g, algo, bytes);
}
Status cudnnGetConvolutionBackwardFilterWorkspaceSize(Handle*, const Tensor* x, const Tensor* dy, const Conv* c,
                                                      const Tensor* dw, int algo, std::size_t* bytes) {
    GEOM(x, dw, c, dy);
    return workspace_size(FILTER, g, algo, bytes);
}

Status cudnnConvolutionForward(Handle* h, const void* alpha, const Tensor* xd, const void* x, const Tensor* wd,
                               const void* w, const Conv* c, int algo, void* ws, std::size_t ws_bytes,
                               const void* beta, const Tensor* yd, void* y) {
    GEOM(xd, wd, c, yd);
    return run(h, FWD, g, algo, alpha, x, w, beta, y, ws, ws_bytes);
}
Status cudnnConvolutionBackwardData(Handle* h, const void* alpha, const Tensor* wd, const void* w, const Tensor* dyd,
                                    const void* dy, const Conv* c, int algo, void* ws, std::size_t ws_bytes,
                                    const void* beta, const Tensor* dxd, void* dx) {
    GEOM(dxd, wd, c, dyd);
    return run(h, DATA, g, algo, alpha, w, dy, beta, dx, ws, ws_bytes);
}
Status cudnnConvolutionBackwardFilter(Handle* h, const void* alpha, const Tensor* xd, const void* x,
                                      const Tensor* dyd, const void* dy, const Conv* c, int algo, void* ws,
                                      std::size_t ws_bytes, const void* beta, const Tensor* dwd, void* dw) {
    GEOM(xd, dwd, c, dyd);
    return run(h, FILTER, g, algo, alpha, x, dy, beta, dw, ws, ws_bytes);
}

// y = alpha (gamma x̂ + bias) + beta y, x̂ = (x - mean) / sqrt(var + eps) with the batch's mean
// and biased variance; running = (1 - factor) running + factor batch (the variance unbiased,
// × m / (m - 1)); saved: the mean and 1 / sqrt(var + eps).
Status cudnnBatchNormalizationForwardTraining(Handle* h, int mode, const void* alpha, const void* beta,
                                              const Tensor* xd, const void* x, const Tensor* yd, void* y,
                                              const Tensor* cd, const void* scale, const void* bias, double factor,
                                              void* run_mean, void* run_var, double eps, void* save_mean,
                                              void* save_inv) {
    if (!h || !alpha || !beta) return fail(BAD_PARAM_NULL_POINTER, "a null handle, alpha or beta");
    if (Status s = bn_check(mode, xd, yd, cd)) return s;
    if (eps < 0) return fail(BAD_PARAM, "an epsilon below CUDNN_BN_MIN_EPSILON (0)");
    if (!run_mean != !run_var || !save_mean != !save_inv)
        return fail(BAD_PARAM, "one of the running (or saved) mean and variance without the other");
    const Tensor X = *xd, Y = *yd, C = *cd;
    Status s = SUCCESS;
    for (const void* p : {run_mean, run_var, save_mean, save_inv})
        if (p && !s) s = inside(p, C, "a statistics buffer");
    if (s || (s = inside(x, X, "x")) || (s = inside(y, Y, "y")) || (s = inside(scale, C, "scale")) ||
        (s = inside(bias, C, "bias")))
        return s;
    float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
    return queue(h, [=] {
        auto xs = static_cast<const float*>(x);
        auto ys = static_cast<float*>(y);
        double m = double(X.dim[0]) * X.dim[2] * X.dim[3];
        for (int c = 0; c < X.dim[1]; c++) {
            double mean, var;
            moments(X, xs, c, &mean, &var);
            double inv = 1.0 / std::sqrt(var + eps);
            double gamma = static_cast<const float*>(scale)[c], b = static_cast<const float*>(bias)[c];
            for (int n = 0; n < X.dim[0]; n++)
                for (int i = 0; i < X.dim[2]; i++)
                    for (int j = 0; j < X.dim[3]; j++)
                        blend(&ys[Y.at(n, c, i, j)], gamma * (xs[X.at(n, c, i, j)] - mean) * inv + b, al, be);
            if (run_mean) {
                float& rm = static_cast<float*>(run_mean)[c];
                float& rv = static_cast<float*>(run_var)[c];
                rm = float((1 - factor) * rm + factor * mean);
                rv = float((1 - factor) * rv + factor * var * m / (m - 1));
            }
            if (save_mean) {
                static_cast<float*>(save_mean)[c] = float(mean);
                static_cast<float*>(save_inv)[c] = float(inv);
            }
        }
    });
}

// dx = alphaData dx̂ + betaData dx, dscale = alphaParam Σ dy x̂ + betaParam dscale, dbias the
// same with Σ dy; dx̂ = gamma inv / m (m dy - Σ dy - x̂ Σ dy x̂). The statistics are the saved
// ones when given, else the batch's.
Status cudnnBatchNormalizationBackward(Handle* h, int mode, const void* alpha_d, const void* beta_d,
                                       const void* alpha_p, const void* beta_p, const Tensor* xd, const void* x,
                                       const Tensor* dyd, const void* dy, const Tensor* dxd, void* dx,
                                       const Tensor* cd, const void* scale, void* dscale, void* dbias, double eps,
                                       const void* saved_mean, const void* saved_inv) {
    if (!h || !alpha_d || !beta_d || !alpha_p || !beta_p) return fail(BAD_PARAM_NULL_POINTER, "a null blend factor");
    if (Status s = bn_check(mode, xd, dyd, cd)) return s;
    if (Status s = bn_check(mode, xd, dxd, cd)) return s;
    if (eps < 0) return fail(BAD_PARAM, "an epsilon below CUDNN_BN_MIN_EPSILON (0)");
    if (!saved_mean != !saved_inv) return fail(BAD_PARAM, "the saved mean without the inverse variance, or back");
    const Tensor X = *xd, DY = *dyd, DX = *dxd, C = *cd;
    Status s = SUCCESS;
    for (const void* p : {saved_mean, saved_inv})
        if (p && !s) s = inside(p, C, "a saved statistic");
    if (s || (s = inside(x, X, "x")) || (s = inside(dy, DY, "dy")) || (s = inside(dx, DX, "dx")) ||
        (s = inside(scale, C, "scale")) || (s = inside(dscale, C, "dscale")) || (s = inside(dbias, C, "dbias")))
        return s;
    float ad = *static_cast<const float*>(alpha_d), bd = *static_cast<const float*>(beta_d);
    float ap = *static_cast<const float*>(alpha_p), bp = *static_cast<const float*>(beta_p);
    return queue(h, [=] {
        auto xs = static_cast<const float*>(x);
        auto dys = static_cast<const float*>(dy);
        double m = double(X.dim[0]) * X.dim[2] * X.dim[3];
        for (int c = 0; c < X.dim[1]; c++) {
            double mean, inv;
            if (saved_mean) {
                mean = static_cast<const float*>(saved_mean)[c], inv = static_cast<const float*>(saved_inv)[c];
            } else {
                double var;
                moments(X, xs, c, &mean, &var);
                inv = 1.0 / std::sqrt(var + eps);
            }
            double sdy = 0, sdyx = 0;
            for (int n = 0; n < X.dim[0]; n++)
                for (int i = 0; i < X.dim[2]; i++)
                    for (int j = 0; j < X.dim[3]; j++) {
                        double d = dys[DY.at(n, c, i, j)];
                        sdy += d;
                        sdyx += d * (xs[X.at(n, c, i, j)] - mean) * inv;
                    }
            double k = static_cast<const float*>(scale)[c] * inv / m;
            for (int n = 0; n < X.dim[0]; n++)
                for (int i = 0; i < X.dim[2]; i++)
                    for (int j = 0; j < X.dim[3]; j++) {
                        double xhat = (xs[X.at(n, c, i, j)] - mean) * inv;
                        blend(&static_cast<float*>(dx)[DX.at(n, c, i, j)],
                              k * (m * dys[DY.at(n, c, i, j)] - sdy - xhat * sdyx), ad, bd);
                    }
            blend(&static_cast<float*>(dscale)[c], sdyx, ap, bp);
            blend(&static_cast<float*>(dbias)[c], sdy, ap, bp);
        }
    });
}

// y = alpha y over every element the descriptor names.
Status cudnnScaleTensor(Handle* h, const Tensor* yd, void* y, const void* alpha) {
    if (!h || !yd || !alpha) return fail(BAD_PARAM_NULL_POINTER, "a null handle, descriptor or alpha");
    if (!yd->set) return fail(BAD_PARAM, "a descriptor that was never set");
    if (yd->dtype != FLOAT) return fail(NOT_SUPPORTED_DATA_TYPE, "only float tensors are emulated");
    if (Status s = inside(y, *yd, "y")) return s;
    const Tensor T = *yd;
    float a = *static_cast<const float*>(alpha);
    return queue(h, [=] {
        auto ys = static_cast<float*>(y);
        for (int n = 0; n < T.dim[0]; n++)
            for (int c = 0; c < T.dim[1]; c++)
                for (int i = 0; i < T.dim[2]; i++)
                    for (int j = 0; j < T.dim[3]; j++) ys[T.at(n, c, i, j)] *= a;
    });
}

}  // extern "C"
