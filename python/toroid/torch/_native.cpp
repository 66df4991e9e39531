// toroid's torch backend in C++ (issue 36: "the torch backend's hot path in native code, as
// gloo's and oneCCL's bindings are, DDP's comm hook included").
//
// A ToroidBackend is the c10d Backend a toroid process group registers for its devices. torch's
// C++ ProcessGroup calls it without Python for the group's collectives, send and recv
// (NATIVE_OPS in _backend.py; from torch.distributed, DDP's reducer and its comm hooks, FSDP, or
// a "cpu:toroid,cuda:nccl" group), and it takes the calls toroid can make as they are: dense
// contiguous CPU tensors of a toroid type, a toroid operator, no timeout of the call's own, no
// wire type on the group. Blocking ones run
// on the caller's thread (toroid runs them there when the communicator is idle); async ones are
// queued on the communicator and come back as a Work whose future a completion thread of this
// module completes, in issue order, without the GIL. Every other call, and every other
// operation, goes to the group's Python backend (`inner`), as before.
//
// Built on first use against the torch that is imported (toroid/torch/_native.py compiles it
// with that torch's headers), so no torch ABI is frozen into the wheel. The toroid functions are
// reached through the addresses of the library the Python binding loaded (include/toroid.h).

#include "_native_work.hpp"

#include <optional>

namespace toroid_native {
namespace {

// The toroid type of a dense contiguous CPU tensor, or -1.
int dense_cpu(const CommState& comm, const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided || !t.is_contiguous() || t.is_conj() ||
      t.is_neg()) {
    return -1;
  }
  return comm.type_code(t.scalar_type());
}

// The same of a call's one tensor, or -1 for a call of several.
int dense_cpu(const CommState& comm, const std::vector<at::Tensor>& tensors) {
  return tensors.size() == 1 ? dense_cpu(comm, tensors[0]) : -1;
}

// The toroid type of an output and an input of the same type, or -1.
int dense_pair(const CommState& comm, const at::Tensor& out, const at::Tensor& in) {
  int type = dense_cpu(comm, in);
  return type >= 0 && dense_cpu(comm, out) == type ? type : -1;
}

// Whether `outs` are `size` CPU tensors of `in`'s type and element count, of any shape and
// strides (copied into or out of a staging buffer: a list-form all-gather's or a gather's
// outputs for `in`, a scatter's inputs for its output `in`).
bool outputs_of(const std::vector<at::Tensor>& outs, const at::Tensor& in, int size) {
  return outs.size() == static_cast<size_t>(size) && std::all_of(outs.begin(), outs.end(), [&](const at::Tensor& t) {
           return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && !t.is_conj() && !t.is_neg() &&
                  t.scalar_type() == in.scalar_type() && t.numel() == in.numel();
         });
}

// Whether `out` and `in` are pairs of a coalesced all-gather (`out_per_in` = size: each output
// is size x its input) or reduce-scatter (`in_per_out` = size): as many of each, every pair
// dense, contiguous and of one toroid type, of the operation's sizes.
bool pairs_of(const CommState& comm, const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& in,
              int64_t out_per_in, int64_t in_per_out) {
  if (out.size() != in.size()) {
    return false;
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (dense_pair(comm, out[i], in[i]) < 0 || out[i].numel() * in_per_out != in[i].numel() * out_per_in) {
      return false;
    }
  }
  return true;
}

// Makes `call(i)` for i in 0..n, stopping at the first failure; returns its toroid result.
template <typename Call>
int each(size_t n, Call call) {
  for (size_t i = 0; i < n; ++i) {
    int code = call(i);
    if (code != 0) {
      return code;
    }
  }
  return 0;
}

// The names of one operation: toroid's blocking and queued functions, and torch's.
struct Names {
  const char* blocking;
  const char* queued;
  const char* op;
};
constexpr Names kAllReduceNames{"toroid_all_reduce", "toroid_all_reduce_async", "allreduce"};
constexpr Names kBroadcastNames{"toroid_broadcast", "toroid_broadcast_async", "broadcast"};
constexpr Names kAllGatherNames{"toroid_all_gather", "toroid_all_gather_async", "all_gather_single"};
constexpr Names kReduceScatterNames{"toroid_reduce_scatter", "toroid_reduce_scatter_async", "reduce_scatter_single"};
constexpr Names kAllToAllNames{"toroid_all_to_all", "toroid_all_to_all_async", "all_to_all_single"};
constexpr Names kAllToAllVNames{"toroid_all_to_all_v", "toroid_all_to_all_v_async", "all_to_all_single"};
constexpr Names kBarrierNames{"toroid_barrier", "toroid_barrier_async", "barrier"};
// (send and recv are always queued: see point_to_point)
constexpr Names kSendNames{"toroid_send", "toroid_send_async", "send"};
constexpr Names kRecvNames{"toroid_recv", "toroid_recv_async", "recv"};
constexpr Names kReduceNames{"toroid_reduce", "toroid_reduce_async", "reduce"};
constexpr Names kAllGatherListNames{"toroid_all_gather", "toroid_all_gather_async", "allgather"};
constexpr Names kGatherNames{"toroid_all_to_all_v", "toroid_all_to_all_v_async", "gather"};
constexpr Names kScatterNames{"toroid_all_to_all_v", "toroid_all_to_all_v_async", "scatter"};
// (a group's calls are recorded, and run or queued by its end)
constexpr Names kAllReduceCoalescedNames{"toroid_group_end", "toroid_group_end_async", "allreduce_coalesced"};
constexpr Names kAllGatherCoalescedNames{"toroid_group_end", "toroid_group_end_async", "all_gather_coalesced"};
constexpr Names kReduceScatterCoalescedNames{"toroid_group_end", "toroid_group_end_async",
                                             "reduce_scatter_coalesced"};

class ToroidBackend : public Backend {
 public:
  ToroidBackend(std::shared_ptr<CommState> comm, py::object inner, int rank, int size)
      : Backend(rank, size), comm_(std::move(comm)),
        inner_(inner.cast<c10::intrusive_ptr<Backend>>()),
        py_inner_(std::make_shared<PyRef>(std::move(inner))) {}

