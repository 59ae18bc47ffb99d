// LD_PRELOAD shim for benchmarks/profile_moe.py --regions: counts the calling thread's OpenMP
// parallel regions (GOMP_parallel: torch's at::parallel_for and the extensions' own regions are
// all forks of libgomp) and its thread CPU / wall time inside them, per calling library (dladdr
// of the return address). Nested regions count once (the outermost). Read through ctypes:
// regions_reset(), regions_count(), regions_cpu_s(), regions_wall_s(), regions_table(path, div).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

typedef void (*gomp_parallel_fn)(void (*)(void*), void*, unsigned, unsigned);
static gomp_parallel_fn real_parallel;
static __thread int depth;
static long count;
static double cpu_in, wall_in;
#define SITES 256
static const void* site[SITES];
static long site_count[SITES];
static double site_cpu[SITES];

static double now(clockid_t c) {
  struct timespec t;
  clock_gettime(c, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

void regions_reset(void) {
  count = 0;
  cpu_in = wall_in = 0;
  memset(site, 0, sizeof site);
  memset(site_count, 0, sizeof site_count);
  memset(site_cpu, 0, sizeof site_cpu);
}
long regions_count(void) { return count; }
double regions_cpu_s(void) { return cpu_in; }
double regions_wall_s(void) { return wall_in; }

// one line per calling library: regions and calling-thread CPU us, both divided by div
void regions_table(const char* path, double div) {
  FILE* f = fopen(path, "w");
  if (!f) return;
  for (int i = 0; i < SITES; ++i) {
    if (!site[i]) continue;
    Dl_info d;
    const char* lib = "?";
    if (dladdr(site[i], &d) && d.dli_fname) lib = strrchr(d.dli_fname, '/') ? strrchr(d.dli_fname, '/') + 1 : d.dli_fname;
    fprintf(f, "%s\t%.2f\t%.1f\n", lib, site_count[i] / div, site_cpu[i] * 1e6 / div);
  }
  fclose(f);
}

void GOMP_parallel(void (*fn)(void*), void* data, unsigned n, unsigned flags) {
  if (!real_parallel) real_parallel = (gomp_parallel_fn)dlsym(RTLD_NEXT, "GOMP_parallel");
  if (depth) {
    real_parallel(fn, data, n, flags);
    return;
  }
  const void* ra = __builtin_return_address(0);
  depth = 1;
  const double c0 = now(CLOCK_THREAD_CPUTIME_ID), w0 = now(CLOCK_MONOTONIC);
  real_parallel(fn, data, n, flags);
  const double dc = now(CLOCK_THREAD_CPUTIME_ID) - c0, dw = now(CLOCK_MONOTONIC) - w0;
  depth = 0;
  ++count;
  cpu_in += dc;
  wall_in += dw;
  for (unsigned i = 0, h = ((uintptr_t)ra >> 4) % SITES; i < SITES; ++i, h = (h + 1) % SITES) {
    if (site[h] == 0 || site[h] == ra) {
      site[h] = ra;
      ++site_count[h];
      site_cpu[h] += dc;
      break;
    }
  }
}
