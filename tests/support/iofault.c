/* iofault: an LD_PRELOAD shim that counts, logs and fails the real file-system calls
 * a process makes under one directory.
 *
 * It wraps the libc entry points that Python, torch and libstdc++ call for file
 * I/O (open/openat/creat/fopen, write/pwrite/writev/fwrite, read/pread/readv,
 * fsync/fdatasync/fflush, rename/link/unlink/mkdir/rmdir, ftruncate, close,
 * sendfile/copy_file_range). A call is *watched* when its path lies under the
 * armed directory, or when its descriptor was opened under it. Every watched
 * call gets the next number 1, 2, ...; the call numbered FAIL_AT fails with
 * ERRNO instead of running (close and fclose still release the descriptor, as
 * the kernel does when close reports an error), and with PERSISTENT=1 so does
 * every watched call after it. FAIL_AT = 0 only counts.
 *
 * Arming: at start from the environment (IOFAULT_DIR, IOFAULT_FAIL_AT,
 * IOFAULT_ERRNO, IOFAULT_PERSISTENT, IOFAULT_LOG; IOFAULT_REPORT=1 prints the
 * count at exit), or at any time through iofault_arm() and
 * iofault_disarm(), which a test calls with ctypes, so that one process runs
 * many cases. With a log path, every watched call appends one line:
 *
 *     seq <TAB> op <TAB> ino <TAB> path <TAB> path2 <TAB> offset <TAB> size <TAB> result
 *
 * (ino: the inode the call acted on, 0 when unknown; offset -1 when not
 * applicable). That log is what the crash-state test replays.
 *
 * Single file, no dependencies beyond libc and libdl: gcc -shared -fPIC -O2 -o x.so iofault.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_FDS 65536

static char g_dir[PATH_MAX];
static size_t g_dirlen;
static volatile int g_armed;
static long g_fail_at;
static long long g_match_offset = -1; /* iofault_match: fail the write at this offset... */
static long long g_match_size = -1;   /* ...of this size (-1: numbered calls instead) */
static int g_match_hit;
static int g_persistent;
static int g_errno;
static long g_count;
static int g_log_fd = -1;
static unsigned char g_watched[MAX_FDS];
static char g_failed_op[PATH_MAX + 64];
static pthread_mutex_t g_log_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int t_busy; /* this thread is inside the shim: its own calls pass through */