  py::object inner() const { return py_inner_->obj; }

  // The group a shrink's backend keeps alive (torch holds only the backend of the new group).
  void own(py::object owner) { owner_ = std::make_shared<PyRef>(std::move(owner)); }

  // Each operation below takes the call toroid makes as it is (dense contiguous CPU tensors of
  // a toroid type, a toroid operator, no timeout of the call's own) and gives any other to the
  // Python backend, which also reports what is wrong with it in its own words.

  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    void* h = comm_->handle();
    int dtype = dense_cpu(*comm_, tensors);
    int op = comm_->op_code(opts.reduceOp);
    if (h == nullptr || dtype < 0 || op < 0 || opts.timeout.count() > 0 || opts.sparseIndices.has_value() ||
        comm_->wire.load(std::memory_order_relaxed)) {
      return python("allreduce", c10d::OpType::ALLREDUCE, tensors, tensors, opts);
    }
    void* buf = tensors[0].data_ptr();
    auto n = static_cast<size_t>(tensors[0].numel());
    const Api& api = comm_->api();
    return run(
        kAllReduce, kAllReduceNames, c10d::OpType::ALLREDUCE, opts.asyncOp, tensors, {},
        [&] { return api.all_reduce(h, buf, buf, n, dtype, op); },
        [&](void** w) { return api.all_reduce_async(h, buf, buf, n, dtype, op, w); });
  }

