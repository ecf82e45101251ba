/*
 * devshim host Adam(W): one pass over params, gradients, both moments (and the amsgrad maximum), writing the
 * updated params and, optionally, a bf16/fp16 copy of them in the same pass.
 *
 * Plain C, loaded with ctypes (so no Python or torch headers and no ABI tie to either). Built ahead of time by
 * kernels/setup.py; never compiled at run time.
 *
 * Arithmetic: the operations of PyTorch's fused CPU Adam kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp)
 * in its order, in fp32, hyperparameters rounded from double to float where PyTorch rounds them, and fused
 * multiply-adds where PyTorch's compiled vector loop has them (its source or its compiler's contraction):
 *     g = fma(p, wd, g)                      (Adam, L2)     p = p * (1 - lr*wd)      (AdamW)
 *     m = lerp(m, g, 1 - beta1)              (PyTorch's two-sided lerp, an fma)
 *     v = fma((1 - beta2)*g, g, v*beta2)
 *     vmax = maximum(vmax, v)                (amsgrad; NaN propagates)
 *     p = p + (-step_size*m) / (sqrt(v or vmax)/sqrt(bc2) + eps)
 * so that the result equals torch._fused_adamw_'s bit for bit (outside the few elements of its scalar tail).
 * Every operation is a correctly rounded IEEE one, so the vector loop, the scalar tail and the portable build
 * give bit-identical results, and so does any split over threads. That needs -ffp-contract=off (set by
 * setup.py): a multiply-add contracted in one loop and not in another would round differently.
 *
 * Threads: one contiguous range of the concatenated tensors per thread, run on torch's own OpenMP team when
 * the caller hands over the GOMP_parallel entry point of the runtime torch has loaded (see set_openmp below),
 * else on pthreads. Never an OpenMP runtime of its own: a second runtime beside torch's would oversubscribe.
 * SIMD: an AVX2+FMA+F16C variant chosen at run time with __builtin_cpu_supports (no -march: the library runs
 * on any x86-64), and a portable variant.
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* DEVSHIM_NO_SIMD / DEVSHIM_NO_PTHREADS build the portable variants only (to test them, or for a toolchain
 * that cannot compile the others). */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(DEVSHIM_NO_SIMD)
#define DEVSHIM_X86 1
#include <immintrin.h>
#endif

#if (defined(__unix__) || defined(__APPLE__)) && !defined(DEVSHIM_NO_PTHREADS)
#define DEVSHIM_PTHREADS 1
#include <pthread.h>
#endif

#if defined(_WIN32)
#define DEVSHIM_EXPORT __declspec(dllexport)
#else
#define DEVSHIM_EXPORT __attribute__((visibility("default")))
#endif

#if defined(__GNUC__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

#define DEVSHIM_ADAM_ABI 1
#define MAX_THREADS 256
#define SPLIT_ALIGN 16 /* elements: a thread's range starts on a 64-byte line of fp32 */

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_NONE = 3 };
enum { ISA_GENERIC = 0, ISA_AVX2 = 1 };

/* One tensor's update, as int64 fields so Python can fill it from an array('q'). Pointers may be 0 (none). */
typedef struct {
    int64_t numel;
    int64_t param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, copy; /* addresses */
    int64_t param_dtype, grad_dtype, copy_dtype;                     /* DT_*; states are always fp32 */
} adam_tensor;

typedef struct {
    float decay;        /* AdamW: float(1 - lr*wd) */
    float weight_decay; /* Adam (L2): float(wd) */
    float lerp_weight;  /* float(1 - beta1) */
    float lerp_coeff;   /* PyTorch's lerp: weight if |weight| < 0.5, else weight - 1 (from the end point) */
    int lerp_small;
    float beta2, beta2_weight; /* float(beta2), float(1 - beta2) */
    float bc2_sqrt, eps, neg_step_size;
    int adamw, has_decay, bc2_is_one; /* x / 1.0f == x: skip that division (no bias correction, or late steps) */
} hyper;

