// The native I/O engine: pread/pwrite on raw pointers, split into blocks that
// a backend runs in parallel. No PyTorch headers; the binding releases the GIL.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace nvo {

// Completion state of one submitted request (one or more blocks).
class Ticket {
 public:
  // `checksum`: each block records the CRC-32C of its valid bytes (see crc()).
  Ticket(size_t blocks, bool checksum) : remaining_(blocks), checksum_(checksum), crcs_(checksum ? blocks : 0) {}
  // Records one finished block; err != 0 keeps the first failure.
  void finish_block(int err, const char* call, int64_t offset);
  bool checksummed() const { return checksum_; }
  // Block `index`'s CRC-32C of its `nbytes` valid bytes (computed by the worker that moved it).
  void set_block_crc(size_t index, uint32_t crc, size_t nbytes) { crcs_[index] = {crc, nbytes}; }
  // The CRC-32C of the request's valid bytes, joined from its blocks'; call once done().
  uint32_t crc();
  bool done();
  // Waits up to timeout_s seconds (< 0: forever); true when done.
  bool wait(double timeout_s);
  // Marks that a worker started one of its blocks (the first call sets the start time).
  void start_block();
  // CLOCK_MONOTONIC nanoseconds (Python's time.monotonic_ns) when the first block started and the last ended;
  // 0 until then.
  int64_t started_ns();
  int64_t finished_ns();
  // errno of the first failed block (0 if none), the call and file offset that failed.
  int error() const { return err_; }
  const char* failed_call() const { return call_; }
  int64_t failed_offset() const { return offset_; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  size_t remaining_;
  int err_ = 0;
  const char* call_ = "";
  int64_t offset_ = -1;
  int64_t started_ns_ = 0;
  int64_t finished_ns_ = 0;
  const bool checksum_;
  std::vector<std::pair<uint32_t, size_t>> crcs_;  // per block: CRC-32C and bytes checksummed
};

// One transfer of `nbytes` at `offset`. Only the first `valid` bytes are backed by
// the caller's memory at `ptr` (the rest is padding up to the file's alignment:
// zeros written, bytes read dropped). A block whose memory is not aligned, or
// that has padding, goes through the worker's own aligned bounce buffer.
struct Block {
  int fd;
  char* ptr;
  size_t nbytes;
  size_t valid;
  int64_t offset;
  bool write;
  bool checksum;  // record the CRC-32C of the valid bytes in the ticket, as block `index`
  size_t index;
  std::shared_ptr<Ticket> ticket;
};

// Faults the tests inject into the next operations of an engine: ENOSPC hits
// writes, a short read hits reads (the file ends early), EIO hits either.
enum class Fault : int { kNone = 0, kEnospc, kEio, kShortRead };

// One way of doing I/O: runs queued blocks through Engine::run_block.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual void submit(std::vector<Block>&& blocks) = 0;
};

// A pool of threads doing pread/pwrite; a bounded queue gives back-pressure.
class ThreadPoolBackend final : public Backend {
 public:
  ThreadPoolBackend(int num_threads, size_t queue_depth, class Engine* engine);
  ~ThreadPoolBackend() override;
  void submit(std::vector<Block>&& blocks) override;

 private:
  void worker();
  Engine* engine_;
  size_t queue_depth_;
  std::mutex mu_;
  std::condition_variable not_empty_, not_full_;
  std::deque<Block> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

class Engine {
 public:
  Engine(int num_threads, size_t block_size_bytes, size_t queue_depth);
  // Splits a transfer of `nbytes` at file `offset` into blocks and queues them;
  // [ptr, ptr + valid_bytes) is the caller's memory, the rest padding (see Block). With `checksum`, the
  // worker of each block computes the CRC-32C of its valid bytes (a write's before it is written, a read's
  // once it is read) and the ticket joins them.
  std::shared_ptr<Ticket> submit(int fd, char* ptr, size_t nbytes, size_t valid_bytes, int64_t offset, bool write,
                                 bool checksum);
  // The next block operation the fault applies to, after `after_ops` such
  // operations have run, fails with `fault` (one shot).
  void inject_fault(Fault fault, int64_t after_ops);
  // Runs one block to completion: loops over partial transfers; returns 0 or errno.
  int run_block(const Block& b, const char** call);

 private:
  Fault take_fault(bool write);
  // Moves the block's bytes through this thread's aligned bounce buffer.
  int run_bounced(const Block& b, Fault fault, const char** call);
  // pread/pwrite of the whole block, looping over partial transfers.
  int transfer(const Block& b, Fault fault, const char** call);
  size_t block_size_;
  std::atomic<bool> fault_armed_{false};  // fast path: no lock while no fault is armed
  std::mutex fault_mu_;
  Fault fault_ = Fault::kNone;
  int64_t fault_countdown_ = 0;
  std::unique_ptr<Backend> backend_;
};

// File helpers used by the store. All return 0 or errno.
int open_file(const std::string& path, bool create, bool direct, int* fd);
int allocate_file(int fd, int64_t offset, int64_t nbytes);
// Alignment (bytes) of memory, sizes and offsets for O_DIRECT transfers.
constexpr size_t kAlignment = 4096;
// The next open_file with direct=true fails with EINVAL (a file system refusing O_DIRECT).
void inject_direct_refusal();

}  // namespace nvo
