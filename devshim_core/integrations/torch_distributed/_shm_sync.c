/* The rank-to-rank synchronisation of devshim's shared-memory collectives (shared_memory.py).
 *
 * Each rank of a group owns one 64-bit counter in the group's shared segment. Arriving at the n-th barrier
 * stores n there with release order, so every write the rank made to the segment before is visible to a rank
 * that reads n with acquire order. Waiting reads the other ranks' counters until each is at least n.
 *
 * Python cannot give these orderings (a torch copy and a plain store may be seen out of order on aarch64),
 * and a gloo barrier costs two loopback round trips, more than a small collective itself. The wait spins
 * briefly, then yields, then sleeps in growing steps (up to 1 ms), so that a rank waiting minutes for a slow
 * one (a checkpoint on another rank) does not hold a core. It releases the GIL and returns after at most
 * `slice_s` seconds with the index of a rank that has not arrived, so that the caller can check that rank is
 * alive and enforce the process group's timeout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

typedef struct {
    uint32_t sequence;
    uint32_t pad;
    int64_t waiters;
} Wake;

static long futex(uint32_t *word, int op, uint32_t value, const struct timespec *timeout) {
    /* not FUTEX_PRIVATE_FLAG: the word is in a mapping shared between processes */
    return syscall(SYS_futex, word, op, value, timeout, NULL, 0);
}

/* arrive(address, value, wake): store `value` into the int64 at `address`, then wake the sleeping waiters. */
static PyObject *arrive(PyObject *self, PyObject *args) {
    unsigned long long address, wake_address;
    long long value;
    if (!PyArg_ParseTuple(args, "KLK", &address, &value, &wake_address)) return NULL;
    Wake *wake = (Wake *)(uintptr_t)wake_address;
    __atomic_store_n((int64_t *)(uintptr_t)address, (int64_t)value, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&wake->sequence, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&wake->waiters, __ATOMIC_SEQ_CST) > 0) futex(&wake->sequence, FUTEX_WAKE, INT_MAX, NULL);
    Py_RETURN_NONE;
}

/* load(address) -> int: the int64 at `address`, read with acquire order. */
static PyObject *load(PyObject *self, PyObject *args) {
    unsigned long long address;
    if (!PyArg_ParseTuple(args, "K", &address)) return NULL;
    return PyLong_FromLongLong(__atomic_load_n((int64_t *)(uintptr_t)address, __ATOMIC_ACQUIRE));
}

static inline Py_ssize_t first_below(const char *base, Py_ssize_t from, Py_ssize_t count, Py_ssize_t stride,
                                     int64_t target) {
    while (from < count && __atomic_load_n((const int64_t *)(base + from * stride), __ATOMIC_SEQ_CST) >= target)
        from++;
    return from;
}

/* wait(address, count, stride, target, slice_s, wake) -> int: -1 once each of the `count` int64 counters at
 * address + k * stride holds at least `target`; else, after `slice_s` seconds, the index of the first counter
 * still below it. */
static PyObject *wait(PyObject *self, PyObject *args) {
    unsigned long long address, wake_address;
    Py_ssize_t count, stride;
    long long target;
    double slice_s;
    if (!PyArg_ParseTuple(args, "KnnLdK", &address, &count, &stride, &target, &slice_s, &wake_address)) return NULL;
    const char *base = (const char *)(uintptr_t)address;
    Wake *wake = (Wake *)(uintptr_t)wake_address;
    Py_ssize_t k = first_below(base, 0, count, stride, target);
    if (k == count) return PyLong_FromLong(-1); /* everyone was there: no GIL round trip */
    Py_BEGIN_ALLOW_THREADS
    for (int spins = 0; spins < 4000 && k < count; spins++) {
        cpu_relax();
        k = first_below(base, k, count, stride, target);
    }
    double deadline = now_s() + slice_s;
    while (k < count) {
        uint32_t seen = __atomic_load_n(&wake->sequence, __ATOMIC_SEQ_CST);
        __atomic_fetch_add(&wake->waiters, 1, __ATOMIC_SEQ_CST);
        k = first_below(base, k, count, stride, target);
        if (k < count) {
            double left = deadline - now_s();
            if (left > 0) {
                struct timespec timeout = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
                futex(&wake->sequence, FUTEX_WAIT, seen, &timeout);
            }
        }
        __atomic_fetch_sub(&wake->waiters, 1, __ATOMIC_SEQ_CST);
        k = first_below(base, k, count, stride, target);
        if (k < count && now_s() >= deadline) break;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(k < count ? k : -1);
}

static PyMethodDef methods[] = {
    {"arrive", arrive, METH_VARARGS, "arrive(address, value, wake): store value (int64), wake the waiters"},
    {"load", load, METH_VARARGS, "load(address) -> int: the int64 at address, read with acquire order"},
    {"wait", wait, METH_VARARGS,
     "wait(address, count, stride, target, slice_s, wake) -> int: -1 once every counter is >= target, else after "
     "slice_s seconds the index of one that is not"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_shm_sync",
                                    "Release/acquire counters for devshim's shared-memory collectives.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__shm_sync(void) { return PyModule_Create(&module); }
