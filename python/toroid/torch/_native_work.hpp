// The works and the communicator state of toroid's C++ torch backend (_native.cpp, which
// includes this file; one translation unit, built by _native.py): a toroid async call's torch
// Work and its future, a blocking call's completed Work, the Python backend's work as torch
// sees it, and what the group's backends share of one toroid communicator.

#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>

#include <unistd.h>

#include "_native_batch.hpp"

namespace toroid_native {

namespace py = pybind11;
using c10d::Backend;
using c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;

// toroid's C ABI, the functions this module calls (include/toroid.h).
struct Api {
  int (*all_reduce)(void*, const void*, void*, size_t, int, int) = nullptr;
  int (*all_reduce_async)(void*, const void*, void*, size_t, int, int, void**) = nullptr;
  int (*broadcast)(void*, const void*, void*, size_t, int, int) = nullptr;
  int (*broadcast_async)(void*, const void*, void*, size_t, int, int, void**) = nullptr;
  int (*all_gather)(void*, const void*, void*, size_t, int) = nullptr;
  int (*all_gather_async)(void*, const void*, void*, size_t, int, void**) = nullptr;
  int (*reduce_scatter)(void*, const void*, void*, size_t, int, int) = nullptr;
  int (*reduce_scatter_async)(void*, const void*, void*, size_t, int, int, void**) = nullptr;
  int (*reduce)(void*, const void*, void*, size_t, int, int, int) = nullptr;
  int (*reduce_async)(void*, const void*, void*, size_t, int, int, int, void**) = nullptr;
  int (*all_to_all)(void*, const void*, void*, size_t, int) = nullptr;
  int (*all_to_all_async)(void*, const void*, void*, size_t, int, void**) = nullptr;
  int (*all_to_all_v)(void*, const void*, const size_t*, void*, const size_t*, int) = nullptr;
  int (*all_to_all_v_async)(void*, const void*, const size_t*, void*, const size_t*, int, void**) = nullptr;
  int (*barrier)(void*) = nullptr;
  int (*barrier_async)(void*, void**) = nullptr;
  int (*send)(void*, const void*, size_t, int, int) = nullptr;
  int (*send_async)(void*, const void*, size_t, int, int, void**) = nullptr;
  int (*recv)(void*, void*, size_t, int, int) = nullptr;
  int (*recv_async)(void*, void*, size_t, int, int, void**) = nullptr;
  int (*group_start)(void*) = nullptr;
  int (*group_end)(void*) = nullptr;
  int (*group_end_async)(void*, void**) = nullptr;
  int (*work_wait)(void*, int64_t) = nullptr;
  int (*work_test)(void*, int*) = nullptr;
  void (*work_free)(void*) = nullptr;

  WorkFns work_fns() const { return WorkFns{work_wait, work_test, work_free}; }