  WorkPtr broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    void* h = comm_->handle();
    int dtype = dense_cpu(*comm_, tensors);
    if (h == nullptr || dtype < 0 || opts.timeout.count() > 0 || opts.rootTensor != 0 || opts.rootRank < 0 ||
        opts.rootRank >= getSize()) {
      return python("broadcast", c10d::OpType::BROADCAST, tensors, tensors, opts);
    }
    void* buf = tensors[0].data_ptr();
    auto n = static_cast<size_t>(tensors[0].numel());
    auto root = static_cast<int>(opts.rootRank);
    const Api& api = comm_->api();
    return run(
        kBroadcast, kBroadcastNames, c10d::OpType::BROADCAST, opts.asyncOp, tensors, {},
        [&] { return api.broadcast(h, buf, buf, n, dtype, root); },
        [&](void** w) { return api.broadcast_async(h, buf, buf, n, dtype, root, w); });
  }

  // all_gather_into_tensor: `out` is size x `in`, rank r's piece at r (in place where `in` is
  // that piece of `out`, NCCL's form; toroid refuses other overlaps).
  WorkPtr all_gather_single(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& opts) override {
    void* h = comm_->handle();
    int dtype = dense_pair(*comm_, out, in);
    if (h == nullptr || dtype < 0 || opts.timeout.count() > 0 || out.numel() != in.numel() * getSize()) {
      return python("all_gather_single", c10d::OpType::_ALLGATHER_BASE, {out}, out, in, opts);
    }
    const void* src = in.data_ptr();
    void* dst = out.data_ptr();
    auto n = static_cast<size_t>(in.numel());
    const Api& api = comm_->api();
    return run(
        kAllGather, kAllGatherNames, c10d::OpType::_ALLGATHER_BASE, opts.asyncOp, {out}, {in},
        [&] { return api.all_gather(h, src, dst, n, dtype); },
        [&](void** w) { return api.all_gather_async(h, src, dst, n, dtype, w); });
  }

  // reduce_scatter_tensor: `in` is size x `out`; rank r receives piece r of the reduction.
  WorkPtr reduce_scatter_single(at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& opts) override {
    void* h = comm_->handle();
    int dtype = dense_pair(*comm_, out, in);
    int op = comm_->op_code(opts.reduceOp);
    if (h == nullptr || dtype < 0 || op < 0 || opts.timeout.count() > 0 || in.numel() != out.numel() * getSize()) {
      return python("reduce_scatter_single", c10d::OpType::_REDUCE_SCATTER_BASE, {out}, out, in, opts);
    }
    const void* src = in.data_ptr();
    void* dst = out.data_ptr();
    auto n = static_cast<size_t>(out.numel());
    const Api& api = comm_->api();
    return run(
        kReduceScatter, kReduceScatterNames, c10d::OpType::_REDUCE_SCATTER_BASE, opts.asyncOp, {out}, {in},
        [&] { return api.reduce_scatter(h, src, dst, n, dtype, op); },
        [&](void** w) { return api.reduce_scatter_async(h, src, dst, n, dtype, op, w); });
  }

  // all_to_all_single: block j of `in` goes to rank j, block i of `out` comes from rank i;
  // equal blocks where no splits are given, else toroid_all_to_all_v with the splits' rows.
  WorkPtr all_to_all_single(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                            std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& opts) override {
    void* h = comm_->handle();
    int dtype = dense_pair(*comm_, out, in);
    bool even = out_splits.empty() && in_splits.empty();
    if (h == nullptr || dtype < 0 || opts.timeout.count() > 0 ||
        (even && (in.numel() % getSize() != 0 || out.numel() != in.numel()))) {
      return python("all_to_all_single", c10d::OpType::ALLTOALL_BASE, {out}, out, in, out_splits, in_splits, opts);
    }
    if (!even) {
      return all_to_all_v(out, in, out_splits, in_splits, opts, dtype, h);
    }
    const void* src = in.data_ptr();
    void* dst = out.data_ptr();
    auto n = static_cast<size_t>(in.numel() / getSize());
    const Api& api = comm_->api();
    return run(
        kAllToAll, kAllToAllNames, c10d::OpType::ALLTOALL_BASE, opts.asyncOp, {out}, {in},
        [&] { return api.all_to_all(h, src, dst, n, dtype); },
        [&](void** w) { return api.all_to_all_async(h, src, dst, n, dtype, w); });
  }

  // all_to_all_single with splits (rows of dim 0; none: equal rows), as toroid_all_to_all_v
  // counts them (elements); anything it cannot count so goes to the Python path, which says
  // what is wrong.
  WorkPtr all_to_all_v(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                       std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& opts, int dtype, void* h) {
    std::vector<size_t> send, recv;
    // (out of place only: one tensor for both is the Python path's, which copies the input)
    bool apart = in.numel() == 0 || out.numel() == 0 || in.data_ptr() != out.data_ptr();
    bool counted = in.dim() > 0 && out.dim() > 0 && apart &&
                   rows(in, in_splits, send) && rows(out, out_splits, recv) &&
                   (in.size(0) == 0 || out.size(0) == 0 || in.numel() / in.size(0) == out.numel() / out.size(0));
    if (!counted) {
      return python("all_to_all_single", c10d::OpType::ALLTOALL_BASE, {out}, out, in, out_splits, in_splits, opts);
    }
    const void* src = in.data_ptr();
    void* dst = out.data_ptr();
    const Api& api = comm_->api();
    return run(
        kAllToAll, kAllToAllVNames, c10d::OpType::ALLTOALL_BASE, opts.asyncOp, {out}, {in},
        [&] { return api.all_to_all_v(h, src, send.data(), dst, recv.data(), dtype); },
        [&](void** w) { return api.all_to_all_v_async(h, src, send.data(), dst, recv.data(), dtype, w); });
  }

  // The element counts of `t`'s blocks: `splits` rows of dim 0 each (none: equal rows), which
  // must be `size` of them, not negative, and cover `t`.
  bool rows(const at::Tensor& t, const std::vector<int64_t>& splits, std::vector<size_t>& counts) const {
    int64_t n = getSize();
    int64_t rows = t.size(0);
    int64_t row = rows > 0 ? t.numel() / rows : 0;
    if (splits.empty()) {
      if (rows % n != 0) {
        return false;
      }
      counts.assign(static_cast<size_t>(n), static_cast<size_t>(rows / n * row));
      return true;
    }
    int64_t total = 0;
    for (int64_t s : splits) {
      if (s < 0 || s > rows) {
        return false;
      }
      total += s;
      counts.push_back(static_cast<size_t>(s * row));
    }
    return static_cast<int64_t>(splits.size()) == n && total == rows;
  }

  // reduce of one tensor, in place at the root (the others' tensors are only read).
  WorkPtr reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    void* h = comm_->handle();
    int dtype = dense_cpu(*comm_, tensors);
    int op = comm_->op_code(opts.reduceOp);
    if (h == nullptr || dtype < 0 || op < 0 || opts.timeout.count() > 0 || opts.rootTensor != 0 || opts.rootRank < 0 ||
        opts.rootRank >= getSize()) {
      return python("reduce", c10d::OpType::REDUCE, tensors, tensors, opts);
    }
    void* buf = tensors[0].data_ptr();
    auto n = static_cast<size_t>(tensors[0].numel());
    auto root = static_cast<int>(opts.rootRank);
    const Api& api = comm_->api();
    return run(
        kReduce, kReduceNames, c10d::OpType::REDUCE, opts.asyncOp, tensors, {},
        [&] { return api.reduce(h, buf, buf, n, dtype, op, root); },
        [&](void** w) { return api.reduce_async(h, buf, buf, n, dtype, op, root, w); });
  }

  // dist.all_gather: one input, a list of `size` outputs of its type and element count (any
  // shapes and strides, as gloo's). Gathered into one staging buffer, then copied out, as gloo
  // does; the copy runs after the operation (on the thread that finishes it).
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                    const c10d::AllgatherOptions& opts) override {
    void* h = comm_->handle();
    int dtype = dense_cpu(*comm_, inputs);
    if (h == nullptr || dtype < 0 || opts.timeout.count() > 0 || outputs.size() != 1 ||
        !outputs_of(outputs[0], inputs[0], getSize())) {
      return python("allgather", c10d::OpType::ALLGATHER, outputs.size() == 1 ? outputs[0] : std::vector<at::Tensor>{},
                    outputs, inputs, opts);
    }
    return gathered(kAllGatherList, kAllGatherListNames, c10d::OpType::ALLGATHER, opts.asyncOp, h, dtype, inputs[0],
                    outputs[0]);
  }

  // dist.gather: one toroid_all_to_all_v in which every rank sends its input to the root only
  // (the root receives `size` pieces into a staging buffer, then fills its list of outputs).
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::GatherOptions& opts) override {
    void* h = comm_->handle();
    int dtype = dense_cpu(*comm_, inputs);
    bool root = opts.rootRank == getRank();
    if (h == nullptr || dtype < 0 || opts.timeout.count() > 0 || !root_list(outputs, inputs[0], opts.rootRank)) {
      return python("gather", c10d::OpType::GATHER, outputs.size() == 1 ? outputs[0] : std::vector<at::Tensor>{},
                    outputs, inputs, opts);
    }
    const at::Tensor& in = inputs[0];
    auto n = static_cast<size_t>(in.numel());
    auto size = static_cast<size_t>(getSize());
    std::vector<size_t> send(size, 0), recv(size, root ? n : 0);
    send[static_cast<size_t>(opts.rootRank)] = n;
    at::Tensor staging = at::empty({root ? getSize() * in.numel() : 0}, in.options());
    std::vector<at::Tensor> outs = root ? outputs[0] : std::vector<at::Tensor>{};
    Then then = root ? copy_out(staging, n, outs, 0) : Then{};
    return rooted(kGather, kGatherNames, c10d::OpType::GATHER, opts.asyncOp, h, dtype, in.data_ptr(), send,
                  staging.data_ptr(), recv, std::move(outs), {in, staging}, std::move(then));
  }

  // dist.scatter: one toroid_all_to_all_v in which the root sends piece j to rank j (its
  // pieces copied into one staging buffer when the call is made); each rank receives its piece
  // into its output (through a buffer and a copy where the output is not contiguous).
  WorkPtr scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const c10d::ScatterOptions& opts) override {
    void* h = comm_->handle();
    int dtype = dense_cpu(*comm_, outputs);
    bool root = opts.rootRank == getRank();
    if (h == nullptr || dtype < 0 || opts.timeout.count() > 0 || !root_list(inputs, outputs[0], opts.rootRank)) {
      return python("scatter", c10d::OpType::SCATTER, outputs, outputs, inputs, opts);
    }
    at::Tensor out = outputs[0];
    auto n = static_cast<size_t>(out.numel());
    auto size = static_cast<size_t>(getSize());
    std::vector<size_t> send(size, root ? n : 0), recv(size, 0);
    recv[static_cast<size_t>(opts.rootRank)] = n;
    at::Tensor staging = at::empty({root ? getSize() * out.numel() : 0}, out.options());
    if (root && n > 0) {  // (empty pieces: nothing to copy, and their data may be null)
      size_t bytes = n * static_cast<size_t>(out.element_size());
      for (size_t r = 0; r < inputs[0].size(); ++r) {
        const at::Tensor& piece = inputs[0][r];
        if (piece.is_contiguous()) {
          std::memcpy(static_cast<char*>(staging.data_ptr()) + r * bytes, piece.data_ptr(), bytes);
        } else {
          staging.narrow(0, static_cast<int64_t>(r * n), static_cast<int64_t>(n)).view(piece.sizes()).copy_(piece);
        }
      }
    }
    bool direct = out.is_contiguous();
    at::Tensor into = direct ? out : at::empty({out.numel()}, out.options());
    Then then = direct ? Then{} : copy_out(into, n, {out}, 0);
    return rooted(kScatter, kScatterNames, c10d::OpType::SCATTER, opts.asyncOp, h, dtype, staging.data_ptr(), send,
                  into.data_ptr(), recv, outputs, {staging, into}, std::move(then));
  }

  // allreduce_coalesced (dist.all_reduce_coalesced, torch's _coalescing_manager): one in-place
  // all-reduce per tensor, all of one type, as one toroid group.
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    void* h = comm_->handle();
    int dtype = tensors.empty() ? -1 : dense_cpu(*comm_, tensors[0]);
    int op = comm_->op_code(opts.reduceOp);
    bool same = std::all_of(tensors.begin(), tensors.end(),
                            [&](const at::Tensor& t) { return dense_cpu(*comm_, t) == dtype; });
    if (h == nullptr || dtype < 0 || !same || op < 0 || opts.timeout.count() > 0 ||
        comm_->wire.load(std::memory_order_relaxed)) {
      return python("allreduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, tensors, tensors, opts);
    }
    const Api& api = comm_->api();
    return grouped(kAllReduceCoalesced, kAllReduceCoalescedNames, c10d::OpType::ALLREDUCE_COALESCED, opts.asyncOp,
                   tensors, {}, h, [&] {
                     return each(tensors.size(), [&](size_t i) {
                       void* buf = tensors[i].data_ptr();
                       return api.all_reduce(h, buf, buf, static_cast<size_t>(tensors[i].numel()), dtype, op);
                     });
                   });
  }

  // all_gather_into_tensor in a coalescing block (FSDP1's, torch's _coalescing_manager): one
  // all_gather_single per pair, as one toroid group.
  WorkPtr all_gather_single_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                      const c10d::AllgatherOptions& opts) override {
    void* h = comm_->handle();
    if (h == nullptr || opts.timeout.count() > 0 || !pairs_of(*comm_, out, in, getSize(), 1)) {
      return python("all_gather_single_coalesced", c10d::OpType::COALESCED, out, out, in, opts);
    }
    const Api& api = comm_->api();
    return grouped(kAllGatherCoalesced, kAllGatherCoalescedNames, c10d::OpType::COALESCED, opts.asyncOp, out, in, h,
                   [&] {
                     return each(out.size(), [&](size_t i) {
                       return api.all_gather(h, in[i].data_ptr(), out[i].data_ptr(),
                                             static_cast<size_t>(in[i].numel()), dense_cpu(*comm_, in[i]));
                     });
                   });
  }

  // reduce_scatter_tensor in a coalescing block: one reduce_scatter_single per pair, one group.
  WorkPtr reduce_scatter_single_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::ReduceScatterOptions& opts) override {
    void* h = comm_->handle();
    int op = comm_->op_code(opts.reduceOp);
    if (h == nullptr || op < 0 || opts.timeout.count() > 0 || !pairs_of(*comm_, out, in, 1, getSize())) {
      return python("reduce_scatter_single_coalesced", c10d::OpType::COALESCED, out, out, in, opts);
    }
    const Api& api = comm_->api();
    return grouped(kReduceScatterCoalesced, kReduceScatterCoalescedNames, c10d::OpType::COALESCED, opts.asyncOp, out,
                   in, h, [&] {
                     return each(out.size(), [&](size_t i) {
                       return api.reduce_scatter(h, in[i].data_ptr(), out[i].data_ptr(),
                                                 static_cast<size_t>(out[i].numel()), dense_cpu(*comm_, in[i]), op);
                     });
                   });
  }

  // send and recv of one tensor (torch's tag is not toroid's: messages between two ranks arrive
  // in order, as the Python path has them), always queued: torch waits on the Work (dist.send),
  // and a wait that finds it not yet started runs it on the waiting thread.
  WorkPtr send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return point_to_point(kSend, tensors, dst, tag);
  }

  WorkPtr recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return point_to_point(kRecv, tensors, src, tag);
  }

  WorkPtr barrier(const c10d::BarrierOptions& opts) override {
    void* h = comm_->handle();
    if (h == nullptr || opts.timeout.count() > 0) {
      return python("barrier", c10d::OpType::BARRIER, {}, opts);
    }
    const Api& api = comm_->api();
    return run(
        kBarrier, kBarrierNames, c10d::OpType::BARRIER, opts.asyncOp, {}, {}, [&] { return api.barrier(h); },
        [&](void** w) { return api.barrier_async(h, w); });
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
  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                              const c10d::AllgatherOptions& o) override {
    return inner_->allgather_coalesced(out, in, o);
  }
  WorkPtr gather_single(at::Tensor& out, at::Tensor& in, const c10d::GatherOptions& o) override {
    return inner_->gather_single(out, in, o);
  }
  WorkPtr reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                         const c10d::ReduceScatterOptions& o) override {
    return inner_->reduce_scatter(out, in, o);
  }
  WorkPtr alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in, const c10d::AllToAllOptions& o) override {
    return inner_->alltoall(out, in, o);
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    inner_->monitoredBarrier(o, wait_all_ranks);
  }
  WorkPtr recvAnysource(std::vector<at::Tensor>& t, int tag) override { return inner_->recvAnysource(t, tag); }
  void abort() override { inner_->abort(); }
  void shutdown() override { inner_->shutdown(); }

 private:
  // One toroid call: blocking (`now()`) on the caller's thread, where toroid runs it when the
  // communicator is idle, as a completed Work; or queued (`queue(&work)`) as a ToroidWork.
  // `tensors` are the call's result, `inputs` the other tensors it reads; `then` runs once the
  // operation has succeeded.
  template <typename Now, typename Queue>
  WorkPtr run(Count count, const Names& names, c10d::OpType type, bool async_op, std::vector<at::Tensor> tensors,
              std::vector<at::Tensor> inputs, Now now, Queue queue, Then then = {}) {
    if (async_op) {
      return queued(count, names, type, std::move(tensors), std::move(inputs), queue, std::move(then));
    }
    comm_->counts[count].fetch_add(1, std::memory_order_relaxed);
    int code = now();
    if (code == 0 && then) {
      code = run_then(then);
    }
    if (code != 0) {
      comm_->errors().raise(names.blocking, code, names.op);
    }
    return c10::make_intrusive<DoneWork>(std::move(tensors), type, comm_->rank());
  }

  // The queued form alone (`queue(&work)`), as a ToroidWork; a call that queued nothing (an
  // empty group) as a completed Work.
  template <typename Queue>
  WorkPtr queued(Count count, const Names& names, c10d::OpType type, std::vector<at::Tensor> tensors,
                 std::vector<at::Tensor> inputs, Queue queue, Then then = {}) {
    comm_->counts[count].fetch_add(1, std::memory_order_relaxed);
    void* work = nullptr;
    int code = queue(&work);
    if (code != 0) {
      comm_->errors().raise(names.queued, code, names.op);
    }
    if (work == nullptr) {
      return c10::make_intrusive<DoneWork>(std::move(tensors), type, comm_->rank());
    }
    auto w = c10::make_intrusive<ToroidWork>(comm_, work, std::move(tensors), std::move(inputs), type, names.queued,
                                             names.op, std::move(then));
    comm_->keep(w);
    return w;
  }

  // Several calls as one toroid group (NCCL's ncclGroupStart/End: toroid packs consecutive
  // small all-reduces into one): `record()` makes the blocking calls, which the open group
  // records; the group's end runs them (blocking) or queues them as one work. The group is
  // closed whatever `record` returns, so every rank queues what it recorded.
  template <typename Record>
  WorkPtr grouped(Count count, const Names& names, c10d::OpType type, bool async_op, std::vector<at::Tensor> tensors,
                  std::vector<at::Tensor> inputs, void* h, Record record) {
    const Api& api = comm_->api();
    auto in_group = [&](auto end) {
      int code = api.group_start(h);
      if (code != 0) {
        return code;
      }
      int recorded = record();
      code = end();
      return recorded != 0 ? recorded : code;
    };
    return run(
        count, names, type, async_op, std::move(tensors), std::move(inputs),
        [&] { return in_group([&] { return api.group_end(h); }); },
        [&](void** w) { return in_group([&] { return api.group_end_async(h, w); }); });
  }

  // Whether `lists` is a rooted call's list of pieces for `like` (a gather's outputs, a
  // scatter's inputs): one list of `size` (outputs_of) at the root `root_rank`, which must be a
  // rank, and none elsewhere.
  bool root_list(const std::vector<std::vector<at::Tensor>>& lists, const at::Tensor& like, int64_t root_rank) const {
    if (root_rank < 0 || root_rank >= getSize()) {
      return false;
    }
    if (root_rank != getRank()) {
      return lists.empty();
    }
    return lists.size() == 1 && outputs_of(lists[0], like, getSize());
  }

  // The list-form all-gather: `in` gathered into a staging buffer of `size` pieces, copied
  // into `outs` after the operation.
  WorkPtr gathered(Count count, const Names& names, c10d::OpType type, bool async_op, void* h, int dtype,
                   const at::Tensor& in, std::vector<at::Tensor> outs) {
    at::Tensor staging = at::empty({getSize() * in.numel()}, in.options());
    const void* src = in.data_ptr();
    void* dst = staging.data_ptr();
    auto n = static_cast<size_t>(in.numel());
    const Api& api = comm_->api();
    Then then = copy_out(staging, n, outs, 0);
    return run(
        count, names, type, async_op, std::move(outs), {in, staging},
        [&] { return api.all_gather(h, src, dst, n, dtype); },
        [&](void** w) { return api.all_gather_async(h, src, dst, n, dtype, w); }, std::move(then));
  }

  // A gather's or scatter's toroid_all_to_all_v from `src` by `send` counts into `dst` by
  // `recv` counts (elements per rank; the vectors are read before the call returns).
  WorkPtr rooted(Count count, const Names& names, c10d::OpType type, bool async_op, void* h, int dtype,
                 const void* src, const std::vector<size_t>& send, void* dst, const std::vector<size_t>& recv,
                 std::vector<at::Tensor> result, std::vector<at::Tensor> keep, Then then) {
    const Api& api = comm_->api();
    return run(
        count, names, type, async_op, std::move(result), std::move(keep),
        [&] { return api.all_to_all_v(h, src, send.data(), dst, recv.data(), dtype); },
        [&](void** w) { return api.all_to_all_v_async(h, src, send.data(), dst, recv.data(), dtype, w); },
        std::move(then));
  }

  // Copies pieces `first`, `first + 1`, ... of `n` elements of `staging` into `outs`: plainly
  // where an output is contiguous, else through torch's copy (any shape and strides).
  static Then copy_out(at::Tensor staging, size_t n, std::vector<at::Tensor> outs, size_t first) {
    return [staging = std::move(staging), n, outs = std::move(outs), first] {
      size_t bytes = n * static_cast<size_t>(staging.element_size());
      if (bytes == 0) {
        return;  // (empty outputs: nothing to copy, and their data may be null)
      }
      const char* from = static_cast<const char*>(staging.data_ptr());
      for (size_t i = 0; i < outs.size(); ++i) {
        at::Tensor out = outs[i];
        size_t piece = first + i;
        if (out.is_contiguous()) {  // (the usual case: a plain copy, without torch's dispatch)
          std::memcpy(out.data_ptr(), from + piece * bytes, bytes);
        } else {
          out.copy_(staging.narrow(0, static_cast<int64_t>(piece * n), static_cast<int64_t>(n)).view(out.sizes()));
        }
      }
    };
  }

  // A send (`kind` kSend) or recv (kRecv) with `peer`; inside a coalescing block
  // (batch_isend_irecv) kept for the block's end, which runs the block as one toroid group
  // (_native_batch.hpp; a tensor this path does not take sends it and the rest of the block to
  // the Python path).
  WorkPtr point_to_point(Count kind, std::vector<at::Tensor>& tensors, int peer, int tag) {
    bool sending = kind == kSend;
    c10d::OpType type = sending ? c10d::OpType::SEND : c10d::OpType::RECV;
    void* h = comm_->handle();
    int dtype = dense_cpu(*comm_, tensors);
    bool takes = h != nullptr && dtype >= 0;
    void* buf = takes ? tensors[0].data_ptr() : nullptr;
    auto n = takes ? static_cast<size_t>(tensors[0].numel()) : 0;
    if (comm_->coalescing.load(std::memory_order_relaxed)) {
      if (takes && peer >= 0 && peer < getSize() && peer != getRank()) {
        if (auto slot = comm_->batch.add({sending, buf, n, dtype, peer})) {
          comm_->counts[kind].fetch_add(1, std::memory_order_relaxed);
          auto w = c10::make_intrusive<ToroidWork>(comm_, nullptr, tensors, std::vector<at::Tensor>{}, type,
                                                   "toroid_group_end_async", sending ? "send" : "recv");
          w->set_slot(std::move(slot));
          comm_->keep(w);
          return w;
        }
      }
      comm_->batch.to_python();
      takes = false;
    }
    if (!takes) {
      return python(sending ? "send" : "recv", type, tensors, tensors, peer, tag);
    }
    const Api& api = comm_->api();
    return queued(
        kind, sending ? kSendNames : kRecvNames, type, tensors, {}, [&](void** w) {
          return sending ? api.send_async(h, buf, n, dtype, peer, w) : api.recv_async(h, buf, n, dtype, peer, w);
        });
  }

  // The Python backend's call (the group's Python method) of `method` with `args`, its work
  // kept whole; `result`: the Work's result where that method has made a blocking call (it
  // returns None, _collectives._DONE).
  template <typename... Args>
  WorkPtr python(const char* method, c10d::OpType type, std::vector<at::Tensor> result, const Args&... args) {
    py::gil_scoped_acquire gil;
    // (copies: the Python side may keep the options past this call)
    py::object work = py_inner_->obj.attr(method)(py::cast(args, py::return_value_policy::copy)...);
    if (work.is_none()) {
      return c10::make_intrusive<DoneWork>(std::move(result), type, getRank());
    }
    return c10::make_intrusive<PyWorkProxy>(std::move(work));
  }

  std::shared_ptr<CommState> comm_;
  c10::intrusive_ptr<Backend> inner_;
  std::shared_ptr<PyRef> py_inner_;  // the Python object behind inner_, alive as long as this
  std::shared_ptr<PyRef> owner_;
};

