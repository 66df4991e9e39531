// toroid's torch backend in C++ (issue 36: "the torch backend's hot path in native code, as
// gloo's and oneCCL's bindings are, DDP's comm hook included").
//
// A ToroidBackend is the c10d Backend a toroid process group registers for its devices. torch's
// C++ ProcessGroup calls it without Python for the group's all_reduce and broadcast (from
// dist.all_reduce, DDP's reducer and its comm hooks, or a "cpu:toroid,cuda:nccl" group), and it
// takes the calls toroid can make as they are: one dense contiguous CPU tensor of a toroid type,
// a toroid operator, no timeout of the call's own, no wire type on the group. Blocking ones run
// on the caller's thread (toroid runs them there when the communicator is idle); async ones are
// queued on the communicator and come back as a Work whose future a completion thread of this
// module completes, in issue order, without the GIL. Every other call, and every other
// operation, goes to the group's Python backend (`inner`), as before.
//
// Built on first use against the torch that is imported (toroid/torch/_native.py compiles it
// with that torch's headers), so no torch ABI is frozen into the wheel. The toroid functions are
// reached through the addresses of the library the Python binding loaded (include/toroid.h).

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/extension.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

namespace {

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
  int (*work_wait)(void*, int64_t) = nullptr;
  int (*work_test)(void*, int*) = nullptr;
  void (*work_free)(void*) = nullptr;
};

template <typename F>
F fn(uintptr_t address) {
  TORCH_CHECK(address != 0, "toroid native backend: a toroid function address is null");
  return reinterpret_cast<F>(address);
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
    try {
      C10_THROW_ERROR(DistBackendError, text);
    } catch (...) {
      return std::current_exception();
    }
  }
};

class CommState;

// The Work of an async toroid call: it keeps the call's tensors alive until the operation has
// run, frees the toroid work once it has, and has its future (made when first asked for)
// completed by the communicator's completion thread.
class ToroidWork : public Work {
 public:
  ToroidWork(std::shared_ptr<CommState> comm, void* work, std::vector<at::Tensor> tensors, c10d::OpType type,
             const char* function, const char* name);
  ~ToroidWork() override;

  // Waits for the operation (timeout_ms < 0: the communicator's timeout; past a shorter one
  // toroid aborts the communicator, as at every deadline), frees the toroid work, and returns
  // its toroid result (again on every later call).
  int finish(int64_t timeout_ms);
  bool finished() const { return done_.load(std::memory_order_acquire); }
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
  std::atomic<bool> done_{false};
  int code_ = 0;
  std::vector<at::Tensor> tensors_;
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

constexpr size_t kTypes = 64;  // at::ScalarType values this module maps
constexpr size_t kOps = 16;    // c10d::ReduceOp::RedOpType values
enum Count : size_t { kAllReduce, kBroadcast, kCounts };

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
    std::lock_guard<std::mutex> lock(mu_);
    inflight_.clear();
  }

 private:
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
                       c10d::OpType type, const char* function, const char* name)
    : Work(comm->rank(), type), comm_(std::move(comm)), work_(work), tensors_(std::move(tensors)),
      function_(function), name_(name) {}

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
  code_ = api.work_wait(work_, timeout_ms);
  api.work_free(work_);
  work_ = nullptr;
  done_.store(true, std::memory_order_release);
}

