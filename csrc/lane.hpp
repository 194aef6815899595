// Lanes: independent channels inside one generation of the ft backend.
//
// Each lane owns its own inner communicator, so an op stuck on one lane (say,
// behind a stopped peer) never delays an op issued on another. The lane an op
// runs on is chosen by the calling thread (set_current_lane / `ft.lane(k)`),
// so torch's own collective APIs reach the right lane without new arguments.
// An NCCL build adds `nccl`: the lane's NCCL communicator with its own CUDA
// stream and events (see nccl_comm.hpp). FtBackend::launch() picks `gloo` or
// `nccl` by the tensors' device; Generation::abort() aborts `nccl` too.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace ft {

struct Lane {
  int index = 0;
  // Inner Gloo communicator for CPU tensors.
  c10::intrusive_ptr<c10d::Backend> gloo;
  // Inner NCCL communicator for CUDA tensors (an ft::NcclLane); null in a
  // CPU-only build. Its abort() calls ncclCommAbort.
  c10::intrusive_ptr<c10d::Backend> nccl;
};

// The lane the calling thread's next op uses (thread-local, default 0).
int currentLane();
void setCurrentLane(int lane);

} // namespace ft
