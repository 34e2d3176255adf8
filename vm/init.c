/*
 * init for memtide's test guest: a static program that is the whole of the guest's user
 * space. It fills most of the guest's RAM with a pattern, reads it back, reports on the
 * serial console, optionally frees the memory and waits for free page reporting (virtio-
 * balloon) to hand it back to the host, and powers the guest off.
 *
 * Settings arrive as kernel command-line words, which the kernel passes to init as
 * environment variables: fill_mib=N (default: 75% of RAM), rounds=N (passes over the memory,
 * default 2), balloon=1 (load the virtio-balloon driver and free the memory at the end),
 * settle=S (seconds to wait after freeing, default 8), until_told=1 (end the wait early when a
 * line arrives on the console: the host says it has seen what it waited for).
 *
 * mode=paced runs a steady load instead, for density experiments: after filling, it makes
 * rate=N accesses per second (default 200000) for warmup=W (default 0) and then seconds=S
 * (default 30) seconds, each a read-modify-write of one word, a share hot_pct (default 99) of
 * them in the first active_pct (default 20) percent of the memory and the rest anywhere, and
 * reports every second and at the end how many it managed in the S measured seconds
 * ("memtide-guest: paced ... achieved N/s"). Like a server whose clients give up, it never
 * owes more than 100 ms of accesses: a guest whose memory is slow falls behind its rate and
 * stays behind, rather than making up later for a stall. zero_pct=P (default 0) fills the
 * last P percent of each page's words with zero instead of the pattern, so that the memory
 * compresses (50: about 2:1); the console's "filled" line says so.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/reboot.h>
#include <sys/syscall.h>
#include <sys/sysinfo.h>
#include <time.h>
#include <unistd.h>

static const char *modules[] = {
    "virtio_ring.ko", "virtio.ko", "virtio_pci_modern_dev.ko", "virtio_pci_legacy_dev.ko",
    "virtio_pci.ko", "virtio_balloon.ko",
};

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n > 0)
        write(1, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
}

static void power_off(void) {
    sync();
    reboot(RB_POWER_OFF);
    for (;;)
        pause();
}

static long setting(const char *name, long dflt) {
    const char *v = getenv(name);
    return v ? strtol(v, NULL, 10) : dflt;
}

static uint64_t pattern(uint64_t i, uint64_t round) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (round + 1) * 0xD1B54A32D192ED03ull;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    return x ^ (x >> 29);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void load_modules(void) {
    for (size_t k = 0; k < sizeof modules / sizeof *modules; k++) {
        char path[128];
        snprintf(path, sizeof path, "/modules/%s", modules[k]);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || syscall(SYS_finit_module, fd, "", 0) != 0)
            say("memtide-guest: loading %s failed (%m)\n", modules[k]);
        if (fd >= 0)
            close(fd);
    }
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static uint64_t next_random(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* The paced load over `words` words at `m`; returns accesses made in the measured seconds. */
static uint64_t paced(uint64_t *m, size_t words) {
    long rate = setting("rate", 200000);
    long warmup = setting("warmup", 0);
    long seconds = setting("seconds", 30);
    long hot_pct = setting("hot_pct", 99);
    long active_pct = setting("active_pct", 20);
    size_t active = words / 100 * (size_t)active_pct;
    if (active == 0)
        active = 1;
    /* `due`: accesses the clock asks for by now, less those given up on; `done`: made. */
    uint64_t slack = (uint64_t)rate / 10 + 1, slice_max = (uint64_t)rate / 1000 + 1;
    double start = now(), measured_from = start + warmup, next_report = start + 1;
    uint64_t done = 0, given_up = 0, last = 0, at_measure = 0;
    int measuring = warmup == 0;
    for (;;) {
        double t = now();
        if (t - measured_from >= seconds)
            break;
        uint64_t due = (uint64_t)((t - start) * rate) - given_up;
        /* At most `slack` owed; none carried from the warm-up into the measured seconds. */
        uint64_t owed_max = slack;
        if (!measuring && t >= measured_from) {
            measuring = 1;
            at_measure = done;
            owed_max = 0;
        }
        if (due > done + owed_max) {
            given_up += due - done - owed_max;
            due = done + owed_max;
        }
        if (done >= due) {
            struct timespec ts = {0, 200000};
            nanosleep(&ts, NULL);
        } else {
            uint64_t slice = due - done < slice_max ? due - done : slice_max;
            for (uint64_t k = 0; k < slice; k++) {
                uint64_t r = next_random();
                size_t i = (long)(r % 100) < hot_pct ? (r >> 8) % active : (r >> 8) % words;
                m[i] += 1;
            }
            done += slice;
        }
        if (t >= next_report) {
            say("memtide-guest: paced second %.0f%s: %llu accesses\n", t - start,
                measuring ? "" : " (warm-up)", (unsigned long long)(done - last));
            last = done;
            next_report += 1;
        }
    }
    double secs = now() - measured_from;
    uint64_t made = done - at_measure;
    say("memtide-guest: paced %ld/s for %.1f s after %ld s of warm-up: achieved %.0f/s (%.1f%% "
        "of the rate)\n",
        rate, secs, warmup, made / secs, 100.0 * made / secs / rate);
    return made;
}