/* -- conversions (portable, bit-exact with PyTorch's vectorised conversions and with F16C) ------------------- */

static ALWAYS_INLINE uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static ALWAYS_INLINE float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static ALWAYS_INLINE float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

/* Round to nearest even; a NaN becomes 0xFFFF, which is what PyTorch's vectorised conversion writes. */
static ALWAYS_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u = f2u(f);
    if (f != f) return 0xFFFF;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static ALWAYS_INLINE float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7FFFu;
    if (em >= 0x7C00u) /* inf, NaN (quietened, as F16C does) */
        return u2f(sign | 0x7F800000u | ((em & 0x3FFu) << 13) | (em > 0x7C00u ? 0x00400000u : 0u));
    if (em >= 0x0400u) return u2f(sign | ((em + ((127u - 15u) << 10)) << 13));
    return u2f(sign | f2u((float)em * 5.9604644775390625e-08f)); /* subnormal: em * 2^-24, exact */
}

/* Round to nearest even with subnormals and overflow to inf; NaN: quiet, payload truncated (as F16C). */
static ALWAYS_INLINE uint16_t f32_to_f16(float f) {
    uint32_t u = f2u(f), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a >= 0x47800000u) /* |f| >= 65536: inf or NaN (smaller overflows round up to inf below) */
        return (uint16_t)(sign | (a > 0x7F800000u ? 0x7E00u | ((a >> 13) & 0x3FFu) : 0x7C00u));
    if (a < 0x38800000u) { /* below the smallest normal half: let an fp32 add round at 2^-24 */
        float r = u2f(a) + 0.5f;
        return (uint16_t)(sign | (f2u(r) - 0x3F000000u));
    }
    a += ((uint32_t)(15 - 127) << 23) + 0xFFFu + ((a >> 13) & 1u);
    return (uint16_t)(sign | (a >> 13));
}

static ALWAYS_INLINE float load_one(const void *base, int64_t i, int dt) {
    if (dt == DT_F32) return ((const float *)base)[i];
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t *)base)[i]);
    return f16_to_f32(((const uint16_t *)base)[i]);
}

static ALWAYS_INLINE void store_one(void *base, int64_t i, int dt, float x) {
    if (dt == DT_F32) ((float *)base)[i] = x;
    else if (dt == DT_BF16) ((uint16_t *)base)[i] = f32_to_bf16(x);
    else ((uint16_t *)base)[i] = f32_to_f16(x);
}

/* PyTorch's Vectorized<float> maximum: max_ps(a, b), or all-ones (a NaN) if either is NaN. */
static ALWAYS_INLINE float maximum_one(float a, float b) {
    if (a != a || b != b) return u2f(0xFFFFFFFFu);
    return a > b ? a : b;
}

/* -- the update of one element, shared by the portable loop and the vector loops' tails --------------------- */

static ALWAYS_INLINE void step_one(const adam_tensor *t, int64_t i, const hyper *h, int pdt, int gdt, int cdt) {
    float *m_ = (float *)(intptr_t)t->exp_avg, *v_ = (float *)(intptr_t)t->exp_avg_sq;
    float *vmax_ = (float *)(intptr_t)t->max_exp_avg_sq;
    float p = load_one((const void *)(intptr_t)t->param, i, pdt);
    float g = load_one((const void *)(intptr_t)t->grad, i, gdt);
    if (h->has_decay) {
        if (h->adamw) p = p * h->decay;
        else g = fmaf(p, h->weight_decay, g);
    }
    float m = m_[i], diff = g - m;
    m = h->lerp_small ? fmaf(h->lerp_coeff, diff, m) : fmaf(h->lerp_coeff, diff, g);
    float v = fmaf(h->beta2_weight * g, g, v_[i] * h->beta2);
    m_[i] = m;
    v_[i] = v;
    float s = v;
    if (vmax_) {
        s = maximum_one(vmax_[i], v);
        vmax_[i] = s;
    }
    float root = sqrtf(s);
    if (!h->bc2_is_one) root = root / h->bc2_sqrt;
    float denom = root + h->eps;
    p = p + (h->neg_step_size * m) / denom;
    store_one((void *)(intptr_t)t->param, i, pdt, p);
    if (cdt != DT_NONE) store_one((void *)(intptr_t)t->copy, i, cdt, p);
}

