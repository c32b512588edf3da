#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <stdexcept>
#include <string>

namespace nvoffload {
namespace adam {

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads < 1) throw std::invalid_argument("thread pool needs at least 1 thread, got " + std::to_string(num_threads));
  workers_.reserve(static_cast<size_t>(num_threads - 1));
  for (int i = 0; i < num_threads - 1; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::work_on_tasks() {
  for (;;) {
    const size_t task = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (task >= ntasks_) return;
    fn_(ctx_, task);
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    work_on_tasks();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--busy_workers_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::run(size_t ntasks, TaskFn fn, void* ctx) {
  if (ntasks == 0) return;
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  if (workers_.empty() || ntasks == 1) {
    for (size_t i = 0; i < ntasks; ++i) fn(ctx, i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fn_ = fn;
    ctx_ = ctx;
    ntasks_ = ntasks;
    next_task_.store(0, std::memory_order_relaxed);
    busy_workers_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  work_cv_.notify_all();
  work_on_tasks();
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return busy_workers_ == 0; });
}

namespace {

std::mutex g_mutex;
std::shared_ptr<ThreadPool> g_pool;
int g_requested = 0;  // 0: default
bool g_atfork_installed = false;

void atfork_prepare() { g_mutex.lock(); }
void atfork_parent() { g_mutex.unlock(); }
void atfork_child() {
  // The child has none of the parent's worker threads: never join or reuse
  // them. The old pool is leaked on purpose (destroying it would join threads
  // that do not exist here); the next call builds a fresh one.
  if (g_pool) new std::shared_ptr<ThreadPool>(std::move(g_pool));
  g_mutex.unlock();
}

}  // namespace

int default_num_threads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

std::shared_ptr<ThreadPool> global_pool() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_atfork_installed) {
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    g_atfork_installed = true;
  }
  if (!g_pool) g_pool = std::make_shared<ThreadPool>(g_requested > 0 ? g_requested : default_num_threads());
  return g_pool;
}

void set_num_threads(int n) {
  if (n < 0) throw std::invalid_argument("num_threads must be >= 0 (0 = default), got " + std::to_string(n));
  std::shared_ptr<ThreadPool> old;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_requested = n;
    const int want = n > 0 ? n : default_num_threads();
    if (g_pool && g_pool->num_threads() != want) old = std::move(g_pool);
  }
  // `old` is destroyed (its workers joined) once no running call holds it.
}

int num_threads() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_pool) return g_pool->num_threads();
  return g_requested > 0 ? g_requested : default_num_threads();
}

}  // namespace adam
}  // namespace nvoffload