// What a coalescing block's calls on the Python path wait on: the block's slot.
struct BatchWait {
  std::shared_ptr<BatchSlot> slot;
  std::shared_ptr<CommState> comm;

  // (timeout: seconds, None for the communicator's; raises the batch's failure)
  void wait(std::optional<double> timeout) const {
    int64_t ms = timeout ? static_cast<int64_t>(std::max(0.0, *timeout) * 1000.0) : -1;
    int code = 0;
    {
      py::gil_scoped_release release;
      code = slot->finish(ms);
    }
    if (code != 0) {
      comm->errors().raise("toroid_group_end_async", code, "batch_isend_irecv");
    }
  }
};

// Ends a coalescing block: one toroid group of the calls the C++ path kept (in issue order),
// then those `record()` records (the Python path's, after them in issue order too; it returns
// the tensors they read and write), queued as one toroid work bound to the block's slot, which
// every Work of the block waits on (None for a block that queued nothing). The group is ended
// whatever fails, so every rank queues what it recorded; a failure is then raised (and
// reported by every Work of the block).
py::object end_batch(const std::shared_ptr<CommState>& comm, const py::function& record) {
  const Api& api = comm->api();
  comm->coalescing.store(false);
  auto ended = comm->batch.end(api.work_fns());
  std::vector<Batch::Call>& calls = ended.first;
  std::shared_ptr<BatchSlot>& slot = ended.second;
  void* h = comm->handle();
  int code = h == nullptr ? kInvalidUsage : api.group_start(h);
  if (code != 0) {
    slot->bind(nullptr, code);
    comm->errors().raise("toroid_group_start", code, "batch_isend_irecv");
  }
  for (const Batch::Call& c : calls) {
    int r = c.sending ? api.send(h, c.buf, c.count, c.dtype, c.peer) : api.recv(h, c.buf, c.count, c.dtype, c.peer);
    code = code != 0 ? code : r;
  }
  py::object keep;
  std::exception_ptr raised;
  try {
    keep = record();
  } catch (py::error_already_set&) {
    raised = std::current_exception();
  }
  void* work = nullptr;
  int end = api.group_end_async(h, &work);
  code = code != 0 ? code : end;
  {
    py::gil_scoped_release release;  // (a failed batch is waited for here: its calls ran)
    slot->bind(work, raised && code == 0 ? kInvalidUsage : code);
  }
  if (!keep.is_none()) {  // (the Python path's tensors, alive until the batch has run)
    auto keeper = c10::make_intrusive<ToroidWork>(comm, nullptr, keep.cast<std::vector<at::Tensor>>(),
                                                  std::vector<at::Tensor>{}, c10d::OpType::COALESCED,
                                                  "toroid_group_end_async", "batch_isend_irecv");
    keeper->set_slot(slot);
    comm->keep(keeper);
  }
  if (raised) {
    std::rethrow_exception(raised);
  }
  if (code != 0) {
    comm->errors().raise("toroid_group_end_async", code, "batch_isend_irecv");
  }
  if (work == nullptr) {
    return py::none();  // (an empty block: nothing was queued)
  }
  return py::cast(BatchWait{slot, comm});
}

}  // namespace
}  // namespace toroid_native