#define REAL(name) real_##name
#define DECLARE_REAL(ret, name, ...)                                       \
    static ret (*real_##name)(__VA_ARGS__);                                \
    static void load_##name(void) {                                        \
        if (!real_##name) real_##name = (ret(*)(__VA_ARGS__))dlsym(RTLD_NEXT, #name); \
    }

DECLARE_REAL(int, open, const char *, int, ...)
DECLARE_REAL(int, open64, const char *, int, ...)
DECLARE_REAL(int, openat, int, const char *, int, ...)
DECLARE_REAL(int, openat64, int, const char *, int, ...)
DECLARE_REAL(int, __open_2, const char *, int)
DECLARE_REAL(int, __open64_2, const char *, int)
DECLARE_REAL(int, __openat_2, int, const char *, int)
DECLARE_REAL(int, __openat64_2, int, const char *, int)
DECLARE_REAL(int, creat, const char *, mode_t)
DECLARE_REAL(int, creat64, const char *, mode_t)
DECLARE_REAL(FILE *, fopen, const char *, const char *)
DECLARE_REAL(FILE *, fopen64, const char *, const char *)
DECLARE_REAL(ssize_t, write, int, const void *, size_t)
DECLARE_REAL(ssize_t, pwrite, int, const void *, size_t, off_t)
DECLARE_REAL(ssize_t, pwrite64, int, const void *, size_t, off_t)
DECLARE_REAL(ssize_t, writev, int, const struct iovec *, int)
DECLARE_REAL(ssize_t, pwritev, int, const struct iovec *, int, off_t)
DECLARE_REAL(ssize_t, pwritev64, int, const struct iovec *, int, off_t)
DECLARE_REAL(ssize_t, read, int, void *, size_t)
DECLARE_REAL(ssize_t, pread, int, void *, size_t, off_t)
DECLARE_REAL(ssize_t, pread64, int, void *, size_t, off_t)
DECLARE_REAL(ssize_t, readv, int, const struct iovec *, int)
DECLARE_REAL(size_t, fwrite, const void *, size_t, size_t, FILE *)
DECLARE_REAL(int, fflush, FILE *)
DECLARE_REAL(int, fclose, FILE *)
DECLARE_REAL(int, fsync, int)
DECLARE_REAL(int, fdatasync, int)
DECLARE_REAL(int, close, int)
DECLARE_REAL(int, ftruncate, int, off_t)
DECLARE_REAL(int, ftruncate64, int, off_t)
DECLARE_REAL(int, rename, const char *, const char *)
DECLARE_REAL(int, renameat, int, const char *, int, const char *)
DECLARE_REAL(int, renameat2, int, const char *, int, const char *, unsigned int)
DECLARE_REAL(int, link, const char *, const char *)
DECLARE_REAL(int, linkat, int, const char *, int, const char *, int)
DECLARE_REAL(int, unlink, const char *)
DECLARE_REAL(int, unlinkat, int, const char *, int)
DECLARE_REAL(int, mkdir, const char *, mode_t)
DECLARE_REAL(int, mkdirat, int, const char *, mode_t)
DECLARE_REAL(int, rmdir, const char *)
DECLARE_REAL(ssize_t, sendfile, int, int, off_t *, size_t)
DECLARE_REAL(ssize_t, sendfile64, int, int, off_t *, size_t)
DECLARE_REAL(ssize_t, copy_file_range, int, off_t *, int, off_t *, size_t, unsigned int)

/* ------------------------------------------------------------------ control (ctypes) */

/* Watch calls under `dir` (an absolute path), fail the call numbered `fail_at` (0: none)
 * with `err` (and, when `persistent`, every call after it: a disk that stays full), and
 * append the log to `log_path` (NULL or "": no log). Resets the count. */
int iofault_arm(const char *dir, long fail_at, int err, const char *log_path, int persistent) {
    t_busy++;
    pthread_mutex_lock(&g_log_lock);
    g_armed = 0;
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/') n--;
    if (n >= sizeof g_dir) n = sizeof g_dir - 1;
    memcpy(g_dir, dir, n);
    g_dir[n] = 0;
    g_dirlen = n;
    __atomic_store_n(&g_count, 0, __ATOMIC_SEQ_CST);
    g_fail_at = fail_at;
    g_match_offset = g_match_size = -1;
    g_match_hit = 0;
    g_persistent = persistent;
    g_errno = err;
    g_failed_op[0] = 0;
    memset(g_watched, 0, sizeof g_watched);
    if (g_log_fd >= 0) {
        load_close();
        REAL(close)(g_log_fd);
        g_log_fd = -1;
    }
    int rc = 0;
    if (log_path && *log_path) {
        load_open();
        g_log_fd = REAL(open)(log_path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
        if (g_log_fd < 0) rc = -1;
    }
    g_armed = 1;
    pthread_mutex_unlock(&g_log_lock);
    t_busy--;
    return rc;
}

/* After iofault_arm: fail the first watched write of `size` bytes at `offset` instead of
 * call number `fail_at` (and every later call, when armed `persistent`): the same call
 * whichever thread makes it, and whatever other threads do meanwhile. */
int iofault_match(long long offset, long long size) {
    t_busy++;
    pthread_mutex_lock(&g_log_lock);
    g_match_offset = offset;
    g_match_size = size;
    g_match_hit = 0;
    pthread_mutex_unlock(&g_log_lock);
    t_busy--;
    return 0;
}

/* Stop watching; returns how many watched calls were made since iofault_arm. */
long iofault_disarm(void) {
    t_busy++;
    pthread_mutex_lock(&g_log_lock);
    g_armed = 0;
    if (g_log_fd >= 0) {
        load_close();
        REAL(close)(g_log_fd);
        g_log_fd = -1;
    }
    pthread_mutex_unlock(&g_log_lock);
    t_busy--;
    return __atomic_load_n(&g_count, __ATOMIC_SEQ_CST);
}

long iofault_count(void) { return __atomic_load_n(&g_count, __ATOMIC_SEQ_CST); }

/* "op path" of the call that was made to fail, "" when none was. */
const char *iofault_failed_op(void) { return g_failed_op; }

/* ------------------------------------------------------------------ bookkeeping */

static int under_dir(const char *path) {
    if (!path || !g_dirlen) return 0;
    if (strncmp(path, g_dir, g_dirlen) != 0) return 0;
    return path[g_dirlen] == 0 || path[g_dirlen] == '/';
}

/* The absolute path of `path` relative to `dirfd`, into buf (best effort, not normalised). */
static const char *resolve_at(int dirfd, const char *path, char *buf, size_t size) {
    if (!path) return NULL;
    if (path[0] == '/') return path;
    char base[PATH_MAX];
    if (dirfd == AT_FDCWD) {
        if (!getcwd(base, sizeof base)) return path;
    } else {
        char link[64];
        snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
        ssize_t n = readlink(link, base, sizeof base - 1);
        if (n < 0) return path;
        base[n] = 0;
    }
    size_t nb = strlen(base), np = strlen(path);
    if (nb + 1 + np + 1 > size) return path; /* too long to watch: passes through */
    memcpy(buf, base, nb);
    buf[nb] = '/';
    memcpy(buf + nb + 1, path, np + 1);
    return buf;
}

static int fd_watched(int fd) { return g_armed && fd >= 0 && fd < MAX_FDS && g_watched[fd]; }

static void watch_fd(int fd, int on) {
    if (fd >= 0 && fd < MAX_FDS) g_watched[fd] = (unsigned char)on;
}

static void fd_path(int fd, char *buf, size_t size) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, buf, size - 1);
    buf[n < 0 ? 0 : n] = 0;
}

