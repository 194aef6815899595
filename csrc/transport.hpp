// Transport: how one kind of tensor (CPU, CUDA) reaches the peers, on every
// lane of one generation. The core (FtBackend, Generation) sees only this
// interface; gloo_comm.cpp and nccl_comm.cpp implement it (docs/design.md,
// "Abort and generations").
//
// Contract:
//  * makeTransports() (transport.cpp) is the one place that knows which
//    transports this build has: Gloo for CPU tensors always, NCCL for CUDA
//    tensors in an NCCL build. It returns them connected as far as each
//    connects when built (Gloo: every lane; NCCL: none yet).
//  * serves(device): whether ops on tensors of `device` run here; at most one
//    transport serves a device.
//  * connect(device, deadline) creates every lane's communicator on `device`
//    now (a no-op for a transport that connected when built). Throws if the
//    peers do not all arrive by `deadline`.
//  * run(lane, issue, deadline) issues one op on lane `lane`'s communicator and
//    returns its inner Work. `deadline` is the op's own (its FtWork's). The
//    backend's watchdog alone decides that an op is late; whatever run() waits
//    for while issuing (a lazy connect, a non-blocking call settling) gives
//    up at that same deadline, not at one of its own.
//  * hostStaged(lane, device, deadline) readies lane `lane` for an op on
//    `device` (connecting it, bounded by `deadline`, as run() would) and says
//    whether that lane's ops must run host-staged on the CPU transport
//    instead (host_staging.hpp): a CUDA transport whose communicator would
//    put two ranks on one GPU says so. Throws as run() does, or ValueError
//    when the job refuses to share GPUs.
//  * failedBy(error): whether `error`, thrown by run(), means the transport
//    itself failed (the generation is then unusable), rather than that the op
//    was refused before anything was sent.
//  * Aborting takes two steps; both are idempotent, callable from any thread
//    and never throw:
//      sever()  before the generation fails its in-flight works: stops, without
//               blocking, whatever could still write into a caller's tensor
//               (Gloo shuts its sockets down);
//      abort()  after: ends the communicators, and waits (bounded) until none
//               of their work can still write into a caller's tensor. It may
//               block (ncclCommAbort).
//    closeIfIdle() refuses later ops and says whether nothing of this
//    transport can still touch a caller's tensor; abort() may then wait for
//    the Reaper.
//  * A transport owns its communicators and their threads; destroying it
//    releases them (joining the threads). Only the Reaper destroys one: a
//    communicator must never be destroyed on one of its own threads.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <vector>

namespace ft {

using Clock = std::chrono::steady_clock;

// An op as every transport runs it: one call on the lane's inner communicator.
using Issue =
    std::function<c10::intrusive_ptr<c10d::Work>(c10d::Backend& inner)>;

class Transport {
 public:
  virtual ~Transport() = default;

  // Names the transport in errors ("Gloo", "NCCL").
  virtual const char* name() const = 0;
  virtual bool serves(const c10::Device& device) const = 0;
  virtual void connect(int device, Clock::time_point deadline) = 0;
  virtual c10::intrusive_ptr<c10d::Work>
  run(int lane, const Issue& issue, Clock::time_point deadline) = 0;
  virtual bool hostStaged(
      int /*lane*/,
      const c10::Device& /*device*/,
      Clock::time_point /*deadline*/) {
    return false;
  }
  virtual bool failedBy(const std::exception_ptr& error) const = 0;

  virtual void sever() noexcept = 0;
  virtual bool closeIfIdle() noexcept = 0;
  virtual void abort() noexcept = 0;

  // Sockets the transport holds (leak checks); 0 where it holds none.
  virtual size_t socketCount() const {
    return 0;
  }
};

using Transports = std::vector<std::shared_ptr<Transport>>;

// One generation's transports: `numLanes` lanes under `store` (which carries
// the generation's prefix), as `rank` of `size`, and what they are told
// beyond that. Every transport maker takes this.
struct TransportSpec {
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  int size = 0;
  int numLanes = 1;
  // How long a transport that connects when built waits for its peers.
  std::chrono::milliseconds timeout{0};
  // Ranks of one communicator on one GPU: carry its CUDA ops host-staged over
  // Gloo (true), or refuse them with a ValueError (false).
  bool hostStageSharedGpu = true;
};

// Every transport this build has, for one generation. Blocks until the
// transports that connect when built have connected, or `spec.timeout`
// passes (then throws).
Transports makeTransports(const TransportSpec& spec);

// Argument checks that depend on the transports this build has (ValueError):
// a tensor's device, and the CUDA device a backend may connect eagerly to.
void checkTensorDevice(const at::Tensor& t, const char* op);
void checkCudaDeviceSupported(int device);

} // namespace ft