  // The functions from their addresses in the loaded library, by name (_native.py's
  // comm_state gives every one).
  static Api from(const std::map<std::string, uintptr_t>& addresses) {
    Api api;
    auto get = [&](auto& f, const char* name) {
      auto it = addresses.find(name);
      TORCH_CHECK(it != addresses.end() && it->second != 0, "toroid native backend: no address for ", name);
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(it->second);
    };
    get(api.all_reduce, "toroid_all_reduce");
    get(api.all_reduce_async, "toroid_all_reduce_async");
    get(api.broadcast, "toroid_broadcast");
    get(api.broadcast_async, "toroid_broadcast_async");
    get(api.all_gather, "toroid_all_gather");
    get(api.all_gather_async, "toroid_all_gather_async");
    get(api.reduce_scatter, "toroid_reduce_scatter");
    get(api.reduce_scatter_async, "toroid_reduce_scatter_async");
    get(api.reduce, "toroid_reduce");
    get(api.reduce_async, "toroid_reduce_async");
    get(api.all_to_all, "toroid_all_to_all");
    get(api.all_to_all_async, "toroid_all_to_all_async");
    get(api.all_to_all_v, "toroid_all_to_all_v");
    get(api.all_to_all_v_async, "toroid_all_to_all_v_async");
    get(api.barrier, "toroid_barrier");
    get(api.barrier_async, "toroid_barrier_async");
    get(api.send, "toroid_send");
    get(api.send_async, "toroid_send_async");
    get(api.recv, "toroid_recv");
    get(api.recv_async, "toroid_recv_async");
    get(api.group_start, "toroid_group_start");
    get(api.group_end, "toroid_group_end");
    get(api.group_end_async, "toroid_group_end_async");
    get(api.work_wait, "toroid_work_wait");
    get(api.work_test, "toroid_work_test");
    get(api.work_free, "toroid_work_free");
    return api;
  }
};

// `text` as the exception torch raises for a backend's failure (DistBackendError).
inline std::exception_ptr backend_error(const std::string& text) {
  try {
    C10_THROW_ERROR(DistBackendError, text);
  } catch (...) {
    return std::current_exception();
  }
}

// A Python object released with the GIL held, whichever thread drops the last reference (a
// work can die on a thread of torch's that does not hold it).
struct PyRef {
  py::object obj;
  explicit PyRef(py::object o) : obj(std::move(o)) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() {
    if (!obj || !Py_IsInitialized()) {
      obj.release();  // (at interpreter exit: leaked, not freed without the GIL)
      return;
    }
    py::gil_scoped_acquire gil;
    obj = py::object();
  }
};

// What a failure looks like: the group's Python function that builds the exception its Python
// path raises (`_native_error(function, code, name)`: DistBackendError with gloo's wording, or
// toroid's own for refusals), so either path reports a failure in the same words.
struct Errors {
  std::shared_ptr<PyRef> make;

  // Raises the Python exception for `code` (the GIL is taken here).
  [[noreturn]] void raise(const char* function, int code, const char* name) const {
    py::gil_scoped_acquire gil;
    py::object exc = make->obj(function, code, name);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    throw py::error_already_set();
  }

  // The same failure as a C++ exception, for a future (torch raises it as DistBackendError).
  std::exception_ptr as_exception(const char* function, int code, const char* name) const {
    std::string text;
    {
      py::gil_scoped_acquire gil;
      try {
        text = py::str(make->obj(function, code, name));
      } catch (py::error_already_set& e) {
        text = std::string(name) + " failed (toroid result " + std::to_string(code) + ")";
      }
    }
    return backend_error(text);
  }
};

class CommState;

// What a call does after its toroid operation has run, on whichever thread finishes it: copies
// a staging buffer into the call's tensors (a list-form all-gather's). Empty for most calls.
using Then = std::function<void()>;

constexpr int kInternalError = 2;  // TOROID_INTERNAL_ERROR

// Runs a call's step after its operation (shapes and types were checked when it was issued, so
// a failure here is a bug: reported as toroid's internal error rather than thrown on a thread
// that cannot take it).
inline int run_then(const Then& then) noexcept {
  try {
    then();
    return 0;
  } catch (...) {
    return kInternalError;
  }
}

// The Work of an async toroid call: it keeps the call's tensors alive until the operation has
// run, frees the toroid work once it has, and has its future (made when first asked for)
// completed by the communicator's completion thread.
class ToroidWork : public Work {
 public:
  // `tensors`: the call's result (its future's value); `inputs`: the other tensors it reads
  // (a staging buffer among them); `then`: run once the operation has succeeded.
  ToroidWork(std::shared_ptr<CommState> comm, void* work, std::vector<at::Tensor> tensors,
             std::vector<at::Tensor> inputs, c10d::OpType type, const char* function, const char* name,
             Then then = {});
  ~ToroidWork() override;

  // Waits for the operation (timeout_ms < 0: the communicator's timeout; past a shorter one
  // toroid aborts the communicator, as at every deadline), frees the toroid work, and returns
  // its toroid result (again on every later call).
  int finish(int64_t timeout_ms);
  bool finished() const { return done_.load(std::memory_order_acquire); }
  // A call of a batch (_native_batch.hpp): its operation is the batch's, waited on through
  // `slot` (set before the work is shared, with a null toroid work).
  void set_slot(std::shared_ptr<BatchSlot> slot) { slot_ = std::move(slot); }
  // Whether the operation has run, without blocking.
  bool test();
  // Completes the future once the operation has run (the completion thread's part).
  void settle();

