// A stand-in for cuBLAS (libcublas.so.13) beside driver.cpp: the handle calls and SGEMM, the
// only routine the CUDA backend uses (linear layers), as a plain column-major loop in double,
// queued on the handle's stream (through the emulated driver's cuLaunchHostFunc) like any
// other work. Its matrix arguments are checked against the device allocations (through the
// emulated driver), as far as their sizes and leading dimensions reach.
#include <cstddef>
#include <cstdio>

typedef int cublasStatus_t;
enum : cublasStatus_t { OK = 0, INVALID_VALUE = 7 };

extern "C" int cuLaunchHostFunc(void* stream, void (*f)(void*), void* data);
extern "C" std::size_t gems_emu_device_bytes(const void* p);

namespace {
struct Handle { void* stream = nullptr; };
// One SGEMM's arguments, alpha and beta read at the call (host pointer mode).
struct Sgemm {
    int ta, tb, m, n, k;
    float alpha;
    const float* a;
    int lda;
    const float* b;
    int ldb;
    float beta;
    float* c;
    int ldc;
};
void run(void* p) {
    const Sgemm& g = *static_cast<Sgemm*>(p);
    for (int j = 0; j < g.n; j++)
        for (int i = 0; i < g.m; i++) {
            double s = 0;
            for (int l = 0; l < g.k; l++) {
                double x = g.ta ? g.a[l + (std::size_t)i * g.lda] : g.a[i + (std::size_t)l * g.lda];
                double y = g.tb ? g.b[j + (std::size_t)l * g.ldb] : g.b[l + (std::size_t)j * g.ldb];
                s += x * y;
            }
            float& out = g.c[i + (std::size_t)j * g.ldc];
            // beta 0 ignores C (it may hold NaN), as cuBLAS does.
            out = float(g.alpha * s + (g.beta == 0.0f ? 0.0 : double(g.beta) * out));
        }
    delete static_cast<Sgemm*>(p);
}
// The column-major matrix `what` at `p` (rows x cols, leading dimension ld) lies in one device
// allocation; else says why not.
bool fits(const char* what, const float* p, int rows, int cols, int ld) {
    if (rows == 0 || cols == 0) return true;
    std::size_t need = ((std::size_t)(cols - 1) * ld + rows) * sizeof(float);
    std::size_t have = gems_emu_device_bytes(p);
    if (need <= have) return true;
    if (have)
        std::fprintf(stderr,
                     "emulated cuBLAS: SGEMM's %s (%d x %d, leading dimension %d) reaches %zu bytes from %p, "
                     "%zu bytes past the end of its device allocation\n",
                     what, rows, cols, ld, need, static_cast<const void*>(p), need - have);
    else
        std::fprintf(stderr, "emulated cuBLAS: SGEMM's %s (%d x %d, leading dimension %d) at %p is not in device memory\n",
                     what, rows, cols, ld, static_cast<const void*>(p));
    return false;
}
}  // namespace

extern "C" {

cublasStatus_t cublasCreate_v2(void** handle) { *handle = new Handle; return OK; }
cublasStatus_t cublasDestroy_v2(void* handle) { delete static_cast<Handle*>(handle); return OK; }
cublasStatus_t cublasSetStream_v2(void* handle, void* stream) { static_cast<Handle*>(handle)->stream = stream; return OK; }
cublasStatus_t cublasSetMathMode(void*, int) { return OK; }
cublasStatus_t cublasSetWorkspace_v2(void*, void*, std::size_t) { return OK; }

// C = alpha op(A) op(B) + beta C, column-major; op is 0 (N) or 1 (T).
cublasStatus_t cublasSgemm_v2(void* handle, int ta, int tb, int m, int n, int k, const float* alpha,
                              const float* a, int lda, const float* b, int ldb, const float* beta,
                              float* c, int ldc) {
    if (ta > 1 || tb > 1 || m < 0 || n < 0 || k < 0) return INVALID_VALUE;
    if (lda < (ta ? k : m) || ldb < (tb ? n : k) || ldc < m) return INVALID_VALUE;
    bool any = m && n, sum = any && k;
    if (!(sum ? fits("A", a, ta ? k : m, ta ? m : k, lda) && fits("B", b, tb ? n : k, tb ? k : n, ldb) : true) ||
        !(any ? fits("C", c, m, n, ldc) : true))
        return INVALID_VALUE;
    auto* g = new Sgemm{ta, tb, m, n, k, *alpha, a, lda, b, ldb, *beta, c, ldc};
    return cuLaunchHostFunc(static_cast<Handle*>(handle)->stream, run, g) ? INVALID_VALUE : OK;
}

}  // extern "C"
