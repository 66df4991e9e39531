// A batch of sends and receives (torch's batch_isend_irecv, a coalescing block) on the C++
// path: each dense CPU send or recv issued in the block is kept here (Batch) with a Work that
// waits on the batch's slot (BatchSlot); when the block ends (_native.cpp's end_batch) they are
// recorded into one toroid group, with the Python path's ones after them, and the group's one
// toroid work is bound to the slot. toroid runs a group's sends and receives side by side, so
// no order of the batch can deadlock. Included by _native_work.hpp.

#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace toroid_native {

constexpr int kInvalidUsage = 4;  // TOROID_INVALID_USAGE

// The toroid work functions a slot calls (toroid_work_wait, _test, _free).
struct WorkFns {
  int (*wait)(void*, int64_t);
  int (*test)(void*, int*);
  void (*free)(void*);
};

// The one toroid work of a batch, shared by the Works of its calls; unbound until the batch
// ends. Waited once (the first waiter frees the toroid work), its result kept for the others.
class BatchSlot {
 public:
  explicit BatchSlot(WorkFns fns) : api_(fns) {}
  BatchSlot(const BatchSlot&) = delete;
  BatchSlot& operator=(const BatchSlot&) = delete;
  ~BatchSlot() {
    if (work_ != nullptr) {
      api_.free(work_);  // (only once it has run: an unfinished one is kept by its Works)
    }
  }

  // The batch's work (null: nothing was queued) and the result of ending it (0, or the error
  // every call of the batch then reports).
  void bind(void* work, int code) {
    std::lock_guard<std::mutex> lock(mu_);
    work_ = code == 0 ? work : nullptr;
    if (code != 0 && work != nullptr) {
      api_.wait(work, -1);  // (what was recorded runs; its failure is reported as `code`)
      api_.free(work);
    }
    code_ = code;
    bound_ = true;
    done_ = work_ == nullptr;
  }

  // Whether the batch has ended (before, a wait is a misuse: its calls are not issued yet).
  bool bound() {
    std::lock_guard<std::mutex> lock(mu_);
    return bound_;
  }

  // Waits for the batch (timeout_ms < 0: the communicator's timeout) and returns its toroid
  // result; TOROID_INVALID_USAGE for a wait before the block has ended.
  int finish(int64_t timeout_ms) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!bound_) {
      return kInvalidUsage;
    }
    if (!done_) {
      code_ = api_.wait(work_, timeout_ms);
      api_.free(work_);
      work_ = nullptr;
      done_ = true;
    }
    return code_;
  }

  // Whether the batch has run, without blocking.
  bool test() {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock() || !bound_) {
      return false;
    }
    if (done_) {
      return true;
    }
    int done = 0;
    if (api_.test(work_, &done) != 0 || done == 0) {
      return false;
    }
    lock.unlock();
    finish(-1);
    return true;
  }

 private:
  WorkFns api_;
  std::mutex mu_;
  void* work_ = nullptr;
  bool bound_ = false;
  bool done_ = false;
  int code_ = 0;
};

// The calls of the coalescing block in progress that the C++ path took, in issue order. Once one
// call of the block goes to the Python path (a tensor this path does not take), the rest follow
// it, so that the group records every call in issue order (messages to one peer are matched in
// that order).
class Batch {
 public:
  struct Call {
    bool sending;
    void* buf;
    size_t count;
    int dtype;
    int peer;
  };

  // A block starts (start_coalescing).
  void begin(WorkFns api) {
    std::lock_guard<std::mutex> lock(mu_);
    calls_.clear();
    slot_ = std::make_shared<BatchSlot>(api);
    open_ = true;
    python_ = false;
  }

  // Takes `call` into the block: the slot its Work waits on, or null when the call is not
  // this path's (no block open, or an earlier call of the block went to the Python path).
  std::shared_ptr<BatchSlot> add(const Call& call) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_ || python_) {
      return nullptr;
    }
    calls_.push_back(call);
    return slot_;
  }

  // A call of the block went to the Python path: so do the rest.
  void to_python() {
    std::lock_guard<std::mutex> lock(mu_);
    python_ = true;
  }

  // The block ends: its calls and slot (a new slot when no block was open).
  std::pair<std::vector<Call>, std::shared_ptr<BatchSlot>> end(WorkFns api) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Call> calls;
    calls.swap(calls_);
    std::shared_ptr<BatchSlot> slot = slot_ ? std::move(slot_) : std::make_shared<BatchSlot>(api);
    slot_ = nullptr;
    open_ = false;
    python_ = false;
    return {std::move(calls), std::move(slot)};
  }

 private:
  std::mutex mu_;
  std::vector<Call> calls_;
  std::shared_ptr<BatchSlot> slot_;
  bool open_ = false;
  bool python_ = false;
};

}  // namespace toroid_native