int main(void) {
    struct sysinfo si;
    sysinfo(&si);
    uint64_t ram = (uint64_t)si.totalram * si.mem_unit;
    long fill_mib = setting("fill_mib", (long)(ram * 3 / 4 >> 20));
    long rounds = setting("rounds", 2);
    int balloon = setting("balloon", 0) != 0;
    say("memtide-guest: up, %llu MiB RAM, filling %ld MiB, %ld rounds%s\n",
        (unsigned long long)(ram >> 20), fill_mib, rounds, balloon ? ", balloon" : "");
    if (balloon)
        load_modules();

    size_t len = (size_t)fill_mib << 20;
    uint64_t *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
        say("memtide-guest: FAIL: cannot map %ld MiB (%m)\n", fill_mib);
        power_off();
    }
    size_t words = len / 8;
    const char *mode = getenv("mode");
    if (mode && strcmp(mode, "paced") == 0) {
        long zero_pct = setting("zero_pct", 0);
        zero_pct = zero_pct < 0 ? 0 : zero_pct > 100 ? 100 : zero_pct;
        size_t kept = 512 - (size_t)zero_pct * 512 / 100;
        for (size_t i = 0; i < words; i++)
            m[i] = i % 512 < kept ? pattern(i, 0) : 0;
        say("memtide-guest: filled %ld MiB, %ld%% of each page zero\n", fill_mib, zero_pct);
        paced(m, words);
        power_off();
    }
    uint64_t bad = 0;
    double t0 = now();
    for (long r = 0; r < rounds; r++) {
        for (size_t i = 0; i < words; i++)
            m[i] = pattern(i, r);
        for (size_t i = 0; i < words; i++)
            if (m[i] != pattern(i, r))
                bad++;
        say("memtide-guest: round %ld of %ld done, %llu mismatches so far\n", r + 1, rounds,
            (unsigned long long)bad);
    }
    double secs = now() - t0;
    say("memtide-guest: verified %ld MiB x %ld rounds in %.1f s: %llu mismatches: %s\n", fill_mib,
        rounds, secs, (unsigned long long)bad, bad ? "FAIL" : "PASS");
    if (balloon) {
        munmap(m, len);
        long settle = setting("settle", 8);
        int until_told = setting("until_told", 0) != 0;
        sysinfo(&si);
        say("memtide-guest: freed %ld MiB (guest free now %llu MiB); waiting %s%ld s for free "
            "page reporting\n",
            fill_mib, (unsigned long long)((uint64_t)si.freeram * si.mem_unit >> 20),
            until_told ? "until told, at most " : "", settle);
        if (until_told) {
            struct pollfd p = {.fd = 0, .events = POLLIN};
            double t1 = now();
            int told = poll(&p, 1, (int)(settle * 1000)) > 0;
            if (told) {
                char line[64];
                (void)!read(0, line, sizeof line);
            }
            say("memtide-guest: %s after %.1f s\n", told ? "told to finish" : "not told", now() - t1);
        } else {
            sleep((unsigned)settle);
        }
        say("memtide-guest: done\n");
    }
    power_off();
}
