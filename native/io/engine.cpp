#include "engine.h"

#include "crc32c.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace nvo {

namespace {

int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

}  // namespace

void Ticket::start_block() {
  std::lock_guard<std::mutex> lock(mu_);
  if (started_ns_ == 0) started_ns_ = monotonic_ns();
}

int64_t Ticket::started_ns() {
  std::lock_guard<std::mutex> lock(mu_);
  return started_ns_;
}

int64_t Ticket::finished_ns() {
  std::lock_guard<std::mutex> lock(mu_);
  return finished_ns_;
}

void Ticket::finish_block(int err, const char* call, int64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  if (err != 0 && err_ == 0) {
    err_ = err;
    call_ = call;
    offset_ = offset;
  }
  if (--remaining_ == 0) {
    finished_ns_ = monotonic_ns();
    cv_.notify_all();
  }
}

uint32_t Ticket::crc() {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t crc = 0;
  for (const auto& [block_crc, nbytes] : crcs_) crc = crc32c_combine(crc, block_crc, nbytes);
  return crc;
}

bool Ticket::done() {
  std::lock_guard<std::mutex> lock(mu_);
  return remaining_ == 0;
}

bool Ticket::wait(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  auto finished = [this] { return remaining_ == 0; };
  if (timeout_s < 0) {
    cv_.wait(lock, finished);
    return true;
  }
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), finished);
}

ThreadPoolBackend::ThreadPoolBackend(int num_threads, size_t queue_depth, Engine* engine)
    : engine_(engine), queue_depth_(queue_depth) {
  for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this] { worker(); });
}

ThreadPoolBackend::~ThreadPoolBackend() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  not_empty_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPoolBackend::submit(std::vector<Block>&& blocks) {
  for (auto& b : blocks) {
    std::unique_lock<std::mutex> lock(mu_);
    not_full_.wait(lock, [this] { return queue_.size() < queue_depth_; });
    queue_.push_back(std::move(b));
    lock.unlock();
    not_empty_.notify_one();
  }
}

void ThreadPoolBackend::worker() {
  for (;;) {
    Block b;
    {
      std::unique_lock<std::mutex> lock(mu_);
      not_empty_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and every queued block has run
      b = std::move(queue_.front());
      queue_.pop_front();
    }
    not_full_.notify_one();
    const char* call = "";
    b.ticket->start_block();
    int err = engine_->run_block(b, &call);
    b.ticket->finish_block(err, call, b.offset);
  }
}

Engine::Engine(int num_threads, size_t block_size_bytes, size_t queue_depth)
    : block_size_(block_size_bytes),
      backend_(std::make_unique<ThreadPoolBackend>(num_threads, queue_depth, this)) {}

std::shared_ptr<Ticket> Engine::submit(int fd, char* ptr, size_t nbytes, size_t valid_bytes, int64_t offset,
                                       bool write, bool checksum) {
  size_t nblocks = nbytes == 0 ? 0 : (nbytes + block_size_ - 1) / block_size_;
  auto ticket = std::make_shared<Ticket>(nblocks, checksum);
  std::vector<Block> blocks;
  blocks.reserve(nblocks);
  for (size_t done = 0; done < nbytes; done += block_size_) {
    size_t len = std::min(block_size_, nbytes - done);
    size_t valid = valid_bytes > done ? std::min(len, valid_bytes - done) : 0;
    blocks.push_back(Block{fd, ptr + done, len, valid, offset + static_cast<int64_t>(done), write, checksum,
                           blocks.size(), ticket});
  }
  backend_->submit(std::move(blocks));
  return ticket;
}

void Engine::inject_fault(Fault fault, int64_t after_ops) {
  std::lock_guard<std::mutex> lock(fault_mu_);
  fault_ = fault;
  fault_countdown_ = after_ops;
  fault_armed_.store(fault != Fault::kNone);
}

