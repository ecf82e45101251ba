/* Asynchronous file I/O for host buffers: a pool of threads doing pread/pwrite, loaded with ctypes.
 *
 * What DeepSpeed's async_io op does with libaio, done with plain POSIX calls so that nothing is needed at run
 * time but libc. A handle owns `threads` workers. Every submitted request is cut into `block_size` chunks that
 * the workers take in submission order, so up to `threads` chunks are in flight at once (libaio's queue depth).
 * Chunks made of whole pages (address, file offset and length page-aligned) go through an O_DIRECT descriptor,
 * like DeepSpeed's op, so the page cache neither inflates nor pays for the transfer; anything else, or a file
 * system that refuses O_DIRECT, goes through an ordinary descriptor. Whole pages, not the 512 bytes O_DIRECT may
 * accept: a buffered chunk sharing a page with a direct one could have its stale copy of that page written
 * back over the direct data.
 *
 * wait() blocks (ctypes has released the GIL) until every submitted request has finished, closes their files,
 * and reports the number of requests and the first failure: its errno and its position in submission order.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define DEVSHIM_AIO_ABI 2 /* 2: paths are opened with O_NOFOLLOW */

#if defined(__GNUC__)
#define EXPORT __attribute__((visibility("default")))
#else
#define EXPORT
#endif

typedef struct request {
    struct request *next_work; /* in the work queue while chunks remain to be handed out */
    struct request *next_all;  /* in the submitted list until wait() */
    int read;
    int fd_direct;   /* -1 when O_DIRECT is refused or the caller gave a descriptor */
    int fd_buffered;
    int owns_fds;
    char *buffer;
    int64_t nbytes;
    int64_t file_offset;
    int64_t cursor; /* next byte to hand out */
    int error;      /* first errno seen by a chunk of this request, 0 if none */
    int64_t index;  /* position in submission order since the last wait() */
} request;

typedef struct handle {
    pthread_mutex_t lock;
    pthread_cond_t work;
    pthread_cond_t done;
    request *work_head, *work_tail;
    request *all_head, *all_tail;
    int64_t block_size;
    int64_t chunks_unfinished;
    int64_t submitted;
    int threads;
    int started;
    int stop;
    pthread_t *workers;
} handle;

static int64_t page_size = 4096; /* set from sysconf by devshim_aio_create */

static int aligned(const void *address, int64_t offset, int64_t length) {
    return ((uintptr_t)address % (uint64_t)page_size) == 0 && offset % page_size == 0 && length % page_size == 0;
}

/* Moves `length` bytes of `r` starting at `start`; returns 0 or an errno. */
static int transfer(request *r, int64_t start, int64_t length) {
    char *address = r->buffer + start;
    int64_t offset = r->file_offset + start;
    int direct = r->fd_direct >= 0 && aligned(address, offset, length);
    while (length > 0) {
        int fd = direct ? r->fd_direct : r->fd_buffered;
        ssize_t moved = r->read ? pread(fd, address, (size_t)length, offset)
                                : pwrite(fd, address, (size_t)length, offset);
        if (moved < 0) {
            if (errno == EINTR) continue;
            if (errno == EINVAL && direct) { /* a file system wanting more than page alignment */
                direct = 0;
                continue;
            }
            return errno;
        }
        if (moved == 0) return r->read ? ENODATA : EIO; /* the file ends before the request does */
        address += moved;
        offset += moved;
        length -= moved;
        /* a short direct transfer leaves the rest unaligned only if `moved` is; check again */
        direct = direct && aligned(address, offset, length);
    }
    return 0;
}

static void *worker(void *argument) {
    handle *h = (handle *)argument;
    pthread_mutex_lock(&h->lock);
    for (;;) {
        while (!h->stop && h->work_head == NULL) pthread_cond_wait(&h->work, &h->lock);
        if (h->work_head == NULL) break; /* stopping, and nothing left to do */
        request *r = h->work_head;
        int64_t start = r->cursor;
        int64_t length = r->nbytes - start < h->block_size ? r->nbytes - start : h->block_size;
        r->cursor += length;
        if (r->cursor == r->nbytes) {
            h->work_head = r->next_work;
            if (h->work_head == NULL) h->work_tail = NULL;
        }
        pthread_mutex_unlock(&h->lock);
        int error = transfer(r, start, length);
        pthread_mutex_lock(&h->lock);
        if (error != 0 && r->error == 0) r->error = error;
        if (--h->chunks_unfinished == 0) pthread_cond_broadcast(&h->done);
    }
    pthread_mutex_unlock(&h->lock);
    return NULL;
}

EXPORT int devshim_aio_abi_version(void) { return DEVSHIM_AIO_ABI; }