static ALWAYS_INLINE void generic_range(const adam_tensor *t, int64_t begin, int64_t end, const hyper *h, int pdt,
                                        int gdt, int cdt) {
    for (int64_t i = begin; i < end; ++i) step_one(t, i, h, pdt, gdt, cdt);
}

/* Instantiate a range function for every supported (param, grad, copy) dtype triple, so that each inner loop
 * is compiled for constant dtypes. Param fp32/bf16/fp16; grad fp32 or the param dtype; copy none/bf16/fp16. */
#define DISPATCH_DTYPES(RANGE, t, b, e, h)                                                                      \
    do {                                                                                                     \
        int pdt_ = (int)(t)->param_dtype, gdt_ = (int)(t)->grad_dtype, cdt_ = (int)(t)->copy_dtype;            \
        int key_ = pdt_ * 16 + gdt_ * 4 + cdt_;                                                              \
        switch (key_) {                                                                                      \
        case DT_F32 * 16 + DT_F32 * 4 + DT_NONE: RANGE(t, b, e, h, DT_F32, DT_F32, DT_NONE); break;          \
        case DT_F32 * 16 + DT_F32 * 4 + DT_BF16: RANGE(t, b, e, h, DT_F32, DT_F32, DT_BF16); break;          \
        case DT_F32 * 16 + DT_F32 * 4 + DT_F16: RANGE(t, b, e, h, DT_F32, DT_F32, DT_F16); break;            \
        case DT_BF16 * 16 + DT_BF16 * 4 + DT_NONE: RANGE(t, b, e, h, DT_BF16, DT_BF16, DT_NONE); break;      \
        case DT_BF16 * 16 + DT_F32 * 4 + DT_NONE: RANGE(t, b, e, h, DT_BF16, DT_F32, DT_NONE); break;        \
        case DT_F16 * 16 + DT_F16 * 4 + DT_NONE: RANGE(t, b, e, h, DT_F16, DT_F16, DT_NONE); break;          \
        case DT_F16 * 16 + DT_F32 * 4 + DT_NONE: RANGE(t, b, e, h, DT_F16, DT_F32, DT_NONE); break;          \
        default: /* a copy of a low-precision param, or a rarer mix: the same code, dtypes at run time */     \
            generic_range(t, b, e, h, pdt_, gdt_, cdt_);                                                     \
        }                                                                                                    \
    } while (0)

static void generic_chunk(const adam_tensor *t, int64_t begin, int64_t end, const hyper *h) {
    DISPATCH_DTYPES(generic_range, t, begin, end, h);
}

/* -- AVX2 + FMA + F16C ---------------------------------------------------------------------------------------- */

#ifdef DEVSHIM_X86
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

