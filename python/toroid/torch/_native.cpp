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

#include "_native_work.hpp"

namespace toroid_native {
namespace {

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

  py::object inner() const { return py_inner_->obj; }

  // The group a shrink's backend keeps alive (torch holds only the backend of the new group).
  void own(py::object owner) { owner_ = std::make_shared<PyRef>(std::move(owner)); }

  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    void* handle = comm_->handle();
    int dtype = dense_cpu(*comm_, tensors);
    int op = comm_->op_code(opts.reduceOp);
    if (handle == nullptr || dtype < 0 || op < 0 || opts.timeout.count() > 0 || opts.sparseIndices.has_value() ||
        comm_->wire.load(std::memory_order_relaxed)) {
      return python("allreduce", tensors, opts, c10d::OpType::ALLREDUCE);
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
      return python("broadcast", tensors, opts, c10d::OpType::BROADCAST);
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
  // The Python backend's call (the group's Python method), its work kept whole.
  template <typename Options>
  WorkPtr python(const char* method, std::vector<at::Tensor>& tensors, const Options& opts, c10d::OpType type) {
    py::gil_scoped_acquire gil;
    // (options copied: the Python side may keep them past this call)
    py::object work = py_inner_->obj.attr(method)(tensors, py::cast(opts, py::return_value_policy::copy));
    if (work.is_none()) {  // (a blocking call the Python path has made: _collectives._DONE)
      return c10::make_intrusive<DoneWork>(tensors, type, getRank());
    }
    return c10::make_intrusive<PyWorkProxy>(std::move(work));
  }

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
}  // namespace toroid_native

using namespace toroid_native;  // NOLINT(google-build-using-namespace): the module's own names

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
      .def("_own", &ToroidBackend::own)
      // The Python backend under it, and its toroid group (what a mixed group's user reaches
      // through torch's ProcessGroup._get_backend).
      .def_property_readonly("_inner", &ToroidBackend::inner)
      .def("_group", [](ToroidBackend& b) { return b.inner().attr("_group")(); });
}