using namespace toroid_native;  // NOLINT(google-build-using-namespace): the module's own names

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "toroid's torch backend in C++ (toroid/torch/_native.py builds and loads it)";
  py::class_<CommState, std::shared_ptr<CommState>>(m, "CommState")
      .def(py::init([](uintptr_t handle, const std::map<std::string, uintptr_t>& addresses, py::object make_error,
                       int rank) {
             return std::make_shared<CommState>(handle, Api::from(addresses),
                                                Errors{std::make_shared<PyRef>(std::move(make_error))}, rank);
           }),
           py::arg("handle"), py::arg("addresses"), py::arg("make_error"), py::arg("rank"))
      .def("set_type", &CommState::set_type)
      .def("set_op", &CommState::set_op)
      .def("set_wire", [](CommState& c, bool wire) { c.wire.store(wire); })
      .def("set_coalescing",
           [](CommState& c, bool on) {
             if (on) {
               c.batch.begin(c.api().work_fns());
             }
             c.coalescing.store(on);
           })
      .def("end_batch", &end_batch, py::arg("record"))
      // A block given up before its end (a call of it could not be issued): nothing of it runs,
      // and its Works report it.
      .def("drop_batch",
           [](CommState& c) {
             c.coalescing.store(false);
             c.batch.end(c.api().work_fns()).second->bind(nullptr, kInvalidUsage);
           })
      // The calls made here since the last take, by the group's stats names.
      .def("take_counts",
           [](CommState& c) {
             py::dict counts;
             for (size_t i = 0; i < kCounts; ++i) {
               counts[kCountNames[i]] = c.counts[i].exchange(0);
             }
             return counts;
           })
      .def("detach", &CommState::detach, py::call_guard<py::gil_scoped_release>())
      .def("release", &CommState::release, py::call_guard<py::gil_scoped_release>());
  py::class_<BatchWait>(m, "BatchWait")
      .def("wait", &BatchWait::wait, py::arg("timeout") = py::none())
      .def("test", [](const BatchWait& w) { return w.slot->test(); });
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
