//! The verbs on a real device through `sideway` (cargo feature `rdma`): not written yet.
