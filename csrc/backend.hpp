// FtBackend: the c10d::Backend registered with torch as "ft" (docs/design.md,
// "Abort and generations").
//
// Contract:
//  * One object lives for the whole job. configure() swaps in a new
//    generation (fresh store prefix, new rank and world size) in the same
//    process; the old one is aborted at once and torn down on a Reaper
//    thread, off the caller's path.
//  * Collectives dispatch on the tensors' device to the transport serving it
//    (transport.hpp), on the current lane: CPU tensors run on Gloo; CUDA
//    tensors need an NCCL build.
//  * Every op has one deadline (its options' timeout, else the backend's at
//    the time of the call), carried into the transport and enforced by a C++
//    watchdog, the only place that decides an op is late: a missed deadline
//    aborts the generation and sets errored().
//  * abort() may be called from any thread, fails every in-flight Work before
//    it returns, and leaves the backend ready for the next configure().
//  * errored() never blocks on communication.
//  * Bad input (bad rank or world size, non-contiguous / sparse / mixed-dtype
//    / wrong-device tensors, unsupported reduce ops) raises before anything
//    is sent, so the generation stays usable.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>

#include "c10d_ops.hpp"
#include "deadline.hpp"
#include "generation.hpp"
#include "work.hpp"

namespace ft {

// Runs `fn` with the GIL released if the calling thread holds it. Installed by
// bindings.cpp (the only file that knows Python); a plain call until then.
//
// Why: torch calls into a Python-subclassed ProcessGroup without releasing
// the GIL, and Gloo's worker threads may need the GIL while holding their
// queue lock (dropping a tensor decrefs its PyObject). Enqueueing an op while
// holding the GIL can then deadlock.
using BlockingRegion = std::function<void(const std::function<void()>&)>;
void setBlockingRegion(BlockingRegion region);

class HostStaging;

// An op as a transport runs it: `direct` on the caller's tensors; `staged`
// makes the same call on host copies of them, kept in the HostStaging given
// (for a lane NCCL cannot carry; see host_staging.hpp).
struct InnerCall {
  Issue direct;
  std::function<Issue(HostStaging&)> staged;
};

// How long each step of the last configure() took, in milliseconds.
struct ReconfigureTimings {
  uint64_t generation = 0;
  double abortMs = 0; // aborting the old generation (ncclCommAbort included)
  double glooMs = 0;  // connecting the Gloo lanes
  double ncclMs = 0;  // creating the NCCL communicators (eager init only)
  double totalMs = 0;
};

// Shuts down every live FtBackend and waits (bounded) until their old
// generations are torn down, so no communicator thread outlives the
// interpreter. Called at exit with the GIL released.
void shutdownAllBackends(std::chrono::milliseconds timeout);

class FtBackend : public c10d::Backend {
 public:
  // rank/size are torch's view at creation; the live values are
  // currentRank()/currentSize() (torch < 2.14 keeps Backend::size_ const).
  FtBackend(
      int rank,
      int size,
      std::chrono::milliseconds timeout,
      int numLanes);
  ~FtBackend() override;

  // Builds a new generation on `store` (already carrying a fresh prefix).
  // Blocks until every peer has connected or the timeout passes.
  void
  configure(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size);
  void abort() override;
  // Ends the current generation: its ops fail, its communicators are reaped.
  // A later configure() builds a new one (torchft's groups reconfigure after
  // shutdown()); a configure() it races with discards what it built.
  void shutdown() override;
  // shutdown(), and no configure() ever again: the process is exiting
  // (shutdownAllBackends), so nothing new may start under the interpreter.
  void shutdownForExit();
  // The current generation's sticky failure, if any. "Not configured" is not
  // an error.
  std::optional<Failure> errored() const;

