/* A persistent pool of worker threads for the kernels: lm_pool_run(fn, arg, n) runs fn(arg, i, n)
 * for i = 0..n-1, part 0 on the caller, and returns when all have finished.
 *
 * A decode step calls the kernels a few hundred times, so starting threads per call (about 15
 * microseconds each) would cost milliseconds a step. Workers wait for the next call spinning
 * for a short while (kernels of one step follow each other closely), then sleeping on a
 * condition variable, so an idle engine burns no CPU. Calls are serialized (one engine thread
 * at a time); a child process after fork() starts its own workers. */

#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "localllm_native.h"

#define SPIN_NS 50000 /* how long an idle worker spins before it sleeps */

static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int n_workers;      /* started so far */
static int generation;     /* bumped per call (atomic) */
static int remaining;      /* worker parts not yet finished (atomic) */
static lm_task_fn task;
static void *task_arg;
static int task_parts;
static int atfork_set;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int start_generation[LM_MAX_THREADS]; /* the generation before each worker's first call */

static void *worker(void *p) {
    const int index = (int)(intptr_t)p; /* 1-based: part 0 is the caller's */
    /* Not the generation now: the caller may have announced its call before this thread ran. */
    int seen = start_generation[index];
    for (;;) {
        int g = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
        if (g == seen) {
            const int64_t until = now_ns() + SPIN_NS;
            int spins = 0;
            while ((g = __atomic_load_n(&generation, __ATOMIC_ACQUIRE)) == seen) {
                cpu_relax();
                if (++spins % 64 == 0 && now_ns() > until) break;
            }
            if (g == seen) {
                pthread_mutex_lock(&mu);
                while ((g = __atomic_load_n(&generation, __ATOMIC_ACQUIRE)) == seen) pthread_cond_wait(&cv, &mu);
                pthread_mutex_unlock(&mu);
            }
        }
        seen = g;
        if (index < task_parts) task(task_arg, index, task_parts);
        __atomic_sub_fetch(&remaining, 1, __ATOMIC_ACQ_REL);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    /* The workers did not come along; the child starts its own when it needs them. */
    n_workers = 0;
    pthread_mutex_init(&call_mu, NULL);
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&cv, NULL);
}

/* Where torch runs on OpenMP, its threads do the work instead (lm_pool_use_openmp): torch's
 * own workers spin for a while after each of its operations, so a second set of threads would
 * find the cores taken and run at a fraction of their speed. */
typedef void (*gomp_parallel_fn)(void (*body)(void *), void *data, unsigned num_threads, unsigned flags);
typedef int (*omp_int_fn)(void);
static gomp_parallel_fn gomp_parallel;
static omp_int_fn omp_thread_num, omp_num_threads;

void lm_pool_use_openmp(void *parallel, void *thread_num, void *num_threads) {
    gomp_parallel = (gomp_parallel_fn)parallel;
    omp_thread_num = (omp_int_fn)thread_num;
    omp_num_threads = (omp_int_fn)num_threads;
}

typedef struct {
    lm_task_fn fn;
    void *arg;
    int parts;
} omp_call_t;

static void omp_body(void *p) {
    const omp_call_t *c = (const omp_call_t *)p;
    const int n = omp_num_threads();
    for (int part = omp_thread_num(); part < c->parts; part += n) c->fn(c->arg, part, c->parts);
}

void lm_pool_run(lm_task_fn fn, void *arg, int n) {
    if (n > LM_MAX_THREADS) n = LM_MAX_THREADS;
    if (n <= 1) {
        fn(arg, 0, 1);
        return;
    }
    if (gomp_parallel != NULL) {
        omp_call_t c = {fn, arg, n};
        gomp_parallel(omp_body, &c, (unsigned)n, 0);
        return;
    }
    pthread_mutex_lock(&call_mu);
    if (!atfork_set) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        atfork_set = 1;
    }
    while (n_workers < n - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        start_generation[n_workers + 1] = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
        const int ok = pthread_create(&t, &attr, worker, (void *)(intptr_t)(n_workers + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        n_workers++;
    }
    if (n > n_workers + 1) n = n_workers + 1;
    task = fn;
    task_arg = arg;
    task_parts = n;
    /* Every worker takes part in every call (those past n do nothing), so the generation
     * each one has seen stays in step. */
    __atomic_store_n(&remaining, n_workers, __ATOMIC_RELEASE);
    pthread_mutex_lock(&mu);
    __atomic_add_fetch(&generation, 1, __ATOMIC_ACQ_REL);
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    fn(arg, 0, n);
    while (__atomic_load_n(&remaining, __ATOMIC_ACQUIRE) > 0) cpu_relax();
    pthread_mutex_unlock(&call_mu);
}