static ALWAYS_INLINE TARGET_AVX2 __m256 load8(const void *base, int64_t i, int dt) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (dt == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

static ALWAYS_INLINE TARGET_AVX2 __m128i to_bf16x8(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static ALWAYS_INLINE TARGET_AVX2 __m128i to_half8(__m256 x, int dt) {
    return dt == DT_BF16 ? to_bf16x8(x) : _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

static ALWAYS_INLINE TARGET_AVX2 void store8(void *base, int64_t i, int dt, __m256 x) {
    if (dt == DT_F32) _mm256_storeu_ps((float *)base + i, x);
    else _mm_storeu_si128((__m128i *)((uint16_t *)base + i), to_half8(x, dt));
}

/* The copy is written, never read: a streaming store skips reading its lines into the cache first (saves
 * 2 of ~32 bytes per element). Only for ranges far larger than the caches, where the copy would be evicted
 * before anyone reads it anyway. */
#ifndef STREAM_MIN_ELEMENTS
#define STREAM_MIN_ELEMENTS (1 << 20)
#endif
/* fp32 params are updated a block at a time, and the block's copy written from them while they are still in L1:
 * converting inside the update loop lengthens each iteration's dependency chain (sqrt, two divisions, then the
 * rounding) beyond what out-of-order execution overlaps, and costs a third more time when compute-bound. */
#define COPY_BLOCK 256
/* Software prefetch of the streams read, this many bytes ahead, once per 64-byte line of fp32: on top of the
 * hardware prefetchers it gains ~4% at 20M-100M elements on a Zen CPU, where the update runs at the speed of
 * memory. Prefetches never fault, past the end of a tensor included. */
#define PREFETCH_BYTES 512

static ALWAYS_INLINE TARGET_AVX2 void prefetch(const void *base, int64_t i, int dt) {
    const char *at = (const char *)base + i * (dt == DT_F32 ? 4 : 2);
    _mm_prefetch(at + PREFETCH_BYTES, _MM_HINT_T0);
}

static ALWAYS_INLINE TARGET_AVX2 void store_copy8(void *cp, int64_t i, int cdt, int stream, __m256 p) {
    if (stream) _mm_stream_si128((__m128i *)((uint16_t *)cp + i), to_half8(p, cdt));
    else store8(cp, i, cdt, p);
}

static ALWAYS_INLINE TARGET_AVX2 void avx2_range(const adam_tensor *t, int64_t begin, int64_t end, const hyper *h,
                                                 int pdt, int gdt, int cdt) {
    void *pp = (void *)(intptr_t)t->param, *cp = (void *)(intptr_t)t->copy;
    const void *gp = (const void *)(intptr_t)t->grad;
    float *mp = (float *)(intptr_t)t->exp_avg, *vp = (float *)(intptr_t)t->exp_avg_sq;
    float *vmaxp = (float *)(intptr_t)t->max_exp_avg_sq;
    const __m256 decay = _mm256_set1_ps(h->decay), wd = _mm256_set1_ps(h->weight_decay);
    const __m256 coeff = _mm256_set1_ps(h->lerp_coeff), beta2 = _mm256_set1_ps(h->beta2);
    const __m256 beta2_weight = _mm256_set1_ps(h->beta2_weight), bc2_sqrt = _mm256_set1_ps(h->bc2_sqrt);
    const __m256 eps = _mm256_set1_ps(h->eps), neg_step = _mm256_set1_ps(h->neg_step_size);
    const int adamw_decay = h->has_decay && h->adamw, l2_decay = h->has_decay && !h->adamw;
    const int lerp_small = h->lerp_small, bc2_is_one = h->bc2_is_one;
    const int copy_after = cdt != DT_NONE && pdt == DT_F32; /* else converted in the loop (no fp32 to reread) */
    const int stream = cdt != DT_NONE && end - begin >= STREAM_MIN_ELEMENTS;
    int64_t i = begin;
    if (stream) /* streaming stores need 16-byte alignment: reach it with single elements first */
        for (; i < end && ((uintptr_t)((uint16_t *)cp + i) & 15u) != 0; ++i) step_one(t, i, h, pdt, gdt, cdt);
    while (i + 8 <= end) {
        const int64_t block = i, stop = end - i > COPY_BLOCK ? i + COPY_BLOCK : end;
        for (; i + 8 <= stop; i += 8) {
            if (((i - begin) & 8) == 0) {
                prefetch(pp, i, pdt);
                prefetch(gp, i, gdt);
                prefetch(mp, i, DT_F32);
                prefetch(vp, i, DT_F32);
                if (vmaxp) prefetch(vmaxp, i, DT_F32);
            }
            __m256 p = load8(pp, i, pdt), g = load8(gp, i, gdt);
            if (adamw_decay) p = _mm256_mul_ps(p, decay);
            if (l2_decay) g = _mm256_fmadd_ps(p, wd, g);
            __m256 m = _mm256_loadu_ps(mp + i);
            m = _mm256_fmadd_ps(coeff, _mm256_sub_ps(g, m), lerp_small ? m : g);
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(vp + i), beta2);
            v = _mm256_fmadd_ps(_mm256_mul_ps(beta2_weight, g), g, v);
            _mm256_storeu_ps(mp + i, m);
            _mm256_storeu_ps(vp + i, v);
            __m256 s = v;
            if (vmaxp) {
                __m256 old = _mm256_loadu_ps(vmaxp + i);
                s = _mm256_or_ps(_mm256_max_ps(old, v), _mm256_cmp_ps(old, v, _CMP_UNORD_Q));
                _mm256_storeu_ps(vmaxp + i, s);
            }
            __m256 root = _mm256_sqrt_ps(s);
            if (!bc2_is_one) root = _mm256_div_ps(root, bc2_sqrt);
            __m256 denom = _mm256_add_ps(root, eps);
            p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step, m), denom));
            store8(pp, i, pdt, p);
            if (cdt != DT_NONE && !copy_after) store_copy8(cp, i, cdt, stream, p);
        }
        if (copy_after)
            for (int64_t j = block; j < i; j += 8) store_copy8(cp, j, cdt, stream, _mm256_loadu_ps((float *)pp + j));
    }
    for (; i < end; ++i) step_one(t, i, h, pdt, gdt, cdt);
    if (stream) _mm_sfence();
}