  void setTimeout(std::chrono::milliseconds timeout) override;
  std::chrono::milliseconds timeout() const;
  int currentRank() const;
  int currentSize() const;
  uint64_t generationId() const;
  int numLanes() const {
    return numLanes_;
  }
  bool configured() const;
  // When on, every collective first checks (with a small allgather) that all
  // ranks call the same op on tensors of the same count, size and dtype, and
  // raises a clear error on every rank otherwise, before any data moves.
  // Off by default: it costs one extra round trip per op. Without it, Gloo
  // terminates the process on a size mismatch.
  void setCheckAgreement(bool on) {
    checkAgreement_.store(on);
  }
  bool checkAgreement() const {
    return checkAgreement_.load();
  }
  size_t generationSocketCount() const;
  size_t reaperPending();
  bool waitReaperIdle(Clock::time_point deadline) {
    return reaper_.waitIdle(deadline);
  }
  // Ranks of one NCCL communicator on one GPU: carry that lane's CUDA ops
  // host-staged over Gloo (on, the default), or refuse them with a ValueError
  // naming the ranks. Read by the next configure().
  void setHostStageSharedGpu(bool on) {
    hostStageSharedGpu_.store(on);
  }
  bool hostStageSharedGpu() const {
    return hostStageSharedGpu_.load();
  }
  // Tests only: run CPU ops through host staging too (copies into fresh CPU
  // tensors, Gloo, copies back), so that path is exercised where no GPU is.
  void setStageCpuOps(bool on) {
    stageCpuOps_.store(on);
  }
  bool stageCpuOps() const {
    return stageCpuOps_.load();
  }
  // Ops run host-staged so far (tests, and a sign of a shared GPU).
  uint64_t hostStagedOps() const {
    return hostStagedOps_.load();
  }
  // The CUDA device whose NCCL communicators configure() creates eagerly
  // (-1: none; each lane then connects on its first CUDA op). A CUDA barrier
  // runs over NCCL only when this is set. Only meaningful in an NCCL build.
  void setCudaDevice(int device);
  int cudaDevice() const {
    return cudaDevice_.load();
  }
  ReconfigureTimings lastReconfigureTimings() const;

  const std::string getBackendName() const override {
    return "ft";
  }

  // Every c10d op (c10d_ops.hpp): checks its arguments, then runs on the
  // transport serving its tensors (see submit()).
  FT_C10D_LANE_OPS(FT_C10D_OVERRIDE)
  FT_C10D_BACKEND_ONLY_OPS(FT_C10D_OVERRIDE)

 private:
  // Runs on success only, with the generation's world size; the one place ft
  // writes into the caller's tensors after the inner op.
  using Finalize = std::function<void(int worldSize)>;
  // An op as its adapter names it: the OpType torch sees and the name ft's
  // errors use.
  struct Op {
    c10d::OpType type;
    const char* name;
  };

  // Argument checks shared by the ops (ValueError): rooted, point-to-point,
  // and the flat ops whose one buffer holds world_size times the other's.
  void checkRoot(int root, const char* name) const;
  void checkPeer(int peer, const char* name, const char* role) const;
  void checkWorldMultiple(
      const at::Tensor& whole,
      const char* wholeRole,
      const at::Tensor& part,
      const char* partRole,
      const char* name) const;

  // The one path every op takes: pick the generation and lane, register the
  // FtWork with its deadline, issue the inner op, and complete the FtWork
  // from the inner op's completion (running `finalize` only on success).
  c10::intrusive_ptr<c10d::Work> submit(
      const Op& op,
      std::vector<at::Tensor> outputs,
      std::chrono::milliseconds optsTimeout,
      const InnerCall& call,
      Finalize finalize = Finalize());

  // The mechanical half of every adapter: the inner op is `Method` (the c10d
  // method of the adapter's own name) called with the adapter's arguments,
  // the FtWork reports the first of them (the outputs, as one list), and the
  // options, last where the op has them, give the timeout and, for a
  // reduction, the reduce op the transport runs and the finalize owed.
  template <auto Method, typename... Args>
  c10::intrusive_ptr<c10d::Work> run(const Op& op, Args&... args);

  // With checkAgreement(): an allgather of the op's signature on the lane's
  // CPU transport, raising on every rank if they differ.
  void verifyAgreement(
      Generation& generation,
      const Generation::Lease& transports,
      int lane,
      const Op& op,
      const std::vector<at::Tensor>& tensors,
      std::chrono::milliseconds timeout);

  std::shared_ptr<Generation> requireGeneration(const char* name) const;
  std::shared_ptr<Generation> currentGeneration() const;
  std::optional<Clock::time_point> sweepDeadlines();

  const int numLanes_;
  std::atomic<int64_t> timeoutMs_;
  std::atomic<bool> checkAgreement_{false};
  std::atomic<bool> hostStageSharedGpu_{true};
  std::atomic<bool> stageCpuOps_{false};
  std::atomic<uint64_t> hostStagedOps_{0};
  std::atomic<int> cudaDevice_{-1};
  ReconfigureTimings lastTimings_; // guarded by mutex_
  mutable std::mutex mutex_;
  std::shared_ptr<Generation> generation_;
  uint64_t nextGenerationId_ = 1;
  // Bumped by abort(); a configure() that was building when abort() came in
  // discards what it built.
  std::atomic<uint64_t> abortEpoch_{0};
  bool exiting_ = false; // set by shutdownForExit(): configure() refuses

  Reaper reaper_;
  // Last member: destroyed first, so the sweep never sees a dead backend.
  std::unique_ptr<DeadlineWatchdog> watchdog_;
};

} // namespace ft
