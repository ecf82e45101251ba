/*
 * devshim row-wise fp32 kernels: RMSNorm and SwiGLU, forward and backward, each in one pass over its rows.
 *
 * The torch-op versions (devshim_kernels.norm / .glu) make several passes over memory with an aten call each;
 * at the sizes a tensor-parallel shard of a transformer layer has, the passes and the calls cost more than the
 * arithmetic. These are what devshim_kernels runs for contiguous fp32 tensors in a single-threaded process
 * (one thread per rank, as multi-rank CPU training runs); elsewhere the torch-op versions run on torch's threads.
 *
 * Plain C, loaded with ctypes, built ahead of time by kernels/setup.py (never at run time). No -march: on
 * x86-64 Linux, GCC's target_clones compiles each entry point for AVX-512, AVX2 and the baseline and picks one
 * at load time. Sums use LANES independent accumulators, so the compiler can vectorise them without reassociating
 * anything itself (-ffp-contract=off, no -ffast-math): the result does not depend on which clone runs.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(_WIN32)
#define DEVSHIM_EXPORT __declspec(dllexport)
#else
#define DEVSHIM_EXPORT __attribute__((visibility("default")))
#endif

#if defined(__linux__) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(DEVSHIM_NO_SIMD)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

#define DEVSHIM_ROWWISE_ABI 1
#define LANES 16

DEVSHIM_EXPORT int devshim_rowwise_abi_version(void) { return DEVSHIM_ROWWISE_ABI; }

/* sum of a[i] * b[i] * (w ? w[i] : 1) */
static inline float weighted_dot(const float *a, const float *b, const float *w, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    if (w) {
        for (; i + LANES <= n; i += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * w[i + j] * b[i + j];
    } else {
        for (; i + LANES <= n; i += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    }
    float total = 0.0f;
    for (int j = 0; j < LANES; j++) total += acc[j];
    for (; i < n; i++) total += a[i] * (w ? w[i] : 1.0f) * b[i];
    return total;
}

/* out = x * rstd * w per row (w may be NULL), rstd = 1 / sqrt(mean(x^2) + eps); rows of `width` contiguous */
DEVSHIM_EXPORT CLONES void devshim_rms_norm_forward(const float *x, const float *w, float *out, float *rstd,
                                                    int64_t rows, int64_t width, double eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * width;
        float *o = out + r * width;
        float s = 1.0f / sqrtf(weighted_dot(xr, xr, NULL, width) / (float)width + (float)eps);
        rstd[r] = s;
        if (w) {
            for (int64_t i = 0; i < width; i++) o[i] = (xr[i] * s) * w[i];
        } else {
            for (int64_t i = 0; i < width; i++) o[i] = xr[i] * s;
        }
    }
}

/* With g = dy * w:  dx = s * (g - x * s^2 * mean(g * x)),  dw += sum over rows of dy * x * s.
 * dx or dw may be NULL (that gradient is not wanted); dw accumulates, so the caller zeroes it. */
DEVSHIM_EXPORT CLONES void devshim_rms_norm_backward(const float *x, const float *w, const float *rstd,
                                                     const float *dy, float *dx, float *dw, int64_t rows,
                                                     int64_t width) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * width, *g = dy + r * width;
        const float s = rstd[r];
        if (dw) {
            for (int64_t i = 0; i < width; i++) dw[i] += g[i] * xr[i] * s;
        }
        if (!dx) continue;
        const float coeff = weighted_dot(g, xr, w, width) / (float)width * s * s;
        float *d = dx + r * width;
        if (w) {
            for (int64_t i = 0; i < width; i++) d[i] = (g[i] * w[i] - xr[i] * coeff) * s;
        } else {
            for (int64_t i = 0; i < width; i++) d[i] = (g[i] - xr[i] * coeff) * s;
        }
    }
}

/* exp(x) for x <= 0 in a form the compiler vectorises (libm's expf is a call per element): 2^n * p(r) with
 * r = x - n*ln2 in [-ln2/2, ln2/2], p the degree-7 Taylor polynomial (relative error below 2e-8 before rounding).
 * Below -87 it returns 0 (exp is then under 2^-125: no subnormals, which the 2^n built from bits cannot be). */
static inline float exp_nonpositive(float x) {
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer, to nearest */
    const int underflow = x < -87.0f;
    x = underflow ? -87.0f : x;
    float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f; /* ln2 in two parts */
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720
                         + r * (1.0f / 5040)))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return underflow ? 0.0f : p * scale;
}

/* sigmoid(a) without overflow: e = exp(-|a|) <= 1 */
static inline float sigmoid(float a) {
    float e = exp_nonpositive(a < 0 ? a : -a);
    return a < 0 ? e / (1.0f + e) : 1.0f / (1.0f + e);
}

/* out[r, i] = silu(a) * b for a = x[r, i], b = x[r, half + i]; rows of 2*half contiguous, out rows of half */
DEVSHIM_EXPORT CLONES void devshim_swiglu_forward(const float *x, float *out, int64_t rows, int64_t half) {
    for (int64_t r = 0; r < rows; r++) {
        const float *a = x + r * 2 * half, *b = a + half;
        float *o = out + r * half;
        for (int64_t i = 0; i < half; i++) o[i] = a[i] * sigmoid(a[i]) * b[i];
    }
}

/* da = g * b * silu'(a) with silu'(a) = s * (1 + a * (1 - s)), s = sigmoid(a);  db = g * silu(a) */
DEVSHIM_EXPORT CLONES void devshim_swiglu_backward(const float *x, const float *grad, float *dx, int64_t rows,
                                                   int64_t half) {
    for (int64_t r = 0; r < rows; r++) {
        const float *a = x + r * 2 * half, *b = a + half, *g = grad + r * half;
        float *da = dx + r * 2 * half, *db = da + half;
        for (int64_t i = 0; i < half; i++) {
            const float s = sigmoid(a[i]);
            da[i] = g[i] * b[i] * (s * (1.0f + a[i] * (1.0f - s)));
            db[i] = g[i] * (a[i] * s);
        }
    }
}
