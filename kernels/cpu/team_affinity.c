/* Where the threads of the calling thread's OpenMP team may run (kernels/cpu/team_affinity.py).
 *
 * libgomp keeps one pool of worker threads per thread that opens parallel regions, and torch's
 * parallel work, like every C kernel here built with OpenMP, runs on that pool. A region of
 * `n` threads opened here reaches exactly the threads the caller's later regions use (the
 * caller is thread 0), so each sets its own affinity. */
#define _GNU_SOURCE
#include <sched.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Thread i of a team of `n` may run on cpus[i * width .. i * width + width - 1] (CPU numbers).
 * Returns the threads whose affinity was set (n when all were), or -1 without OpenMP (the
 * library was built without it: only the caller would be reached) or for bad arguments. */
int efim_team_affinity(int n, int width, const int *cpus) {
#ifdef _OPENMP
  if (n < 1 || width < 1 || cpus == NULL) return -1;
  for (long i = 0; i < (long)n * width; i++)
    if (cpus[i] < 0 || cpus[i] >= CPU_SETSIZE) return -1;
  int done = 0;
#pragma omp parallel num_threads(n) reduction(+ : done)
  {
    int i = omp_get_thread_num();
    if (i < n && omp_get_num_threads() == n) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int j = 0; j < width; j++) CPU_SET(cpus[(long)i * width + j], &set);
      done += sched_setaffinity(0, sizeof set, &set) == 0;
    }
  }
  return done;
#else
  (void)n;
  (void)width;
  (void)cpus;
  return -1;
#endif
}

/* 1 where this library was built with OpenMP (efim_team_affinity reaches the team), else 0. */
int efim_team_affinity_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}
