/* A persistent pool of worker threads for the kernels: lm_pool_run(fn, arg, parts, threads) runs
 * fn(arg, i, parts) for i = 0..parts-1 on at most `threads` threads, the caller one of them, and
 * returns when all parts have finished.
 *
 * A decode step calls the kernels a few hundred times, so starting threads per call (about 15
 * microseconds each) would cost milliseconds a step. Workers wait for the next call spinning
 * for a short while (kernels of one step follow each other closely), then sleeping on a
 * condition variable, so an idle engine burns no CPU. Calls are serialized (one engine thread
 * at a time); a child process after fork() starts its own workers.
 *
 * A laptop is never idle, and a thread of ours may sit descheduled behind another program for
 * a scheduler slice (milliseconds). So no part belongs to a thread: the caller and the workers
 * claim parts one at a time (kernels cut their work into a few parts a thread,
 * lm_pool_parts), the caller does the parts a late worker has not claimed, and a call ends when
 * its parts are done, whichever threads did them; a worker that woke too late finds none
 * left. Waiting for the last part, the caller spins a moment and then sleeps, giving its CPU to
 * the thread it waits for. Which thread ran a part changes no result: each part writes its own
 * rows. */

#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "localllm_native.h"

#define SPIN_NS 50000      /* how long an idle worker spins for the next call before it sleeps */
#define WAIT_SPIN_NS 20000 /* how long the caller spins for the last parts before it sleeps */
#define PARTS_A_THREAD 4   /* lm_pool_parts: parts a thread, so a late thread holds back a fourth of its share */
#define MAX_PARTS 0xffff

static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
/* Each worker sleeps on its own, so that a call on fewer threads wakes none of the others. */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int asleep; /* atomic */
} sleeper[LM_MAX_THREADS];
static pthread_mutex_t done_mu = PTHREAD_MUTEX_INITIALIZER; /* the caller's sleep */
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static int n_workers;  /* started so far */
static int generation; /* bumped per call (atomic): wakes the workers */
/* The call's claims (atomic): its generation (32 bits), its parts (16) and the next part to
 * claim (16) in one word, so that a claim is of the call it read, never of the next one. */
static uint64_t claims;
static int done;           /* parts of the call in progress finished (atomic) */
static int caller_asleep;  /* the caller sleeps on done_cv (atomic) */
static int call_threads;   /* the threads the call in progress may run on */
static lm_task_fn task;
static void *task_arg;
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

int lm_pool_parts(int units, int threads) {
    if (threads <= 1 || units <= 1) return 1;
    const int64_t parts = (int64_t)threads * PARTS_A_THREAD;
    return (int)(parts < units ? (parts < MAX_PARTS ? parts : MAX_PARTS) : units);
}

/* Claims and runs the parts of call `gen` until none is left; every part finished counts. */
static void run_parts(uint32_t gen) {
    uint64_t c = __atomic_load_n(&claims, __ATOMIC_ACQUIRE);
    for (;;) {
        const uint32_t parts = (uint32_t)(c >> 16) & MAX_PARTS, next = (uint32_t)c & MAX_PARTS;
        if ((uint32_t)(c >> 32) != gen || next >= parts) return;
        if (!__atomic_compare_exchange_n(&claims, &c, c + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
        /* Part `next` of call gen is ours, so the call cannot end (nor the next one start and
         * change task) before it is done. */
        task(task_arg, (int)next, (int)parts);
        if (__atomic_add_fetch(&done, 1, __ATOMIC_SEQ_CST) == (int)parts && __atomic_load_n(&caller_asleep, __ATOMIC_SEQ_CST)) {
            pthread_mutex_lock(&done_mu);
            pthread_cond_signal(&done_cv);
            pthread_mutex_unlock(&done_mu);
        }
        c = __atomic_load_n(&claims, __ATOMIC_ACQUIRE);
    }
}

static int start_generation[LM_MAX_THREADS]; /* the generation before each worker's first call */

static void *worker(void *p) {
    const int index = (int)(intptr_t)p; /* 1-based: the caller is 0 */
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
                pthread_mutex_lock(&sleeper[index].mu);
                __atomic_store_n(&sleeper[index].asleep, 1, __ATOMIC_SEQ_CST);
                while ((g = __atomic_load_n(&generation, __ATOMIC_SEQ_CST)) == seen)
                    pthread_cond_wait(&sleeper[index].cv, &sleeper[index].mu);
                __atomic_store_n(&sleeper[index].asleep, 0, __ATOMIC_RELAXED);
                pthread_mutex_unlock(&sleeper[index].mu);
            }
        }
        seen = g;
        /* A call on fewer threads leaves the rest out (a stale count only costs a failed claim). */
        if (index < __atomic_load_n(&call_threads, __ATOMIC_RELAXED)) run_parts((uint32_t)g);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    /* The workers did not come along; the child starts its own when it needs them. */
    n_workers = 0;
    pthread_mutex_init(&call_mu, NULL);
    pthread_mutex_init(&done_mu, NULL);
    pthread_cond_init(&done_cv, NULL);
}