static unsigned long fd_ino(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 ? (unsigned long)st.st_ino : 0;
}

static unsigned long path_ino(const char *path) {
    struct stat st;
    return path && lstat(path, &st) == 0 ? (unsigned long)st.st_ino : 0;
}

/* Number this watched call (a write's `offset` and `size`, else -1); returns nonzero when
 * it is the one to fail. */
static int next_call(const char *op, const char *path, long long offset, long long size) {
    long n = __atomic_add_fetch(&g_count, 1, __ATOMIC_SEQ_CST);
    if (g_match_offset >= 0) {
        if (strcmp(op, "write") == 0 && offset == g_match_offset && size == g_match_size
            && __atomic_exchange_n(&g_match_hit, 1, __ATOMIC_SEQ_CST) == 0) {
            snprintf(g_failed_op, sizeof g_failed_op, "%s %s", op, path ? path : "?");
            return 1;
        }
        return g_persistent && __atomic_load_n(&g_match_hit, __ATOMIC_SEQ_CST);
    }
    if (g_fail_at > 0 && n == g_fail_at) {
        snprintf(g_failed_op, sizeof g_failed_op, "%s %s", op, path ? path : "?");
        return 1;
    }
    return g_persistent && g_fail_at > 0 && n > g_fail_at;
}

static void log_call(const char *op, unsigned long ino, const char *path, const char *path2,
                     long long offset, long long size, long long result) {
    if (g_log_fd < 0) return;
    char line[3 * PATH_MAX];
    pthread_mutex_lock(&g_log_lock);
    int len = snprintf(line, sizeof line, "%ld\t%s\t%lu\t%s\t%s\t%lld\t%lld\t%lld\n",
                       __atomic_load_n(&g_count, __ATOMIC_SEQ_CST), op, ino, path ? path : "",
                       path2 ? path2 : "", offset, size, result);
    if (g_log_fd >= 0 && len > 0) {
        load_write();
        ssize_t unused = REAL(write)(g_log_fd, line, (size_t)(len < (int)sizeof line ? len : (int)sizeof line - 1));
        (void)unused;
    }
    pthread_mutex_unlock(&g_log_lock);
}

/* ------------------------------------------------------------------ opening */

static int opened(const char *op, const char *abspath, int fd) {
    if (fd >= 0) {
        watch_fd(fd, 1);
        if (g_log_fd >= 0) log_call(op, fd_ino(fd), abspath, NULL, -1, -1, fd);
    } else if (g_log_fd >= 0) {
        log_call(op, 0, abspath, NULL, -1, -1, -1);
    }
    return fd;
}

