// A stand-in for cuBLAS (libcublas.so.13) beside driver.cpp: the handle calls and SGEMM, the
// only routine the CUDA backend uses (linear layers), as a plain column-major loop in double.
#include <cstddef>
#include <cstdio>

typedef int cublasStatus_t;
enum : cublasStatus_t { OK = 0, INVALID_VALUE = 7 };

extern "C" {

cublasStatus_t cublasCreate_v2(void** handle) { *handle = new int(0); return OK; }
cublasStatus_t cublasDestroy_v2(void* handle) { delete static_cast<int*>(handle); return OK; }
cublasStatus_t cublasSetStream_v2(void*, void*) { return OK; }
cublasStatus_t cublasSetMathMode(void*, int) { return OK; }
cublasStatus_t cublasSetWorkspace_v2(void*, void*, std::size_t) { return OK; }

// C = alpha op(A) op(B) + beta C, column-major; op is 0 (N) or 1 (T).
cublasStatus_t cublasSgemm_v2(void*, int ta, int tb, int m, int n, int k, const float* alpha,
                              const float* a, int lda, const float* b, int ldb, const float* beta,
                              float* c, int ldc) {
    if (ta > 1 || tb > 1 || m < 0 || n < 0 || k < 0) return INVALID_VALUE;
    if (lda < (ta ? k : m) || ldb < (tb ? n : k) || ldc < m) return INVALID_VALUE;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            double s = 0;
            for (int l = 0; l < k; l++) {
                double x = ta ? a[l + (std::size_t)i * lda] : a[i + (std::size_t)l * lda];
                double y = tb ? b[j + (std::size_t)l * ldb] : b[l + (std::size_t)j * ldb];
                s += x * y;
            }
            float& out = c[i + (std::size_t)j * ldc];
            // beta 0 ignores C (it may hold NaN), as cuBLAS does.
            out = float(*alpha * s + (*beta == 0.0f ? 0.0 : double(*beta) * out));
        }
    return OK;
}

}  // extern "C"