void lm_pool_run(lm_task_fn fn, void *arg, int parts, int threads) {
    if (parts < 1) parts = 1;
    if (parts > MAX_PARTS) parts = MAX_PARTS; /* callers cut their work by lm_pool_parts */
    if (threads > parts) threads = parts;
    if (threads > LM_MAX_THREADS) threads = LM_MAX_THREADS;
    if (threads <= 1) {
        for (int i = 0; i < parts; i++) fn(arg, i, parts);
        return;
    }
    pthread_mutex_lock(&call_mu);
    if (!atfork_set) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        atfork_set = 1;
    }
    while (n_workers < threads - 1) {
        const int index = n_workers + 1;
        pthread_mutex_init(&sleeper[index].mu, NULL);
        pthread_cond_init(&sleeper[index].cv, NULL);
        sleeper[index].asleep = 0;
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        start_generation[index] = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
        const int ok = pthread_create(&t, &attr, worker, (void *)(intptr_t)index) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        n_workers++;
    }
    if (n_workers == 0) {
        pthread_mutex_unlock(&call_mu);
        for (int i = 0; i < parts; i++) fn(arg, i, parts);
        return;
    }
    task = fn;
    task_arg = arg;
    __atomic_store_n(&call_threads, threads, __ATOMIC_RELAXED);
    __atomic_store_n(&done, 0, __ATOMIC_RELAXED);
    const uint32_t gen = (uint32_t)__atomic_load_n(&generation, __ATOMIC_RELAXED) + 1;
    __atomic_store_n(&claims, (uint64_t)gen << 32 | (uint64_t)parts << 16, __ATOMIC_RELEASE);
    __atomic_store_n(&generation, (int)gen, __ATOMIC_SEQ_CST);
    for (int i = 1; i < threads && i <= n_workers; i++)
        if (__atomic_load_n(&sleeper[i].asleep, __ATOMIC_SEQ_CST)) {
            pthread_mutex_lock(&sleeper[i].mu);
            pthread_cond_signal(&sleeper[i].cv);
            pthread_mutex_unlock(&sleeper[i].mu);
        }
    run_parts(gen);
    if (__atomic_load_n(&done, __ATOMIC_ACQUIRE) < parts) {
        const int64_t until = now_ns() + WAIT_SPIN_NS;
        int spins = 0;
        while (__atomic_load_n(&done, __ATOMIC_ACQUIRE) < parts && (++spins % 64 != 0 || now_ns() < until)) cpu_relax();
        if (__atomic_load_n(&done, __ATOMIC_ACQUIRE) < parts) {
            pthread_mutex_lock(&done_mu);
            __atomic_store_n(&caller_asleep, 1, __ATOMIC_SEQ_CST);
            while (__atomic_load_n(&done, __ATOMIC_SEQ_CST) < parts) pthread_cond_wait(&done_cv, &done_mu);
            __atomic_store_n(&caller_asleep, 0, __ATOMIC_RELAXED);
            pthread_mutex_unlock(&done_mu);
        }
    }
    pthread_mutex_unlock(&call_mu);
}
