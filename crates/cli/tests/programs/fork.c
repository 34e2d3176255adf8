/* Programs that fork, for the fork tests (crates/cli/tests/fork.rs).
 *
 *   fork children MIB K   a region of MIB MiB filled with a pattern; K children each overwrite
 *                         their own part and check the rest holds the bytes of the fork; the
 *                         parent rewrites the whole region meanwhile and checks it afterwards.
 *   fork kill MIB         a child keeps faulting and rewriting a region of MIB MiB until the
 *                         parent kills it with SIGKILL; the parent then waits until its engine's
 *                         statistics say the tier's slots in use are its own again.
 */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static uint64_t pat(uint64_t i, uint64_t gen) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + gen;
  x ^= x >> 29;
  return x;
}

static int children(size_t mib, int kids) {
  size_t n = mib << 17; /* words */
  uint64_t *a = malloc(n * 8);
  for (size_t i = 0; i < n; i++) a[i] = pat(i, 0);
  pid_t pids[64];
  for (int k = 0; k < kids; k++) {
    pid_t p = fork();
    if (p < 0) { perror("fork"); return 2; }
    if (p == 0) {
      size_t lo = n / kids * k, hi = n / kids * (k + 1), bad = 0;
      for (size_t i = lo; i < hi; i++) a[i] = pat(i, 100 + k);
      for (size_t i = 0; i < n; i++) {
        uint64_t want = (i >= lo && i < hi) ? pat(i, 100 + k) : pat(i, 0);
        if (a[i] != want && bad++ < 3)
          fprintf(stderr, "child %d: word %zu is %llx, not %llx\n", k, i,
                  (unsigned long long)a[i], (unsigned long long)want);
      }
      _exit(bad ? 1 : 0);
    }
    pids[k] = p;
  }
  for (size_t i = 0; i < n; i++) a[i] = pat(i, 7);
  int failed = 0;
  for (int k = 0; k < kids; k++) {
    int st;
    waitpid(pids[k], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st)) failed++;
  }
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += a[i] != pat(i, 7);
  printf("children failed %d, parent's wrong words %zu\n", failed, bad);
  return failed || bad;
}

/* The value of "key": N in this process's statistics file (-1 when not there yet). */
static long long stat_of(const char *key) {
  const char *dir = getenv("MEMTIDE_STATS_DIR");
  if (!dir) return -1;
  char path[4096], buf[1 << 16], k[128];
  snprintf(path, sizeof path, "%s/memtide-%d.json", dir, (int)getpid());
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  size_t len = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[len] = 0;
  snprintf(k, sizeof k, "\"%s\": ", key);
  char *at = strstr(buf, k);
  return at ? atoll(at + strlen(k)) : -1;
}

static int kill_child(size_t mib) {
  size_t n = mib << 17;
  uint64_t *a = malloc(n * 8);
  for (size_t i = 0; i < n; i++) a[i] = pat(i, 0);
  pid_t p = fork();
  if (p < 0) { perror("fork"); return 2; }
  if (p == 0) {
    /* Fault pages in from the tier and dirty them, so that the child holds slots of its own. */
    for (uint64_t gen = 1;; gen++)
      for (size_t i = 0; i < n; i += 512) a[i] = pat(i, gen);
  }
  struct timespec two = {2, 0};
  nanosleep(&two, 0);
  long long family = stat_of("tier_family_bytes"), own = stat_of("tier_bytes");
  printf("before the kill: the family holds %lld bytes of tier 1, the parent %lld\n", family, own);
  kill(p, SIGKILL);
  waitpid(p, 0, 0);
  for (int t = 0; t < 200; t++) {
    struct timespec tenth = {0, 100000000};
    nanosleep(&tenth, 0);
    family = stat_of("tier_family_bytes");
    own = stat_of("tier_bytes");
    if (family >= 0 && family == own) {
      size_t bad = 0;
      for (size_t i = 0; i < n; i++) bad += a[i] != pat(i, 0);
      printf("after the kill: the family holds %lld bytes, all the parent's; wrong words %zu\n",
             family, bad);
      return bad != 0;
    }
  }
  printf("after the kill: the family holds %lld bytes of tier 1, the parent %lld\n", family, own);
  return 1;
}

int main(int argc, char **argv) {
  if (argc == 4 && !strcmp(argv[1], "children")) return children(atoi(argv[2]), atoi(argv[3]));
  if (argc == 3 && !strcmp(argv[1], "kill")) return kill_child(atoi(argv[2]));
  fprintf(stderr, "usage: fork children MIB K | fork kill MIB\n");
  return 2;
}