  bool isCompleted() override { return test(); }
  bool isSuccess() const override { return finished() && code_ == 0; }
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override { return tensors_; }
  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  // Waits for the toroid work, keeps its result and frees it (finish_mu_ held).
  void take(int64_t timeout_ms);

  std::shared_ptr<CommState> comm_;
  std::mutex finish_mu_;
  void* work_;  // the toroid work until finished, then null
  std::shared_ptr<BatchSlot> slot_;  // (a batch's call: its batch)
  std::atomic<bool> done_{false};
  int code_ = 0;
  std::vector<at::Tensor> tensors_;
  std::vector<at::Tensor> inputs_;  // (alive until the operation has run, as tensors_)
  Then then_;
  const char* function_;
  const char* name_;
  std::mutex future_mu_;  // guards the three below
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool settled_ = false;  // the future completed, its callbacks run
  std::thread::id settler_;  // the thread completing the future
  std::condition_variable settled_cv_;
};

// A Work for a blocking call that has already run (torch's dist.all_reduce waits on it).
class DoneWork : public Work {
 public:
  DoneWork(std::vector<at::Tensor> tensors, c10d::OpType type, int rank)
      : Work(rank, type), tensors_(std::move(tensors)) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
  std::vector<at::Tensor> result() override { return tensors_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future->markCompleted(c10::IValue(tensors_));
    return future;
  }

 private:
  std::vector<at::Tensor> tensors_;
};

// A work of the Python backend, for a call of an operation here that the C++ path does not take.
// (torch's own wrapper of a Python work, PyWorkHolder, forwards wait() and get_future() only:
// a Python caller of an async call would find it never completed.)
class PyWorkProxy : public Work {
 public:
  explicit PyWorkProxy(py::object work)
      : work_(work.cast<WorkPtr>()), py_(std::make_shared<PyRef>(std::move(work))) {}
  bool isCompleted() override { return call("is_completed").cast<bool>(); }
  bool isSuccess() const override { return call("is_success").cast<bool>(); }
  std::exception_ptr exception() const override {
    std::string text;
    {
      py::gil_scoped_acquire gil;
      py::object e = py_->obj.attr("exception")();
      if (e.is_none()) {
        return nullptr;
      }
      text = py::str(e);
    }
    return backend_error(text);
  }
  std::vector<at::Tensor> result() override {
    py::gil_scoped_acquire gil;
    return py_->obj.attr("result")().cast<std::vector<at::Tensor>>();
  }
  bool wait(std::chrono::milliseconds timeout) override { return work_->wait(timeout); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return work_->getFuture(); }

 private:
  py::object call(const char* method) const {
    py::gil_scoped_acquire gil;
    return py_->obj.attr(method)();
  }

  WorkPtr work_;
  std::shared_ptr<PyRef> py_;
};

constexpr size_t kTypes = 64;  // at::ScalarType values this module maps
constexpr size_t kOps = 16;    // c10d::ReduceOp::RedOpType values
// The operations this module takes, as the group's stats name them (take_counts).
enum Count : size_t {
  kAllReduce,
  kBroadcast,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kBarrier,
  kSend,
  kRecv,
  kReduce,
  kAllGatherList,
  kAllReduceCoalesced,
  kAllGatherCoalesced,
  kReduceScatterCoalesced,
  kGather,
  kScatter,
  kCounts
};
constexpr std::array<const char*, kCounts> kCountNames = {
    "allreduce", "broadcast", "all_gather_single", "reduce_scatter_single", "all_to_all_single", "barrier", "send",
    "recv", "reduce", "allgather", "allreduce_coalesced", "all_gather_coalesced", "reduce_scatter_coalesced", "gather",
    "scatter"};

// One toroid communicator as the torch group's backends see it: its handle (null once the
// group has released it), the toroid functions, the type and operator tables, the works still
// running, and the completion thread of their futures. Shared by the group's backends.
class CommState : public std::enable_shared_from_this<CommState> {
 public:
  CommState(uintptr_t handle, const Api& api, Errors errors, int rank)
      : handle_(reinterpret_cast<void*>(handle)), api_(api), errors_(std::move(errors)), rank_(rank) {
    types_.fill(-1);
    ops_.fill(-1);
  }

  void* handle() const { return handle_.load(std::memory_order_acquire); }
  const Api& api() const { return api_; }
  const Errors& errors() const { return errors_; }
  int rank() const { return rank_; }