Fault Engine::take_fault(bool write) {
  if (!fault_armed_.load(std::memory_order_acquire)) return Fault::kNone;
  std::lock_guard<std::mutex> lock(fault_mu_);
  bool applies = fault_ == Fault::kEio || (fault_ == Fault::kEnospc && write) ||
                 (fault_ == Fault::kShortRead && !write);
  if (!applies) return Fault::kNone;
  if (fault_countdown_-- > 0) return Fault::kNone;
  Fault fault = fault_;
  fault_ = Fault::kNone;
  fault_armed_.store(false);
  return fault;
}

namespace {

// This worker thread's aligned buffer of at least `nbytes` (kept for the thread's life).
char* bounce_buffer(size_t nbytes) {
  struct Buffer {
    char* ptr = nullptr;
    size_t size = 0;
    ~Buffer() { std::free(ptr); }
  };
  thread_local Buffer buffer;
  if (buffer.size < nbytes) {
    std::free(buffer.ptr);
    buffer.size = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
    buffer.ptr = static_cast<char*>(std::aligned_alloc(kAlignment, buffer.size));
    if (buffer.ptr == nullptr) buffer.size = 0;
  }
  return buffer.ptr;
}

}  // namespace

int Engine::run_bounced(const Block& b, Fault fault, const char** call) {
  char* bounce = bounce_buffer(b.nbytes);
  if (bounce == nullptr) {
    *call = "aligned_alloc (bounce buffer)";
    return ENOMEM;
  }
  Block aligned = b;
  aligned.ptr = bounce;
  aligned.valid = b.nbytes;
  if (b.write) {
    std::memcpy(bounce, b.ptr, b.valid);
    std::memset(bounce + b.valid, 0, b.nbytes - b.valid);
  }
  int err = transfer(aligned, fault, call);
  if (err == 0 && !b.write) std::memcpy(b.ptr, bounce, b.valid);
  return err;
}

int Engine::run_block(const Block& b, const char** call) {
  *call = b.write ? "pwrite" : "pread";
  // A write's bytes are checksummed before they go out, a read's once they are in: by this thread, while
  // the block is in its cache (a bounced block: the bounce copy reads it again from there).
  if (b.checksum && b.write) b.ticket->set_block_crc(b.index, crc32c(b.ptr, b.valid, 0), b.valid);
  Fault fault = take_fault(b.write);
  if (fault == Fault::kEio) return EIO;
  if (fault == Fault::kEnospc) return ENOSPC;
  int err = b.valid < b.nbytes || reinterpret_cast<uintptr_t>(b.ptr) % kAlignment != 0 ? run_bounced(b, fault, call)
                                                                                        : transfer(b, fault, call);
  if (err == 0 && b.checksum && !b.write) b.ticket->set_block_crc(b.index, crc32c(b.ptr, b.valid, 0), b.valid);
  return err;
}

int Engine::transfer(const Block& b, Fault fault, const char** call) {
  size_t done = 0;
  while (done < b.nbytes) {
    ssize_t n;
    if (b.write) {
      n = pwrite(b.fd, b.ptr + done, b.nbytes - done, b.offset + static_cast<int64_t>(done));
    } else if (fault == Fault::kShortRead) {
      n = 0;  // the file ends early
    } else {
      n = pread(b.fd, b.ptr + done, b.nbytes - done, b.offset + static_cast<int64_t>(done));
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) {
      // A read past the end of the file, or a write the device would not take.
      *call = b.write ? "pwrite (no progress)" : "pread (short read)";
      return b.write ? ENOSPC : ENODATA;
    }
    done += static_cast<size_t>(n);
  }
  return 0;
}

static std::atomic<bool> refuse_next_direct_open{false};

void inject_direct_refusal() { refuse_next_direct_open.store(true); }

int open_file(const std::string& path, bool create, bool direct, int* fd) {
  if (direct && refuse_next_direct_open.exchange(false)) return EINVAL;
  int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0) | (direct ? O_DIRECT : 0);
  int result = ::open(path.c_str(), flags, 0600);
  if (result < 0) return errno;
  *fd = result;
  return 0;
}

int allocate_file(int fd, int64_t offset, int64_t nbytes) {
  if (nbytes <= 0) return 0;
  return posix_fallocate(fd, offset, nbytes);
}

}  // namespace nvo