#define OPEN_BODY(realcall, dirfd, path, opname)                                   \
    char buf_[PATH_MAX];                                                           \
    const char *abs_ = (g_armed && !t_busy) ? resolve_at(dirfd, path, buf_, sizeof buf_) : NULL; \
    if (abs_ && under_dir(abs_)) {                                                 \
        t_busy++;                                                                  \
        if (next_call(opname, abs_, -1, -1)) {                                     \
            t_busy--;                                                              \
            errno = g_errno;                                                       \
            return -1;                                                             \
        }                                                                          \
        int fd_ = realcall;                                                        \
        int saved_ = errno;                                                        \
        opened(opname, abs_, fd_);                                                 \
        t_busy--;                                                                  \
        errno = saved_;                                                            \
        return fd_;                                                                \
    }                                                                              \
    return realcall;

static mode_t mode_arg(int flags, va_list ap) {
    return (flags & (O_CREAT | O_TMPFILE)) ? (mode_t)va_arg(ap, int) : 0;
}

int open(const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    load_open();
    OPEN_BODY(REAL(open)(path, flags, mode), AT_FDCWD, path, "open")
}

int open64(const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    load_open64();
    OPEN_BODY(REAL(open64)(path, flags, mode), AT_FDCWD, path, "open")
}

int openat(int dirfd, const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    load_openat();
    OPEN_BODY(REAL(openat)(dirfd, path, flags, mode), dirfd, path, "open")
}

int openat64(int dirfd, const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    load_openat64();
    OPEN_BODY(REAL(openat64)(dirfd, path, flags, mode), dirfd, path, "open")
}

int __open_2(const char *path, int flags) {
    load___open_2();
    OPEN_BODY(REAL(__open_2)(path, flags), AT_FDCWD, path, "open")
}

int __open64_2(const char *path, int flags) {
    load___open64_2();
    OPEN_BODY(REAL(__open64_2)(path, flags), AT_FDCWD, path, "open")
}

int __openat_2(int dirfd, const char *path, int flags) {
    load___openat_2();
    OPEN_BODY(REAL(__openat_2)(dirfd, path, flags), dirfd, path, "open")
}

int __openat64_2(int dirfd, const char *path, int flags) {
    load___openat64_2();
    OPEN_BODY(REAL(__openat64_2)(dirfd, path, flags), dirfd, path, "open")
}

int creat(const char *path, mode_t mode) {
    load_creat();
    OPEN_BODY(REAL(creat)(path, mode), AT_FDCWD, path, "open")
}

int creat64(const char *path, mode_t mode) {
    load_creat64();
    OPEN_BODY(REAL(creat64)(path, mode), AT_FDCWD, path, "open")
}

#define FOPEN_BODY(realfn, path, mode)                                             \
    char buf_[PATH_MAX];                                                           \
    const char *abs_ = (g_armed && !t_busy) ? resolve_at(AT_FDCWD, path, buf_, sizeof buf_) : NULL; \
    if (abs_ && under_dir(abs_)) {                                                 \
        t_busy++;                                                                  \
        if (next_call("open", abs_, -1, -1)) {                                     \
            t_busy--;                                                              \
            errno = g_errno;                                                       \
            return NULL;                                                           \
        }                                                                          \
        FILE *f_ = realfn(path, mode);                                             \
        int saved_ = errno;                                                        \
        opened("open", abs_, f_ ? fileno(f_) : -1);                                \
        t_busy--;                                                                  \
        errno = saved_;                                                            \
        return f_;                                                                 \
    }                                                                              \
    return realfn(path, mode);

FILE *fopen(const char *path, const char *mode) {
    load_fopen();
    FOPEN_BODY(REAL(fopen), path, mode)
}

FILE *fopen64(const char *path, const char *mode) {
    load_fopen64();
    FOPEN_BODY(REAL(fopen64), path, mode)
}

/* ------------------------------------------------------------------ descriptor calls */

/* Run `call` on a watched descriptor: number it, fail it when its turn comes, log it. */
#define FD_BODY(type, fd, opname, offset_expr, size_expr, call, fail_value)       \
    if (!fd_watched(fd) || t_busy) return call;                                    \
    t_busy++;                                                                      \
    char path_[PATH_MAX];                                                          \
    fd_path(fd, path_, sizeof path_);                                              \
    long long off_ = (offset_expr);                                                \
    if (next_call(opname, path_, off_, (long long)(size_expr))) {                  \
        if (g_log_fd >= 0) log_call(opname "!", fd_ino(fd), path_, NULL, off_, (long long)(size_expr), -1); \
        t_busy--;                                                                  \
        errno = g_errno;                                                           \
        return fail_value;                                                         \
    }                                                                              \
    type r_ = call;                                                                \
    int saved_ = errno;                                                            \
    if (g_log_fd >= 0) log_call(opname, fd_ino(fd), path_, NULL, off_, (long long)(size_expr), (long long)r_); \
    t_busy--;                                                                      \
    errno = saved_;                                                                \
    return r_;