  void set_type(at::ScalarType type, int code) {
    auto i = static_cast<size_t>(type);
    TORCH_CHECK(i < kTypes, "toroid native backend: a scalar type out of range");
    types_[i] = code;
  }
  void set_op(int op, int code) {
    TORCH_CHECK(op >= 0 && static_cast<size_t>(op) < kOps, "toroid native backend: an operator out of range");
    ops_[static_cast<size_t>(op)] = code;
  }
  int type_code(at::ScalarType type) const {
    auto i = static_cast<size_t>(type);
    return i < kTypes ? types_[i] : -1;
  }
  int op_code(const c10d::ReduceOp& op) const {
    auto i = static_cast<size_t>(op.op_);
    return i < kOps ? ops_[i] : -1;
  }

  // A wire type on the group (set_wire_dtype): its all-reduces are the Python path's.
  std::atomic<bool> wire{false};
  // Inside a coalescing block (batch_isend_irecv): its dense CPU sends and recvs wait in
  // `batch` for the block's end (_native_batch.hpp), the others are the Python path's.
  std::atomic<bool> coalescing{false};
  Batch batch;
  // Calls made here, by operation (the group's stats read and reset them).
  std::array<std::atomic<uint64_t>, kCounts> counts{};

  // Keeps an issued work until its operation has run (its tensors stay alive with it).
  void keep(const c10::intrusive_ptr<ToroidWork>& work) {
    std::lock_guard<std::mutex> lock(mu_);
    while (!inflight_.empty() && inflight_.front()->test()) {
      inflight_.pop_front();
    }
    inflight_.push_back(work);
  }

  // Hands a work whose future was asked for to the completion thread (started on first use).
  void complete_later(const c10::intrusive_ptr<ToroidWork>& work);

  // The group releases its communicator: no call takes this path any more; the completion
  // thread completes what it holds and stops. Called without the GIL.
  void detach() {
    handle_.store(nullptr, std::memory_order_release);
    if (forked()) {
      return;
    }
    std::thread thread;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
      cv_.notify_one();
      thread = std::move(thread_);
    }
    if (thread.joinable()) {
      if (thread.get_id() == std::this_thread::get_id()) {
        thread.detach();  // (a future's callback shut the group down: the thread ends by itself)
      } else {
        thread.join();
      }
    }
  }

  // After the communicator is destroyed (its operations have all stopped): drop the works.
  void release() {
    if (forked()) {
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    inflight_.clear();
  }

 private:
  // A process forked from the one that made this (a DataLoader worker that exits through
  // Python's teardown): the completion thread and the works are the parent's, and a lock may
  // have been copied held; the child leaves them alone.
  bool forked() const { return getpid() != pid_; }

  // The completion thread: toroid runs a communicator's operations in issue order, so waiting
  // for the works in that order completes each future as soon as its operation has run.
  void complete_in_order() {
    for (;;) {
      c10::intrusive_ptr<ToroidWork> work;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stopped_ || !queue_.empty(); });
        if (queue_.empty()) {
          return;
        }
        work = queue_.front();
        queue_.pop_front();
      }
      work->settle();
    }
  }

  std::atomic<void*> handle_;
  pid_t pid_ = getpid();
  Api api_;
  Errors errors_;
  int rank_;
  std::array<int, kTypes> types_{};
  std::array<int, kOps> ops_{};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<ToroidWork>> inflight_;
  std::deque<c10::intrusive_ptr<ToroidWork>> queue_;
  std::thread thread_;
  bool stopped_ = false;
};

ToroidWork::ToroidWork(std::shared_ptr<CommState> comm, void* work, std::vector<at::Tensor> tensors,
                       std::vector<at::Tensor> inputs, c10d::OpType type, const char* function, const char* name,
                       Then then)
    : Work(comm->rank(), type), comm_(std::move(comm)), work_(work), tensors_(std::move(tensors)),
      inputs_(std::move(inputs)), then_(std::move(then)), function_(function), name_(name) {}

ToroidWork::~ToroidWork() {
  // (only finished works are dropped, the communicator keeps the others: CommState::keep)
  if (work_ != nullptr) {
    comm_->api().work_free(work_);
  }
}