EXPORT handle *devshim_aio_create(int threads, int64_t block_size) {
    if (threads < 1 || block_size < 1) return NULL;
    long page = sysconf(_SC_PAGESIZE);
    if (page > 0) page_size = page;
    handle *h = calloc(1, sizeof(handle));
    if (h == NULL) return NULL;
    h->workers = calloc((size_t)threads, sizeof(pthread_t));
    if (h->workers == NULL) {
        free(h);
        return NULL;
    }
    pthread_mutex_init(&h->lock, NULL);
    pthread_cond_init(&h->work, NULL);
    pthread_cond_init(&h->done, NULL);
    h->block_size = block_size;
    h->threads = threads;
    for (; h->started < threads; ++h->started) {
        if (pthread_create(&h->workers[h->started], NULL, worker, h) != 0) break;
    }
    if (h->started == 0) { /* not one thread: nothing could ever finish */
        free(h->workers);
        free(h);
        return NULL;
    }
    return h;
}

EXPORT int devshim_aio_threads(const handle *h) { return h->started; }

static void close_request(request *r) {
    if (!r->owns_fds) return;
    if (r->fd_direct >= 0) close(r->fd_direct);
    if (r->fd_buffered >= 0) close(r->fd_buffered);
}

/* Queues a transfer of `nbytes` between `buffer` and `path` (or, when `path` is NULL, the caller's open
 * descriptor `fd`) at `file_offset`. Returns 0, or an errno if the file cannot be opened; nothing is queued
 * then. The buffer must stay alive and untouched until wait() returns. */
EXPORT int devshim_aio_submit(handle *h, int read, const char *path, int fd, void *buffer, int64_t nbytes,
                              int64_t file_offset) {
    if (nbytes < 0 || file_offset < 0) return EINVAL;
    request *r = calloc(1, sizeof(request));
    if (r == NULL) return ENOMEM;
    r->read = read;
    r->buffer = (char *)buffer;
    r->nbytes = nbytes;
    r->file_offset = file_offset;
    r->fd_direct = -1;
    r->fd_buffered = fd;
    if (path != NULL) {
        /* O_NOFOLLOW: a symlink planted at a swap path fails the open (ELOOP) instead of having its target
         * overwritten or read as swap data. */
        int flags = (read ? O_RDONLY : (O_WRONLY | O_CREAT)) | O_CLOEXEC | O_NOFOLLOW;
        r->owns_fds = 1;
        r->fd_buffered = open(path, flags, 0600);
        if (r->fd_buffered < 0) {
            int error = errno;
            free(r);
            return error;
        }
#ifdef O_DIRECT
        r->fd_direct = open(path, flags | O_DIRECT, 0600);
        if (r->fd_direct >= 0) {
            /* the second open must reach the same file: one swapped in between the two is not written */
            struct stat buffered, direct;
            if (fstat(r->fd_buffered, &buffered) != 0 || fstat(r->fd_direct, &direct) != 0 ||
                buffered.st_dev != direct.st_dev || buffered.st_ino != direct.st_ino) {
                close(r->fd_direct);
                r->fd_direct = -1;
            }
        }
#endif
    }
    pthread_mutex_lock(&h->lock);
    r->index = h->submitted++;
    if (h->all_tail) h->all_tail->next_all = r; else h->all_head = r;
    h->all_tail = r;
    if (nbytes > 0) {
        h->chunks_unfinished += (nbytes + h->block_size - 1) / h->block_size;
        if (h->work_tail) h->work_tail->next_work = r; else h->work_head = r;
        h->work_tail = r;
        pthread_cond_broadcast(&h->work);
    }
    pthread_mutex_unlock(&h->lock);
    return 0;
}

/* Waits for every submitted request. Returns how many there were; `*error` is the first failure's errno (0 if
 * none) and `*failed_index` its position in submission order. */
EXPORT int64_t devshim_aio_wait(handle *h, int *error, int64_t *failed_index) {
    *error = 0;
    *failed_index = -1;
    pthread_mutex_lock(&h->lock);
    while (h->chunks_unfinished > 0) pthread_cond_wait(&h->done, &h->lock);
    request *r = h->all_head;
    int64_t count = h->submitted;
    h->all_head = h->all_tail = NULL;
    h->submitted = 0;
    pthread_mutex_unlock(&h->lock);
    while (r != NULL) {
        request *next = r->next_all;
        if (r->error != 0 && *error == 0) {
            *error = r->error;
            *failed_index = r->index;
        }
        close_request(r);
        free(r);
        r = next;
    }
    return count;
}

/* Stops the workers after the queued work; requests not yet waited for are finished and closed. */
EXPORT void devshim_aio_destroy(handle *h) {
    if (h == NULL) return;
    int error;
    int64_t index;
    devshim_aio_wait(h, &error, &index);
    pthread_mutex_lock(&h->lock);
    h->stop = 1;
    pthread_cond_broadcast(&h->work);
    pthread_mutex_unlock(&h->lock);
    for (int i = 0; i < h->started; ++i) pthread_join(h->workers[i], NULL);
    pthread_mutex_destroy(&h->lock);
    pthread_cond_destroy(&h->work);
    pthread_cond_destroy(&h->done);
    free(h->workers);
    free(h);
}