static TARGET_AVX2 void avx2_chunk(const adam_tensor *t, int64_t begin, int64_t end, const hyper *h) {
    DISPATCH_DTYPES(avx2_range, t, begin, end, h);
}

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#endif

/* -- threads ------------------------------------------------------------------------------------------------- */

typedef struct {
    const adam_tensor *tensors;
    int64_t count, begin, end; /* a range of the concatenation of all tensors */
    const hyper *h;
    int isa;
} work;

/* Where a split point of the concatenation falls inside one tensor, rounded up to SPLIT_ALIGN elements from
 * the tensor's start. Monotone in `global`, so consecutive splits partition every tensor exactly. */
static int64_t local_split(int64_t global, int64_t offset, int64_t numel) {
    int64_t l = global - offset;
    if (l <= 0) return 0;
    l = (l + SPLIT_ALIGN - 1) / SPLIT_ALIGN * SPLIT_ALIGN;
    return l < numel ? l : numel;
}

static void *run_work(void *arg) {
    const work *w = (const work *)arg;
    int64_t offset = 0;
    for (int64_t k = 0; k < w->count; ++k) {
        const adam_tensor *t = &w->tensors[k];
        int64_t b = local_split(w->begin, offset, t->numel), e = local_split(w->end, offset, t->numel);
        offset += t->numel;
        if (b >= e) continue;
#ifdef DEVSHIM_X86
        if (w->isa == ISA_AVX2) {
            avx2_chunk(t, b, e, w->h);
            continue;
        }
#endif
        generic_chunk(t, b, e, w->h);
    }
    return NULL;
}

/* A team of torch's own OpenMP threads, when the caller hands us that runtime's GOMP_parallel entry point:
 * torch's workers spin for a while after each parallel region, and threads of our own would compete with them
 * for the cores. Each team member claims ranges until none is left, so a smaller team than asked still does
 * all the work. */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static gomp_parallel_fn gomp_parallel = NULL;

#if defined(__GNUC__)
#define DEVSHIM_TEAMS 1
typedef struct {
    work *works;
    int count;
    int next; /* the next range to claim, atomically */
} team;

static void run_team(void *arg) {
    team *t = (team *)arg;
    for (int k; (k = __atomic_fetch_add(&t->next, 1, __ATOMIC_RELAXED)) < t->count;) run_work(&t->works[k]);
}
#endif

/* -- exported API -------------------------------------------------------------------------------------------- */

/* Use this OpenMP runtime's GOMP_parallel (torch's, already loaded) for threads; NULL: pthreads. */
DEVSHIM_EXPORT void devshim_adam_set_openmp(void *gomp_parallel_entry) {
    gomp_parallel = (gomp_parallel_fn)gomp_parallel_entry;
}

DEVSHIM_EXPORT int devshim_adam_abi_version(void) { return DEVSHIM_ADAM_ABI; }

