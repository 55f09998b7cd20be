// Thread placement for the CPU path (pagoda.engine.runner.thread_placement calls it): each of
// torch's OpenMP threads bound to one CPU, as vLLM's CPU worker binds its threads
// (VLLM_CPU_OMP_THREADS_BIND). Unbound, the kernel's scheduler moves a thread between CPUs
// between two parallel regions, and its caches (the packed weight panels it last read) stay behind.
//
// The binding is made inside one OpenMP parallel region of as many threads as CPUs: thread t
// (the calling thread is t = 0) binds itself to cpus[t]. libgomp keeps a calling thread's team
// of workers and hands them the same thread numbers in every later region of that size, so the
// parallel_for of every op afterwards runs thread t on cpus[t]. A team belongs to the thread that
// starts the regions: the call is made from the thread that runs the forward.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>
#include <sched.h>

#include <cerrno>
#include <cstring>
#include <vector>

namespace {

// Binds torch's threads (one per entry) to ``cpus``; returns the CPU each thread runs on after.
std::vector<int64_t> bind_threads(std::vector<int64_t> cpus) {
  const int64_t n = static_cast<int64_t>(cpus.size());
  TORCH_CHECK(n >= 1, "bind_threads: give at least one CPU");
  for (int64_t cpu : cpus) {
    TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "bind_threads: CPU ", cpu, " is out of range");
  }
  at::set_num_threads(static_cast<int>(n));
  std::vector<int64_t> placed(n, -1);
  std::vector<int> errors(n, 0);
#pragma omp parallel num_threads(static_cast<int>(n))
  {
    const int t = omp_get_thread_num();
    if (t < n) {
      cpu_set_t mask;
      CPU_ZERO(&mask);
      CPU_SET(static_cast<int>(cpus[t]), &mask);
      errors[t] = sched_setaffinity(0, sizeof(mask), &mask) == 0 ? 0 : errno;
      placed[t] = sched_getcpu();
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(errors[t] == 0, "bind_threads: thread ", t, " could not be bound to CPU ", cpus[t], ": ",
                std::strerror(errors[t]));
  }
  return placed;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) { m.def("bind_threads(int[] cpus) -> int[]", &bind_threads); }
