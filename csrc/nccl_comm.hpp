// CUDA transport: one NCCL communicator per lane, owned by ft through the
// NCCL API (not torch's ProcessGroupNCCL), with its own CUDA stream and
// events. Compiled only in an NCCL build (FT_USE_NCCL).
//
// Contract:
//  * makeNcclTransport() is the CUDA tensors' Transport (transport.hpp): one
//    NcclLane per lane. An NcclLane is a c10d::Backend, so the op adapters'
//    calls (Issue) run on it as on a Gloo communicator.
//  * Before creating it, connect() publishes this rank's GPU UUID under
//    "dev/<rank>" and reads every rank's: ranks on one GPU make the lane
//    host-staged (see hostStaged()) instead.
//  * The communicator is created by connect(): eagerly by configure() when
//    the backend has a CUDA device, else on the lane's first CUDA op. The
//    init is non-blocking (ncclCommInitRankConfig with blocking = 0) and is
//    polled against a deadline; the unique id travels through the
//    generation's store prefix (key "uid" under "nccl<lane>/").
//  * One deadline: an op waits (a lazy connect, a call settling, a blocking
//    wait()) against the deadline NcclTransport::run() was given, its
//    FtWork's, so a per-op timeout and set_timeout() reach the lane. The lane
//    keeps no timeout of its own; the backend's watchdog decides an op is
//    late, and the lane gives up at that same moment.
//  * abort() (any thread, idempotent) stops the communicator: with
//    ncclCommRevoke where the linked NCCL has it (2.28.7 and later), waiting
//    only until the communicator is quiescent, the teardown (ncclCommAbort,
//    about a second of proxy-thread joins) left to the lane's destruction on
//    the Reaper; else with ncclCommAbort in place, also on a communicator
//    whose init is still in progress. Nothing is issued on the lane
//    afterwards. It then waits (bounded, kAbortDrainBound) until the lane
//    stream is empty: work queued behind the stopped kernels, such as an
//    allgather's copy-out, would otherwise write into the caller's outputs
//    after abort() returned. The generation calls it (through the transport)
//    on abort, on a missed deadline and on reconfigure.
//  * Stream semantics: an op records an event on the caller's current
//    stream, makes the lane stream wait on it, runs on the lane stream, and
//    records a completion event there. Tensors are recordStream()ed on the
//    lane stream. The returned Work's wait() makes the caller's current stream
//    wait on the completion event (it does not block the CPU); synchronize()
//    blocks. A barrier's wait() blocks.
//  * A poller thread per lane watches the completion events and
//    ncclCommGetAsyncError, and completes each op's future (an error if the
//    communicator failed or was aborted). Ops on one lane never wait behind
//    another lane: each has its own communicator, stream and poller.
//
// This header carries no NCCL or CUDA types, so backend.cpp and bindings.cpp
// stay light.
#pragma once

#ifdef FT_USE_NCCL

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "c10d_ops.hpp"
#include "transport.hpp"

namespace ft {

// NCCL_VERSION_CODE of the linked library (ncclGetVersion), e.g. 23007.
int ncclLinkedVersion();
// Whether abort() stops a busy communicator with ncclCommRevoke (the linked
// NCCL has it, and FT_NCCL_REVOKE is not 0) instead of ncclCommAbort.
bool ncclRevokeAvailable();
// Lane CUDA streams held by live lanes, process-wide (leak checks). Released
// streams are pooled, never destroyed (see acquireLaneStream).
int ncclLiveStreams();

class NcclLane : public c10d::Backend {
 public:
  NcclLane(
      c10::intrusive_ptr<c10d::Store> store,
      int rank,
      int size,
      int lane,
      bool hostStageSharedGpu = true);
  ~NcclLane() override;

  // Creates the communicator on CUDA device `device` unless it exists (then
  // the device must match). Throws DistBackendError if the peers do not all
  // arrive by `deadline` or the lane is aborted meanwhile.
  void connect(int device, std::chrono::steady_clock::time_point deadline);
  bool connected() const;
  // Set by connect() when two ranks of this communicator are on one GPU (their
  // device UUIDs, exchanged through the store, match): NCCL refuses such a
  // communicator, so none is made and the lane's ops run host-staged on the
  // CPU transport (host_staging.hpp). With hostStageSharedGpu off, connect()
  // raises a ValueError naming the ranks instead.
  bool hostStaged() const;
  // Refuses every later op (as abort() does, without ncclCommAbort yet), then
  // says whether nothing of this lane can still run on the device: no
  // communicator is being created and every op's kernels have finished
  // (checked on the ops' end events, ahead of the poller). A later abort()
  // still calls ncclCommAbort.
  bool closeIfIdle();
  // The device of the communicator, or -1 before connect().
  int device() const;
  void abort() override;

  const std::string getBackendName() const override {
    return "ft-nccl";
  }

  // The lane ops (c10d_ops.hpp). A barrier is an allreduce of one int on
  // `opts.device` (FtBackend resolves it); its wait() blocks the CPU.
  FT_C10D_LANE_OPS(FT_C10D_OVERRIDE)

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// The NCCL transport: one NcclLane per lane, under the store prefixes
// "nccl<lane>/". Connects nothing yet.
std::shared_ptr<Transport> makeNcclTransport(const TransportSpec& spec);

} // namespace ft

#endif // FT_USE_NCCL
