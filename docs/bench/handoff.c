/* What a handler thread's round trip is made of, on this machine: a futex hand-off between two
 * threads (the faulting thread sleeps, another runs and wakes it), with the second thread on
 * the same CPU or the other one; a bare system call; and process_vm_readv of 8 bytes of this
 * process (how a handler reads a faulting thread's CPU from its rseq area).
 *
 *     gcc -O2 -pthread -o handoff handoff.c && ./handoff 0 && ./handoff 1
 *
 * The argument is the CPU of the second thread; the first runs on CPU 0. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static atomic_int turn;
static const int N = 200000;
static int peer_cpu;

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static void fwait(atomic_int *a, int v) { syscall(SYS_futex, a, FUTEX_WAIT_PRIVATE, v, 0, 0, 0); }
static void fwake(atomic_int *a) { syscall(SYS_futex, a, FUTEX_WAKE_PRIVATE, 1, 0, 0, 0); }

static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    sched_setaffinity(0, sizeof s, &s);
}

static void *peer(void *unused) {
    (void)unused;
    pin(peer_cpu);
    for (int i = 0; i < N; i++) {
        while (atomic_load(&turn) != 1) fwait(&turn, 0);
        atomic_store(&turn, 0);
        fwake(&turn);
    }
    return 0;
}

int main(int argc, char **argv) {
    peer_cpu = argc > 1 ? atoi(argv[1]) : 0;
    pin(0);
    pthread_t t;
    pthread_create(&t, 0, peer, 0);
    double t0 = now_ns();
    for (int i = 0; i < N; i++) {
        atomic_store(&turn, 1);
        fwake(&turn);
        while (atomic_load(&turn) != 0) fwait(&turn, 1);
    }
    double t1 = now_ns();
    pthread_join(t, 0);
    printf("futex round trip, peer on CPU %d: %.2f us\n", peer_cpu, (t1 - t0) / N / 1000);
    t0 = now_ns();
    for (int i = 0; i < N; i++) syscall(SYS_getppid);
    t1 = now_ns();
    printf("system call (getppid): %.3f us\n", (t1 - t0) / N / 1000);
    long x = 5, y;
    struct iovec local = {&y, 8}, remote = {&x, 8};
    t0 = now_ns();
    for (int i = 0; i < N; i++) process_vm_readv(getpid(), &local, 1, &remote, 1, 0);
    t1 = now_ns();
    printf("process_vm_readv of 8 bytes: %.3f us\n", (t1 - t0) / N / 1000);
    return 0;
}