int ToroidWork::finish(int64_t timeout_ms) {
  std::lock_guard<std::mutex> lock(finish_mu_);
  if (!finished()) {
    take(timeout_ms);
  }
  return code_;
}

void ToroidWork::take(int64_t timeout_ms) {
  const Api& api = comm_->api();
  if (slot_ && !slot_->bound()) {
    code_ = kInvalidUsage;  // (waited on inside its coalescing block: not finished)
    return;
  }
  if (slot_) {
    code_ = slot_->finish(timeout_ms);
  } else {
    code_ = api.work_wait(work_, timeout_ms);
    api.work_free(work_);
  }
  work_ = nullptr;
  if (code_ == 0 && then_) {
    code_ = run_then(then_);
  }
  then_ = nullptr;
  inputs_.clear();  // (the operation has run: a staging buffer is freed here)
  done_.store(true, std::memory_order_release);
}

bool ToroidWork::test() {
  if (finished()) {
    return true;
  }
  std::unique_lock<std::mutex> lock(finish_mu_, std::try_to_lock);
  if (!lock.owns_lock() || (work_ == nullptr && !slot_)) {
    return finished();  // (another thread is finishing it)
  }
  int done = 0;
  if (slot_ ? !slot_->test() : (comm_->api().work_test(work_, &done) != 0 || done == 0)) {
    return false;
  }
  take(-1);  // (it has run: its result at once, so a future asked for from now on is complete)
  return true;
}

std::exception_ptr ToroidWork::exception() const {
  if (!finished() || code_ == 0) {
    return nullptr;
  }
  return comm_->errors().as_exception(function_, code_, name_);
}

bool ToroidWork::wait(std::chrono::milliseconds timeout) {
  if (timeout.count() > 0 && !finished()) {
    // gloo's Work.wait(timeout): past it, "Operation timed out!", and the operation stays
    // queued (a later wait can still complete it). The completion thread waits for it here,
    // without toroid's own deadline, which would abort the communicator.
    getFuture();
    std::unique_lock<std::mutex> lock(future_mu_);
    if (!settled_cv_.wait_for(lock, timeout, [this] { return settled_; })) {
      lock.unlock();
      // (formatted here: PyErr_Format has no %g)
      char message[256];
      std::snprintf(message, sizeof message,
                    "Operation timed out! toroid %s did not complete within %g s (Work.wait timeout; the operation "
                    "is still pending)",
                    name_, static_cast<double>(timeout.count()) / 1000.0);
      py::gil_scoped_acquire gil;
      PyErr_SetString(PyExc_RuntimeError, message);
      throw py::error_already_set();
    }
  }
  int code = finish(-1);
  {
    // A future's callbacks run before wait returns, as torch's works do (unless this is one of
    // them, on the completing thread).
    std::unique_lock<std::mutex> lock(future_mu_);
    if (future_ && settler_ != std::this_thread::get_id()) {
      settled_cv_.wait(lock, [this] { return settled_; });
    }
  }
  if (code != 0) {
    comm_->errors().raise(function_, code, name_);
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> ToroidWork::getFuture() {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(future_mu_);
    if (future_) {
      return future_;
    }
    future = future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  }
  auto self = c10::intrusive_ptr<ToroidWork>::reclaim_copy(this);
  if (finished()) {
    settle();
  } else {
    comm_->complete_later(self);
  }
  return future;
}

void ToroidWork::settle() {
  int code = finish(-1);
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(future_mu_);
    future = future_;
    settler_ = std::this_thread::get_id();
  }
  if (code == 0) {
    future->markCompleted(c10::IValue(tensors_));
  } else {
    future->setError(comm_->errors().as_exception(function_, code, name_));
  }
  {
    std::lock_guard<std::mutex> lock(future_mu_);
    settled_ = true;
  }
  settled_cv_.notify_all();
}

void CommState::complete_later(const c10::intrusive_ptr<ToroidWork>& work) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopped_) {
      if (!thread_.joinable()) {
        thread_ = std::thread([self = shared_from_this()] { self->complete_in_order(); });
      }
      queue_.push_back(work);
      cv_.notify_one();
      return;
    }
  }
  work->settle();  // (the group has shut down: settled here, once the operation has run)
}

}  // namespace toroid_native