static long long cur_offset(int fd) {
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0 && (flags & O_APPEND)) {
        struct stat st;
        return fstat(fd, &st) == 0 ? (long long)st.st_size : -1;
    }
    return (long long)lseek(fd, 0, SEEK_CUR);
}

static size_t iov_size(const struct iovec *iov, int n) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += iov[i].iov_len;
    return total;
}

ssize_t write(int fd, const void *buf, size_t count) {
    load_write();
    FD_BODY(ssize_t, fd, "write", cur_offset(fd), count, REAL(write)(fd, buf, count), -1)
}

ssize_t pwrite(int fd, const void *buf, size_t count, off_t offset) {
    load_pwrite();
    FD_BODY(ssize_t, fd, "write", offset, count, REAL(pwrite)(fd, buf, count, offset), -1)
}

ssize_t pwrite64(int fd, const void *buf, size_t count, off_t offset) {
    load_pwrite64();
    FD_BODY(ssize_t, fd, "write", offset, count, REAL(pwrite64)(fd, buf, count, offset), -1)
}

ssize_t writev(int fd, const struct iovec *iov, int n) {
    load_writev();
    FD_BODY(ssize_t, fd, "write", cur_offset(fd), iov_size(iov, n), REAL(writev)(fd, iov, n), -1)
}

ssize_t pwritev(int fd, const struct iovec *iov, int n, off_t offset) {
    load_pwritev();
    FD_BODY(ssize_t, fd, "write", offset, iov_size(iov, n), REAL(pwritev)(fd, iov, n, offset), -1)
}

ssize_t pwritev64(int fd, const struct iovec *iov, int n, off_t offset) {
    load_pwritev64();
    FD_BODY(ssize_t, fd, "write", offset, iov_size(iov, n), REAL(pwritev64)(fd, iov, n, offset), -1)
}

ssize_t read(int fd, void *buf, size_t count) {
    load_read();
    FD_BODY(ssize_t, fd, "read", -1, count, REAL(read)(fd, buf, count), -1)
}

ssize_t pread(int fd, void *buf, size_t count, off_t offset) {
    load_pread();
    FD_BODY(ssize_t, fd, "read", offset, count, REAL(pread)(fd, buf, count, offset), -1)
}

ssize_t pread64(int fd, void *buf, size_t count, off_t offset) {
    load_pread64();
    FD_BODY(ssize_t, fd, "read", offset, count, REAL(pread64)(fd, buf, count, offset), -1)
}

ssize_t readv(int fd, const struct iovec *iov, int n) {
    load_readv();
    FD_BODY(ssize_t, fd, "read", -1, iov_size(iov, n), REAL(readv)(fd, iov, n), -1)
}

int fsync(int fd) {
    load_fsync();
    FD_BODY(int, fd, "fsync", -1, 0, REAL(fsync)(fd), -1)
}

int fdatasync(int fd) {
    load_fdatasync();
    FD_BODY(int, fd, "fsync", -1, 0, REAL(fdatasync)(fd), -1)
}

int ftruncate(int fd, off_t length) {
    load_ftruncate();
    FD_BODY(int, fd, "truncate", length, 0, REAL(ftruncate)(fd, length), -1)
}

int ftruncate64(int fd, off_t length) {
    load_ftruncate64();
    FD_BODY(int, fd, "truncate", length, 0, REAL(ftruncate64)(fd, length), -1)
}

/* The kernel releases a descriptor even when close reports an error: so does the shim. */
static int close_failing(int fd) {
    REAL(close)(fd);
    return -1;
}

