/* LD_PRELOAD shim: shift the process's wall clock by $AWA_FAST_CLOCK_SHIFT_S seconds.
 *
 * A stand-in for libfaketime in the clock-skew chaos scenario
 * (tests/chaos/test_clock_skew.py compiles it with `cc -shared -fPIC`).
 * Overrides clock_gettime (only CLOCK_REALTIME and CLOCK_REALTIME_COARSE are
 * shifted; every other clock id, e.g. CLOCK_MONOTONIC or CLOCK_TAI, passes
 * through unchanged), gettimeofday and time. The shift is a float, may be
 * negative, and is read once; unset or unparsable means no shift.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

#define NS 1000000000LL

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);
typedef int (*gettimeofday_fn)(struct timeval *, void *);

static clock_gettime_fn real_clock_gettime;
static gettimeofday_fn real_gettimeofday;
static int64_t shift_ns;
static int ready;

/* Idempotent: concurrent first calls compute the same values. */
static void init(void) {
    if (__atomic_load_n(&ready, __ATOMIC_ACQUIRE))
        return;
    real_clock_gettime = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
    real_gettimeofday = (gettimeofday_fn)dlsym(RTLD_NEXT, "gettimeofday");
    const char *s = getenv("AWA_FAST_CLOCK_SHIFT_S");
    int64_t ns = 0;
    if (s != NULL && *s != '\0') {
        char *end;
        double v = strtod(s, &end);
        if (*end == '\0' && v > -1e9 && v < 1e9) /* also rejects NaN */
            ns = (int64_t)(v * 1e9 + (v < 0 ? -0.5 : 0.5));
    }
    shift_ns = ns;
    __atomic_store_n(&ready, 1, __ATOMIC_RELEASE);
}

__attribute__((constructor)) static void clock_shift_init(void) { init(); }

/* The headers declare tv nonnull, so a plain `tv != NULL` would be folded away;
 * gettimeofday(NULL, tz) is valid on Linux. */
static int not_null(const void *p) {
    const void *volatile q = p;
    return q != NULL;
}

/* sec/sub (sub in [0, unit)) plus shift_ns, normalised; unit is 1e9 (ns) or 1e6 (us). */
static void add_shift(int64_t *sec, int64_t *sub, int64_t unit) {
    int64_t per = NS / unit; /* ns per sub-unit */
    int64_t sh = shift_ns / per;
    *sec += sh / unit;
    *sub += sh % unit;
    if (*sub < 0) {
        *sub += unit;
        *sec -= 1;
    } else if (*sub >= unit) {
        *sub -= unit;
        *sec += 1;
    }
}

int clock_gettime(clockid_t clk, struct timespec *tp) {
    init();
    if (real_clock_gettime == NULL) {
        errno = ENOSYS;
        return -1;
    }
    int rc = real_clock_gettime(clk, tp); /* tp == NULL: EFAULT */
    if (rc == 0 && (clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE)) {
        int64_t sec = tp->tv_sec, nsec = tp->tv_nsec;
        add_shift(&sec, &nsec, NS);
        tp->tv_sec = (time_t)sec;
        tp->tv_nsec = (long)nsec;
    }
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    init();
    if (real_gettimeofday == NULL) {
        errno = ENOSYS;
        return -1;
    }
    int rc = real_gettimeofday(tv, tz);
    if (rc == 0 && not_null(tv)) {
        int64_t sec = tv->tv_sec, usec = tv->tv_usec;
        add_shift(&sec, &usec, 1000000);
        tv->tv_sec = (time_t)sec;
        tv->tv_usec = (suseconds_t)usec;
    }
    return rc;
}

time_t time(time_t *out) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return (time_t)-1;
    if (out != NULL)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