bool ToroidWork::test() {
  if (finished()) {
    return true;
  }
  std::unique_lock<std::mutex> lock(finish_mu_, std::try_to_lock);
  if (!lock.owns_lock() || work_ == nullptr) {
    return finished();  // (another thread is finishing it)
  }
  int done = 0;
  if (comm_->api().work_test(work_, &done) != 0 || done == 0) {
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
      py::gil_scoped_acquire gil;
      PyErr_Format(PyExc_RuntimeError,
                   "Operation timed out! toroid %s did not complete within %g s (Work.wait timeout; the operation "
                   "is still pending)",
                   name_, static_cast<double>(timeout.count()) / 1000.0);
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

// The toroid type of one dense contiguous CPU tensor, or -1.
int dense_cpu(const CommState& comm, const std::vector<at::Tensor>& tensors) {
  if (tensors.size() != 1) {
    return -1;
  }
  const at::Tensor& t = tensors[0];
  if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided || !t.is_contiguous() || t.is_conj() ||
      t.is_neg()) {
    return -1;
  }
  return comm.type_code(t.scalar_type());
}

class ToroidBackend : public Backend {
 public:
  ToroidBackend(std::shared_ptr<CommState> comm, py::object inner, int rank, int size)
      : Backend(rank, size), comm_(std::move(comm)),
        inner_(inner.cast<c10::intrusive_ptr<Backend>>()),
        py_inner_(std::make_shared<PyRef>(std::move(inner))) {}

  // The group a shrink's backend keeps alive (torch holds only the backend of the new group).
  void own(py::object owner) { owner_ = std::make_shared<PyRef>(std::move(owner)); }

  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    void* handle = comm_->handle();
    int dtype = dense_cpu(*comm_, tensors);
    int op = comm_->op_code(opts.reduceOp);
    if (handle == nullptr || dtype < 0 || op < 0 || opts.timeout.count() > 0 || opts.sparseIndices.has_value() ||
        comm_->wire.load(std::memory_order_relaxed)) {
      return inner_->allreduce(tensors, opts);
    }
    comm_->counts[kAllReduce].fetch_add(1, std::memory_order_relaxed);
    void* buf = tensors[0].data_ptr();
    auto count = static_cast<size_t>(tensors[0].numel());
    const Api& api = comm_->api();
    if (!opts.asyncOp) {
      int code = api.all_reduce(handle, buf, buf, count, dtype, op);
      if (code != 0) {
        comm_->errors().raise("toroid_all_reduce", code, "allreduce");
      }
      return c10::make_intrusive<DoneWork>(tensors, c10d::OpType::ALLREDUCE, comm_->rank());
    }
    void* work = nullptr;
    int code = api.all_reduce_async(handle, buf, buf, count, dtype, op, &work);
    return issued(code, work, tensors, c10d::OpType::ALLREDUCE, "toroid_all_reduce_async", "allreduce");
  }

  WorkPtr broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    void* handle = comm_->handle();
    int dtype = dense_cpu(*comm_, tensors);
    if (handle == nullptr || dtype < 0 || opts.timeout.count() > 0 || opts.rootTensor != 0 || opts.rootRank < 0 ||
        opts.rootRank >= getSize()) {
      return inner_->broadcast(tensors, opts);
    }
    comm_->counts[kBroadcast].fetch_add(1, std::memory_order_relaxed);
    void* buf = tensors[0].data_ptr();
    auto count = static_cast<size_t>(tensors[0].numel());
    auto root = static_cast<int>(opts.rootRank);
    const Api& api = comm_->api();
    if (!opts.asyncOp) {
      int code = api.broadcast(handle, buf, buf, count, dtype, root);
      if (code != 0) {
        comm_->errors().raise("toroid_broadcast", code, "broadcast");
      }
      return c10::make_intrusive<DoneWork>(tensors, c10d::OpType::BROADCAST, comm_->rank());
    }
    void* work = nullptr;
    int code = api.broadcast_async(handle, buf, buf, count, dtype, root, &work);
    return issued(code, work, tensors, c10d::OpType::BROADCAST, "toroid_broadcast_async", "broadcast");
  }

  // Every other operation and property is the Python backend's.
  const std::string getBackendName() const override { return inner_->getBackendName(); }
  bool supportsSplitting() const override { return inner_->supportsSplitting(); }
  bool supportsCoalescing() const override { return inner_->supportsCoalescing(); }
  bool supportsShrinking() const override { return inner_->supportsShrinking(); }
  c10::intrusive_ptr<Backend> shrink(const std::vector<int64_t>& ranks, int flags,
                                     const c10::intrusive_ptr<Options>& opts) override {
    return inner_->shrink(ranks, flags, opts);
  }
  c10::intrusive_ptr<Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                    const c10::intrusive_ptr<Options>& opts) override {
    return inner_->split(store, ranks, opts);
  }
  void startCoalescing() override { inner_->startCoalescing(); }
  WorkPtr endCoalescing() override { return inner_->endCoalescing(); }
  WorkPtr allreduce_sparse(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    return inner_->allreduce_sparse(t, o);
  }
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& t, const c10d::AllreduceCoalescedOptions& o) override {
    return inner_->allreduce_coalesced(t, o);
  }
  WorkPtr reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override { return inner_->reduce(t, o); }
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                    const c10d::AllgatherOptions& o) override {
    return inner_->allgather(out, in, o);
  }
  WorkPtr all_gather_single(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override {
    return inner_->all_gather_single(out, in, o);
  }
  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                              const c10d::AllgatherOptions& o) override {
    return inner_->allgather_coalesced(out, in, o);
  }
  WorkPtr all_gather_single_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                      const c10d::AllgatherOptions& o) override {
    return inner_->all_gather_single_coalesced(out, in, o);
  }
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                 const c10d::GatherOptions& o) override {
    return inner_->gather(out, in, o);
  }
  WorkPtr gather_single(at::Tensor& out, at::Tensor& in, const c10d::GatherOptions& o) override {
    return inner_->gather_single(out, in, o);
  }
  WorkPtr scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                  const c10d::ScatterOptions& o) override {
    return inner_->scatter(out, in, o);
  }
  WorkPtr reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                         const c10d::ReduceScatterOptions& o) override {
    return inner_->reduce_scatter(out, in, o);
  }
  WorkPtr reduce_scatter_single(at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) override {
    return inner_->reduce_scatter_single(out, in, o);
  }
  WorkPtr reduce_scatter_single_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::ReduceScatterOptions& o) override {
    return inner_->reduce_scatter_single_coalesced(out, in, o);
  }
  WorkPtr all_to_all_single(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                            std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override {
    return inner_->all_to_all_single(out, in, out_splits, in_splits, o);
  }
  WorkPtr alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in, const c10d::AllToAllOptions& o) override {
    return inner_->alltoall(out, in, o);
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    inner_->monitoredBarrier(o, wait_all_ranks);
  }
  WorkPtr send(std::vector<at::Tensor>& t, int dst, int tag) override { return inner_->send(t, dst, tag); }
  WorkPtr recv(std::vector<at::Tensor>& t, int src, int tag) override { return inner_->recv(t, src, tag); }
  WorkPtr recvAnysource(std::vector<at::Tensor>& t, int tag) override { return inner_->recvAnysource(t, tag); }
  WorkPtr barrier(const c10d::BarrierOptions& o) override { return inner_->barrier(o); }
  void abort() override { inner_->abort(); }
  void shutdown() override { inner_->shutdown(); }

 private:
  // The Work of an async call just issued, or its refusal raised.
  WorkPtr issued(int code, void* work, std::vector<at::Tensor>& tensors, c10d::OpType type, const char* function,
                 const char* name) {
    if (code != 0) {
      comm_->errors().raise(function, code, name);
    }
    auto w = c10::make_intrusive<ToroidWork>(comm_, work, tensors, type, function, name);
    comm_->keep(w);
    return w;
  }

  std::shared_ptr<CommState> comm_;
  c10::intrusive_ptr<Backend> inner_;
  std::shared_ptr<PyRef> py_inner_;  // the Python object behind inner_, alive as long as this
  std::shared_ptr<PyRef> owner_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "toroid's torch backend in C++ (toroid/torch/_native.py builds and loads it)";
  py::class_<CommState, std::shared_ptr<CommState>>(m, "CommState")
      .def(py::init([](uintptr_t handle, const std::vector<uintptr_t>& addresses, py::object make_error, int rank) {
             TORCH_CHECK(addresses.size() == 7, "CommState: 7 toroid function addresses");
             Api api;
             api.all_reduce = fn<decltype(api.all_reduce)>(addresses[0]);
             api.all_reduce_async = fn<decltype(api.all_reduce_async)>(addresses[1]);
             api.broadcast = fn<decltype(api.broadcast)>(addresses[2]);
             api.broadcast_async = fn<decltype(api.broadcast_async)>(addresses[3]);
             api.work_wait = fn<decltype(api.work_wait)>(addresses[4]);
             api.work_test = fn<decltype(api.work_test)>(addresses[5]);
             api.work_free = fn<decltype(api.work_free)>(addresses[6]);
             return std::make_shared<CommState>(handle, api, Errors{std::make_shared<PyRef>(std::move(make_error))},
                                                rank);
           }),
           py::arg("handle"), py::arg("addresses"), py::arg("make_error"), py::arg("rank"))
      .def("set_type", &CommState::set_type)
      .def("set_op", &CommState::set_op)
      .def("set_wire", [](CommState& c, bool wire) { c.wire.store(wire); })
      .def("take_counts",
           [](CommState& c) {
             return py::make_tuple(c.counts[kAllReduce].exchange(0), c.counts[kBroadcast].exchange(0));
           })
      .def("detach", &CommState::detach, py::call_guard<py::gil_scoped_release>())
      .def("release", &CommState::release, py::call_guard<py::gil_scoped_release>());
  py::class_<ToroidBackend, Backend, c10::intrusive_ptr<ToroidBackend>>(m, "ToroidBackend")
      .def(py::init([](std::shared_ptr<CommState> comm, py::object inner, int rank, int size) {
             return c10::make_intrusive<ToroidBackend>(std::move(comm), std::move(inner), rank, size);
           }),
           py::arg("comm"), py::arg("inner"), py::arg("rank"), py::arg("size"))
      .def("_own", &ToroidBackend::own);
}