int close(int fd) {
    load_close();
    if (!fd_watched(fd) || t_busy) {
        watch_fd(fd, 0);
        return REAL(close)(fd);
    }
    t_busy++;
    char path_[PATH_MAX];
    fd_path(fd, path_, sizeof path_);
    unsigned long ino = fd_ino(fd);
    watch_fd(fd, 0);
    if (next_call("close", path_, -1, -1)) {
        if (g_log_fd >= 0) log_call("close!", ino, path_, NULL, -1, 0, -1);
        close_failing(fd);
        t_busy--;
        errno = g_errno;
        return -1;
    }
    int r = REAL(close)(fd);
    int saved = errno;
    if (g_log_fd >= 0) log_call("close", ino, path_, NULL, -1, 0, r);
    t_busy--;
    errno = saved;
    return r;
}

/* ------------------------------------------------------------------ FILE* calls (libstdc++, C code) */

size_t fwrite(const void *ptr, size_t size, size_t n, FILE *stream) {
    load_fwrite();
    int fd = fileno(stream);
    FD_BODY(size_t, fd, "write", (long long)ftello(stream), size * n, REAL(fwrite)(ptr, size, n, stream), 0)
}

int fflush(FILE *stream) {
    load_fflush();
    int fd = stream ? fileno(stream) : -1;
    FD_BODY(int, fd, "flush", -1, 0, REAL(fflush)(stream), EOF)
}

/* fclose's argument is declared nonnull (glibc 2.38 and later), so a NULL test on
   it is a compile error under -Werror=nonnull-compare; this helper's is not. */
__attribute__((noinline)) static int fd_of_stream(FILE *stream) {
    return stream ? fileno(stream) : -1;
}

int fclose(FILE *stream) {
    load_fclose();
    int fd = fd_of_stream(stream);
    if (!fd_watched(fd) || t_busy) {
        watch_fd(fd, 0);
        return REAL(fclose)(stream);
    }
    t_busy++;
    char path_[PATH_MAX];
    fd_path(fd, path_, sizeof path_);
    unsigned long ino = fd_ino(fd);
    watch_fd(fd, 0);
    if (next_call("close", path_, -1, -1)) {
        if (g_log_fd >= 0) log_call("close!", ino, path_, NULL, -1, 0, -1);
        REAL(fclose)(stream);
        t_busy--;
        errno = g_errno;
        return EOF;
    }
    int r = REAL(fclose)(stream);
    int saved = errno;
    if (g_log_fd >= 0) log_call("close", ino, path_, NULL, -1, 0, r);
    t_busy--;
    errno = saved;
    return r;
}

/* ------------------------------------------------------------------ copies between descriptors */

ssize_t sendfile(int out_fd, int in_fd, off_t *offset, size_t count) {
    load_sendfile();
    int fd = fd_watched(out_fd) ? out_fd : in_fd;
    FD_BODY(ssize_t, fd, "copy", cur_offset(out_fd), count, REAL(sendfile)(out_fd, in_fd, offset, count), -1)
}

ssize_t sendfile64(int out_fd, int in_fd, off_t *offset, size_t count) {
    load_sendfile64();
    int fd = fd_watched(out_fd) ? out_fd : in_fd;
    FD_BODY(ssize_t, fd, "copy", cur_offset(out_fd), count, REAL(sendfile64)(out_fd, in_fd, offset, count), -1)
}

ssize_t copy_file_range(int in_fd, off_t *in_off, int out_fd, off_t *out_off, size_t len,
                        unsigned int flags) {
    load_copy_file_range();
    int fd = fd_watched(out_fd) ? out_fd : in_fd;
    FD_BODY(ssize_t, fd, "copy", out_off ? (long long)*out_off : cur_offset(out_fd), len,
            REAL(copy_file_range)(in_fd, in_off, out_fd, out_off, len, flags), -1)
}

/* ------------------------------------------------------------------ directory entries */

/* Run a path call: number it when either path is under the directory, fail it in turn, log it.
 * `ino_before` is taken before the call (the entry it removes or moves). */
#define PATH_BODY(opname, abs1, abs2, call)                                        \
    if (t_busy || !g_armed || !(under_dir(abs1) || under_dir(abs2))) return call;  \
    t_busy++;                                                                      \
    unsigned long ino_ = path_ino(abs1);                                           \
    if (next_call(opname, abs1, -1, -1)) {                                         \
        if (g_log_fd >= 0) log_call(opname "!", ino_, abs1, abs2, -1, -1, -1);     \
        t_busy--;                                                                  \
        errno = g_errno;                                                           \
        return -1;                                                                 \
    }                                                                              \
    int r_ = call;                                                                 \
    int saved_ = errno;                                                            \
    if (g_log_fd >= 0) {                                                           \
        if (!ino_) ino_ = path_ino(abs1);                                          \
        log_call(opname, ino_, abs1, abs2, -1, -1, r_);                            \
    }                                                                              \
    t_busy--;                                                                      \
    errno = saved_;                                                                \
    return r_;

