// A small persistent pool of worker threads for the Adam kernel.
//
// `run(ntasks, fn, ctx)` calls fn(ctx, i) for every i in [0, ntasks) on the
// workers and on the calling thread, handing tasks out through one atomic
// counter (so a core slowed by other load takes fewer of them), and returns
// when all are done. One job runs at a time; concurrent callers queue.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace nvoffload {
namespace adam {

class ThreadPool {
 public:
  using TaskFn = void (*)(void* ctx, size_t task);

  // `num_threads` counts the calling thread: the pool starts num_threads - 1 workers.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  void run(size_t ntasks, TaskFn fn, void* ctx);

 private:
  void worker_loop();
  void work_on_tasks();

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // serializes jobs
  std::mutex mutex_;      // guards the fields below
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  int busy_workers_ = 0;
  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  size_t ntasks_ = 0;
  std::atomic<size_t> next_task_{0};
};

// The process-wide pool, created on first use with num_threads() threads and
// re-created after fork() in the child (whose copy has no worker threads).
std::shared_ptr<ThreadPool> global_pool();

// Threads used by the kernel; 0 restores the default (the CPUs this process may run on).
void set_num_threads(int num_threads);
int num_threads();
int default_num_threads();

}  // namespace adam
}  // namespace nvoffload