/* The fastest variant this CPU runs: ISA_AVX2 or ISA_GENERIC. */
DEVSHIM_EXPORT int devshim_adam_best_isa(void) {
#ifdef DEVSHIM_X86
    if (cpu_has_avx2()) return ISA_AVX2;
#endif
    return ISA_GENERIC;
}

DEVSHIM_EXPORT int devshim_adam_has_threads(void) {
#ifdef DEVSHIM_PTHREADS
    return 1; /* (GOMP teams need GCC/Clang atomics, which every compiler with pthreads here has) */
#else
    return 0;
#endif
}

/* One Adam(W) step over `count` tensors. bias_correction1/2 are 1 - beta**step (1.0 without bias correction),
 * computed by the caller in double. Returns 0, or -1 for an unknown dtype or ISA. */
DEVSHIM_EXPORT int devshim_adam_step(const adam_tensor *tensors, int64_t count, double lr, double beta1, double beta2,
                                     double eps, double weight_decay, double bias_correction1,
                                     double bias_correction2, int adamw_mode, int num_threads, int isa) {
    int64_t total = 0;
    for (int64_t k = 0; k < count; ++k) {
        const adam_tensor *t = &tensors[k];
        if (t->param_dtype < DT_F32 || t->param_dtype > DT_F16 || t->grad_dtype < DT_F32 || t->grad_dtype > DT_F16
            || t->copy_dtype < DT_F32 || t->copy_dtype > DT_NONE || t->numel < 0)
            return -1;
        total += t->numel;
    }
    if (isa != ISA_GENERIC && isa != ISA_AVX2) return -1;
#ifdef DEVSHIM_X86
    if (isa == ISA_AVX2 && !cpu_has_avx2()) return -1;
#else
    if (isa == ISA_AVX2) return -1;
#endif

    /* The scalars exactly as PyTorch forms them: in double, then rounded to float once. */
    hyper h;
    double lerp_weight = 1.0 - beta1;
    h.decay = (float)(1.0 - lr * weight_decay);
    h.weight_decay = (float)weight_decay;
    h.lerp_weight = (float)lerp_weight;
    h.lerp_small = fabsf(h.lerp_weight) < 0.5f;
    h.lerp_coeff = h.lerp_small ? h.lerp_weight : h.lerp_weight - 1.0f;
    h.beta2 = (float)beta2;
    h.beta2_weight = (float)(1.0 - beta2);
    h.bc2_sqrt = (float)sqrt(bias_correction2);
    h.bc2_is_one = h.bc2_sqrt == 1.0f;
    h.eps = (float)eps;
    h.neg_step_size = (float)(-(lr / bias_correction1));
    h.adamw = adamw_mode != 0;
    h.has_decay = weight_decay != 0.0;

    if (num_threads < 1) num_threads = 1;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    work works[MAX_THREADS];
    for (int k = 0; k < num_threads; ++k) {
        works[k].tensors = tensors;
        works[k].count = count;
        works[k].begin = total / num_threads * k + total % num_threads * k / num_threads;
        works[k].end = total / num_threads * (k + 1) + total % num_threads * (k + 1) / num_threads;
        works[k].h = &h;
        works[k].isa = isa;
    }
#ifdef DEVSHIM_TEAMS
    if (gomp_parallel != NULL && num_threads > 1) {
        team t = {works, num_threads, 0};
        gomp_parallel(run_team, &t, (unsigned)num_threads, 0);
        return 0;
    }
#endif
#ifdef DEVSHIM_PTHREADS
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int k = 1; k < num_threads; ++k) started[k] = pthread_create(&threads[k], NULL, run_work, &works[k]) == 0;
    run_work(&works[0]);
    for (int k = 1; k < num_threads; ++k) {
        if (started[k]) pthread_join(threads[k], NULL);
        else run_work(&works[k]); /* no thread to be had: do its share here */
    }
#else
    for (int k = 0; k < num_threads; ++k) run_work(&works[k]);
#endif
    return 0;
}