#define ABS(var, dirfd, path)                                                      \
    char var##_buf[PATH_MAX];                                                      \
    const char *var = (g_armed && !t_busy) ? resolve_at(dirfd, path, var##_buf, sizeof var##_buf) : NULL;

int rename(const char *old, const char *new) {
    load_rename();
    ABS(a, AT_FDCWD, old) ABS(b, AT_FDCWD, new)
    PATH_BODY("rename", a, b, REAL(rename)(old, new))
}

int renameat(int olddir, const char *old, int newdir, const char *new) {
    load_renameat();
    ABS(a, olddir, old) ABS(b, newdir, new)
    PATH_BODY("rename", a, b, REAL(renameat)(olddir, old, newdir, new))
}

int renameat2(int olddir, const char *old, int newdir, const char *new, unsigned int flags) {
    load_renameat2();
    ABS(a, olddir, old) ABS(b, newdir, new)
    PATH_BODY("rename", a, b, REAL(renameat2)(olddir, old, newdir, new, flags))
}

int link(const char *old, const char *new) {
    load_link();
    ABS(a, AT_FDCWD, old) ABS(b, AT_FDCWD, new)
    PATH_BODY("link", a, b, REAL(link)(old, new))
}

int linkat(int olddir, const char *old, int newdir, const char *new, int flags) {
    load_linkat();
    ABS(a, olddir, old) ABS(b, newdir, new)
    PATH_BODY("link", a, b, REAL(linkat)(olddir, old, newdir, new, flags))
}

int unlink(const char *path) {
    load_unlink();
    ABS(a, AT_FDCWD, path)
    PATH_BODY("unlink", a, (const char *)NULL, REAL(unlink)(path))
}

int unlinkat(int dirfd, const char *path, int flags) {
    load_unlinkat();
    ABS(a, dirfd, path)
    if (flags & AT_REMOVEDIR) {
        PATH_BODY("rmdir", a, (const char *)NULL, REAL(unlinkat)(dirfd, path, flags))
    }
    PATH_BODY("unlink", a, (const char *)NULL, REAL(unlinkat)(dirfd, path, flags))
}

int rmdir(const char *path) {
    load_rmdir();
    ABS(a, AT_FDCWD, path)
    PATH_BODY("rmdir", a, (const char *)NULL, REAL(rmdir)(path))
}

int mkdir(const char *path, mode_t mode) {
    load_mkdir();
    ABS(a, AT_FDCWD, path)
    PATH_BODY("mkdir", a, (const char *)NULL, REAL(mkdir)(path, mode))
}

int mkdirat(int dirfd, const char *path, mode_t mode) {
    load_mkdirat();
    ABS(a, dirfd, path)
    PATH_BODY("mkdir", a, (const char *)NULL, REAL(mkdirat)(dirfd, path, mode))
}

/* ------------------------------------------------------------------ arming from the environment */

static void report_at_exit(void) {
    const char *report = getenv("IOFAULT_REPORT");
    if (report && *report && g_armed) {
        char line[PATH_MAX + 128];
        int len = snprintf(line, sizeof line, "iofault: %ld calls under %s; failed: %s\n",
                           iofault_count(), g_dir, g_failed_op[0] ? g_failed_op : "none");
        load_write();
        ssize_t unused = REAL(write)(2, line, (size_t)len);
        (void)unused;
    }
}

__attribute__((constructor)) static void iofault_init(void) {
    const char *dir = getenv("IOFAULT_DIR");
    if (dir && *dir) {
        const char *at = getenv("IOFAULT_FAIL_AT");
        const char *err = getenv("IOFAULT_ERRNO");
        const char *persistent = getenv("IOFAULT_PERSISTENT");
        iofault_arm(dir, at ? atol(at) : 0, err ? atoi(err) : EIO, getenv("IOFAULT_LOG"),
                    persistent && *persistent == '1');
    }
    atexit(report_at_exit);
}
