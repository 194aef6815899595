#include "backend.hpp"
#include "c10d_compat.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <thread>

#ifdef FT_USE_NCCL
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "nccl_comm.hpp"
#endif

namespace ft {

namespace {

using std::chrono::milliseconds;

// Generations whose NCCL communicators may wait for the Reaper at once (each
// ~750 ms of ncclCommAbort there); beyond that, configure() aborts in place.
constexpr size_t kMaxDeferredDeviceAborts = 4;

std::string messageOf(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

void checkTensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK_VALUE(t.defined(), "ft: ", op, ": got an undefined tensor");
  TORCH_CHECK_VALUE(
      t.layout() == at::kStrided,
      "ft: ",
      op,
      ": only dense tensors are supported, got layout ",
      t.layout());
  TORCH_CHECK_VALUE(
      t.is_contiguous(),
      "ft: ",
      op,
      ": tensors must be contiguous (shape ",
      t.sizes(),
      ", strides ",
      t.strides(),
      "); call .contiguous() first");
#ifdef FT_USE_NCCL
  if (t.is_cuda()) {
    return; // the NCCL lane checks dtype and device
  }
#else
  if (t.is_cuda()) {
    TORCH_CHECK_VALUE(
        false,
        "ft: ",
        op,
        ": got a CUDA tensor, but this build of ft has no NCCL path "
        "(it was built against a CPU-only torch)");
  }
#endif
  TORCH_CHECK_VALUE(
      t.device().is_cpu(),
      "ft: ",
      op,
      ": unsupported device ",
      t.device(),
      " (supported: cpu, and cuda in an NCCL build)");
}

// All tensors of one op: valid, and of one dtype and device.
void checkTensors(const std::vector<at::Tensor>& tensors, const char* op) {
  for (const auto& t : tensors) {
    checkTensor(t, op);
    TORCH_CHECK_TYPE(
        t.scalar_type() == tensors.front().scalar_type(),
        "ft: ",
        op,
        ": all tensors must have one dtype, got ",
        tensors.front().scalar_type(),
        " and ",
        t.scalar_type());
    TORCH_CHECK_VALUE(
        t.device() == tensors.front().device(),
        "ft: ",
        op,
        ": all tensors must be on one device, got ",
        tensors.front().device(),
        " and ",
        t.device());
  }
}

void checkTensorLists(
    const std::vector<std::vector<at::Tensor>>& lists,
    const char* op) {
  for (const auto& list : lists) {
    checkTensors(list, op);
  }
}

std::vector<at::Tensor> flatten(
    const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> flat;
  for (const auto& list : lists) {
    flat.insert(flat.end(), list.begin(), list.end());
  }
  return flat;
}

// How a reduction runs on the transport. Gloo has no AVG: ft runs it as SUM and
// divides on completion (`finalize`, empty when nothing is owed); NCCL reduces
// natively (AVG included) and checks the op itself.
struct TransportReduce {
  c10d::ReduceOp op;
  std::function<void(int)> finalize;
};

TransportReduce transportReduce(
    const c10d::ReduceOp& op,
    std::vector<at::Tensor> outputs,
    const char* name,
    bool holdsResult = true) {
  if (!outputs.empty() && outputs.front().is_cuda()) {
    return {op, nullptr};
  }
  TORCH_CHECK_NOT_IMPLEMENTED(
      op != c10d::ReduceOp::PREMUL_SUM,
      "ft: ",
      name,
      ": ReduceOp.PREMUL_SUM is not supported on the Gloo path");
  if (op != c10d::ReduceOp::AVG) {
    return {op, nullptr};
  }
  for (const auto& t : outputs) {
    TORCH_CHECK_TYPE(
        at::isFloatingType(t.scalar_type()) ||
            at::isComplexType(t.scalar_type()),
        "ft: ",
        name,
        ": ReduceOp.AVG needs floating-point tensors, got ",
        t.scalar_type());
  }
  std::function<void(int)> divide;
  if (holdsResult) {
    divide = [outputs = std::move(outputs)](int size) {
      for (const auto& t : outputs) {
        t.div_(size);
      }
    };
  }
  return {c10d::ReduceOp(c10d::ReduceOp::SUM), std::move(divide)};
}

BlockingRegion& blockingRegion() {
  static BlockingRegion region = [](const std::function<void()>& fn) { fn(); };
  return region;
}

} // namespace

namespace {
std::mutex liveBackendsMutex;
std::vector<FtBackend*> liveBackends;
} // namespace

void shutdownAllBackends(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::lock_guard<std::mutex> lock(liveBackendsMutex);
  for (FtBackend* backend : liveBackends) {
    backend->shutdownForExit();
  }
  for (FtBackend* backend : liveBackends) {
    backend->waitReaperIdle(deadline);
  }
}

void setBlockingRegion(BlockingRegion region) {
  blockingRegion() = std::move(region);
}

FtBackend::FtBackend(
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    int numLanes)
    : c10d::Backend(rank, size),
      numLanes_(numLanes),
      timeoutMs_(timeout.count()),
      reaper_(timeout + milliseconds(2000)) {
  TORCH_CHECK_VALUE(
      numLanes >= 1 && numLanes <= 64,
      "ft: num_lanes must be in [1, 64], got ",
      numLanes);
  TORCH_CHECK_VALUE(
      timeout.count() > 0,
      "ft: timeout must be positive, got ",
      timeout.count(),
      " ms");
  watchdog_ = std::make_unique<DeadlineWatchdog>([this] { return sweepDeadlines(); });
  std::lock_guard<std::mutex> lock(liveBackendsMutex);
  liveBackends.push_back(this);
}

FtBackend::~FtBackend() {
  {
    std::lock_guard<std::mutex> lock(liveBackendsMutex);
    liveBackends.erase(
        std::remove(liveBackends.begin(), liveBackends.end(), this),
        liveBackends.end());
  }
  watchdog_.reset();
  std::shared_ptr<Generation> last;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    last = std::move(generation_);
  }
  if (last) {
    last->abort(FailureKind::kShutdown, "the backend was destroyed");
    reaper_.reap(std::move(last));
  }
  // ~Reaper drains the queue, then joins.
}

std::shared_ptr<Generation> FtBackend::currentGeneration() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return generation_;
}

std::shared_ptr<Generation> FtBackend::requireGeneration(const char* name) const {
  auto generation = currentGeneration();
  TORCH_CHECK(
      generation != nullptr,
      "ft: ",
      name,
      " called before configure(): this process group has no members yet. "
      "Call configure(store_addr, replica_id, rank, world_size) first");
  return generation;
}

void FtBackend::configure(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size) {
  TORCH_CHECK_VALUE(size >= 1, "ft: world_size must be >= 1, got ", size);
  TORCH_CHECK_VALUE(
      rank >= 0 && rank < size,
      "ft: rank ",
      rank,
      " is out of range for world_size ",
      size,
      " (valid ranks: 0..",
      size - 1,
      ")");
  TORCH_CHECK_VALUE(store, "ft: configure() needs a store");

  const auto started = Clock::now();
  auto msSince = [](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  };
  ReconfigureTimings timings;
  std::shared_ptr<Generation> old;
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!exiting_, "ft: configure() while the process exits");
    old = std::move(generation_);
    id = nextGenerationId_++;
  }
  timings.generation = id;
  if (old) {
    // Fails its in-flight ops and severs its sockets now. Its NCCL
    // communicators are aborted by the Reaper if none of their kernels still
    // runs (see Generation::abort), unless a few generations already wait
    // there: each holds its communicators' device memory until then.
    old->abort(
        FailureKind::kAborted,
        "superseded by reconfigure to generation " + std::to_string(id),
        /*deferIdleDeviceAbort=*/reaper_.pending() < kMaxDeferredDeviceAborts);
    reaper_.reap(std::move(old));
  }
  timings.abortMs = msSince(started);
  const auto glooStarted = Clock::now();

  const uint64_t epoch = abortEpoch_.load();
  const milliseconds timeout(timeoutMs_.load());
  OwnedSockets sockets;
  std::vector<Lane> lanes;
  try {
    lanes = buildGlooLanes(store, rank, size, numLanes_, timeout, &sockets);
  } catch (const std::exception&) {
    C10_THROW_ERROR(
        DistBackendError,
        "ft: configure(rank=" + std::to_string(rank) + ", world_size=" +
            std::to_string(size) + ") could not connect to its peers within " +
            std::to_string(timeout.count()) +
            " ms: " + messageOf(std::current_exception()));
  }
  timings.glooMs = msSince(glooStarted);
#ifdef FT_USE_NCCL
  // Every lane gets an NCCL lane; its communicator is created below (eager)
  // or on the lane's first CUDA op. Nothing here touches CUDA.
  for (auto& lane : lanes) {
    lane.nccl = c10::make_intrusive<NcclLane>(
        c10::make_intrusive<c10d::PrefixStore>(
            "nccl" + std::to_string(lane.index), store),
        rank, size, lane.index, timeout);
  }
#endif
  auto generation = std::make_shared<Generation>(
      id, rank, size, std::move(lanes), std::move(sockets));
  bool published = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!exiting_ && abortEpoch_.load() == epoch) {
      generation_ = generation;
#ifdef C10D_BACKEND_HAS_RECONFIGURE
      rank_ = rank;
      size_ = size;
#endif
      published = true;
    }
  }
  if (published) {
#ifdef FT_USE_NCCL
    // Published first, so abort() from another thread reaches (and aborts)
    // a communicator whose init is in progress.
    const int device = cudaDevice_.load();
    if (device >= 0) {
      const auto ncclStarted = Clock::now();
      const auto deadline = started + timeout;
      try {
        for (int i = 0; i < generation->numLanes(); ++i) {
          auto& nccl = static_cast<NcclLane&>(*generation->lane(i).nccl);
          nccl.connect(device, deadline);
        }
      } catch (const std::exception&) {
        const std::string message = "configure(rank=" + std::to_string(rank) +
            ", world_size=" + std::to_string(size) +
            ") could not create its NCCL communicators within " +
            std::to_string(timeout.count()) +
            " ms: " + messageOf(std::current_exception());
        generation->abort(
            Clock::now() >= deadline ? FailureKind::kDeadline
                                     : FailureKind::kCommunication,
            message);
        C10_THROW_ERROR(DistBackendError, "ft: " + message);
      }
      timings.ncclMs = msSince(ncclStarted);
    }
#endif
    timings.totalMs = msSince(started);
    std::lock_guard<std::mutex> lock(mutex_);
    lastTimings_ = timings;
    return;
  }
  generation->abort(FailureKind::kAborted, "abort() during configure()");
  reaper_.reap(std::move(generation));
  C10_THROW_ERROR(
      DistBackendError,
      "ft: configure() was interrupted by abort() or shutdown()");
}

void FtBackend::setCudaDevice(int device) {
  TORCH_CHECK_VALUE(device >= -1, "ft: bad CUDA device ", device);
#ifndef FT_USE_NCCL
  TORCH_CHECK_VALUE(
      device == -1,
      "ft: this build of ft has no NCCL path (built against a CPU-only torch)");
#endif
  cudaDevice_.store(device);
}

ReconfigureTimings FtBackend::lastReconfigureTimings() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lastTimings_;
}

void FtBackend::abort() {
  abortEpoch_.fetch_add(1);
  if (auto generation = currentGeneration()) {
    generation->abort(FailureKind::kAborted, "aborted by abort()");
  }
}

void FtBackend::shutdownForExit() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    exiting_ = true;
  }
  shutdown();
}

void FtBackend::shutdown() {
  std::shared_ptr<Generation> last;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    last = std::move(generation_);
  }
  abortEpoch_.fetch_add(1);
  if (last) {
    last->abort(FailureKind::kShutdown, "the process group was shut down");
    reaper_.reap(std::move(last));
  }
}

std::optional<Failure> FtBackend::errored() const {
  auto generation = currentGeneration();
  return generation ? generation->failure() : std::nullopt;
}

void FtBackend::setTimeout(std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(
      timeout.count() > 0,
      "ft: timeout must be positive, got ",
      timeout.count(),
      " ms");
  timeoutMs_.store(timeout.count());
  reaper_.setDrainTimeout(timeout + milliseconds(2000));
}

std::chrono::milliseconds FtBackend::timeout() const {
  return milliseconds(timeoutMs_.load());
}

int FtBackend::currentRank() const {
  auto generation = currentGeneration();
  return generation ? generation->rank : getRank();
}

int FtBackend::currentSize() const {
  auto generation = currentGeneration();
  return generation ? generation->size : getSize();
}

uint64_t FtBackend::generationId() const {
  auto generation = currentGeneration();
  return generation ? generation->id : 0;
}

bool FtBackend::configured() const {
  return currentGeneration() != nullptr;
}

size_t FtBackend::generationSocketCount() const {
  auto generation = currentGeneration();
  return generation ? generation->socketCount() : 0;
}

size_t FtBackend::reaperPending() {
  return reaper_.pending();
}

std::optional<Clock::time_point> FtBackend::sweepDeadlines() {
  auto generation = currentGeneration();
  return generation ? generation->enforceDeadlines(Clock::now())
                    : std::nullopt;
}

namespace {

// Ops whose tensors have the same count, sizes and dtype on every rank.
bool symmetricOp(c10d::OpType opType) {
  switch (opType) {
    case c10d::OpType::BROADCAST:
    case c10d::OpType::ALLREDUCE:
    case c10d::OpType::ALLREDUCE_COALESCED:
    case c10d::OpType::REDUCE:
    case c10d::OpType::ALLGATHER:
    case c10d::OpType::_ALLGATHER_BASE:
    case c10d::OpType::ALLGATHER_COALESCED:
    case c10d::OpType::COALESCED:
    case c10d::OpType::REDUCE_SCATTER:
    case c10d::OpType::_REDUCE_SCATTER_BASE:
    case c10d::OpType::BARRIER:
      return true;
    default:
      return opType == kReduceScatterTensorCoalesced;
  }
}

constexpr int64_t kSignatureLength = 5;

std::string describeSignature(const int64_t* sig) {
  std::string text = c10d::opTypeToString(static_cast<c10d::OpType>(sig[0]));
  text += " on " + std::to_string(sig[2]) + " tensor(s) of " +
      std::to_string(sig[3]) + " elements";
  if (sig[2] > 0) {
    text += std::string(", dtype ") +
        c10::toString(static_cast<c10::ScalarType>(sig[1]));
  }
  return text;
}

} // namespace

void FtBackend::verifyAgreement(
    Generation& generation,
    Lane& lane,
    c10d::OpType opType,
    const char* name,
    const std::vector<at::Tensor>& tensors,
    std::chrono::milliseconds timeout) {
  if (!symmetricOp(opType)) {
    return;
  }
  int64_t numel = 0;
  int64_t shapeHash = 0;
  for (const auto& t : tensors) {
    numel += t.numel();
    for (auto d : t.sizes()) {
      shapeHash = shapeHash * 31 + d;
    }
  }
  const int64_t signature[kSignatureLength] = {
      static_cast<int64_t>(opType),
      tensors.empty() ? -1 : static_cast<int64_t>(tensors.front().scalar_type()),
      static_cast<int64_t>(tensors.size()),
      numel,
      shapeHash};
  auto mine = at::empty({kSignatureLength}, at::kLong);
  std::copy(signature, signature + kSignatureLength, mine.data_ptr<int64_t>());
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < generation.size; ++r) {
    all[0].push_back(at::empty({kSignatureLength}, at::kLong));
  }
  std::vector<at::Tensor> in{mine};
  try {
    blockingRegion()([&] { lane.gloo->allgather(all, in)->wait(timeout); });
  } catch (...) {
    const std::string message = std::string("agreement check before ") + name +
        " failed: " + messageOf(std::current_exception());
    generation.abort(FailureKind::kCommunication, message);
    C10_THROW_ERROR(DistBackendError, "ft: " + message);
  }
  std::string disagreement;
  for (int r = 0; r < generation.size; ++r) {
    const int64_t* theirs = all[0][r].data_ptr<int64_t>();
    if (!std::equal(signature, signature + kSignatureLength, theirs)) {
      disagreement += "; rank " + std::to_string(r) + " calls " +
          describeSignature(theirs);
    }
  }
  TORCH_CHECK_VALUE(
      disagreement.empty(),
      "ft: ",
      name,
      ": ranks disagree on the collective (rank ",
      generation.rank,
      " calls ",
      describeSignature(signature),
      disagreement,
      "). Nothing was sent; the group is still usable");
}

c10::intrusive_ptr<c10d::Work> FtBackend::launch(
    c10d::OpType opType,
    const char* name,
    std::vector<at::Tensor> outputs,
    std::chrono::milliseconds optsTimeout,
    const Issue& issue,
    Finalize finalize) {
  auto generation = requireGeneration(name);
  if (auto failure = generation->failure()) {
    C10_THROW_ERROR(
        DistBackendError,
        std::string("ft: ") + name + " refused: generation " +
            std::to_string(generation->id) +
            " has failed (" + failure->message +
            "); call configure() to build a new one");
  }
  const int laneIndex = currentLane();
  Lane& lane = generation->lane(laneIndex);
  const milliseconds timeout =
      optsTimeout.count() > 0 ? optsTimeout : milliseconds(timeoutMs_.load());
  if (checkAgreement_.load()) {
    verifyAgreement(*generation, lane, opType, name, outputs, timeout);
  }
  // Dispatch on the device: CUDA tensors go to the lane's NCCL communicator.
  const bool onCuda = !outputs.empty() && outputs.front().is_cuda();
  c10d::Backend* innerBackend = lane.gloo.get();
  if (onCuda) {
    TORCH_CHECK_VALUE(
        lane.nccl,
        "ft: ",
        name,
        ": got a CUDA tensor, but this build of ft has no NCCL path");
    innerBackend = lane.nccl.get();
  }
  auto work = c10::make_intrusive<FtWork>(
      generation->rank,
      opType,
      name,
      std::move(outputs),
      Clock::now() + timeout,
      timeout,
      laneIndex,
      generation->id);
  if (!generation->track(work)) {
    C10_THROW_ERROR(
        DistBackendError,
        std::string("ft: ") + name + " refused: generation " +
            std::to_string(generation->id) + " was aborted");
  }

  // Before issuing: an NCCL lane may connect (or wait for a non-blocking
  // call to settle) inside issue(), and the watchdog bounds that too.
  watchdog_->poke(work->deadline());
  c10::intrusive_ptr<c10d::Work> inner;
  try {
    blockingRegion()([&] { inner = issue(*innerBackend); });
  } catch (const c10::DistBackendError&) {
    // Only the NCCL lane raises this from issue(): its communicator failed,
    // missed a deadline or was aborted, so the generation is unusable.
    auto error = std::current_exception();
    work->fail(error);
    if (onCuda) {
      generation->abort(
          FailureKind::kCommunication,
          std::string(name) + " on lane " + std::to_string(laneIndex) +
              " failed: " + messageOf(error));
    }
    generation->innerDone(work.get());
    std::rethrow_exception(error);
  } catch (...) {
    // The inner communicator validated and refused the op before sending
    // anything, so the generation stays usable.
    auto error = std::current_exception();
    work->fail(error);
    generation->innerDone(work.get());
    std::rethrow_exception(error);
  }
  // The inner Work owns the tensors Gloo uses; holding it here means Gloo's
  // threads never drop the last C++ reference to a caller's tensor.
  work->holdInner(inner);

  std::weak_ptr<Generation> weakGeneration = generation;
  const int size = generation->size;
  auto onInnerDone = [weakGeneration, work, size, finalize = std::move(finalize)](
                         std::exception_ptr error) {
    auto generation = weakGeneration.lock();
    if (error) {
      const std::string message =
          "inner communicator error: " + messageOf(error);
      if (generation) {
        if (auto failure = generation->failure()) {
          // Already failed (a missed deadline, abort(), ...): this error is most likely
          // the consequence of the abort severing the sockets; report the cause.
          error = generation->failureErrorFor(*work, failure->message);
        } else {
          generation->abort(FailureKind::kCommunication, message);
        }
      }
      work->fail(error);
    } else {
      work->succeed(finalize ? std::function<void()>([&] { finalize(size); })
                             : std::function<void()>());
    }
    if (generation) {
      generation->innerDone(work.get());
    }
  };

  c10::intrusive_ptr<c10::ivalue::Future> innerFuture;
  try {
    innerFuture = inner->getFuture();
  } catch (const c10::Error&) {
    // Gloo's point-to-point works have no future.
  }
  if (innerFuture) {
    innerFuture->addCallback([onInnerDone](c10::ivalue::Future& future) {
      onInnerDone(future.hasError() ? future.exception_ptr() : nullptr);
    });
  } else {
    std::thread([inner, onInnerDone] {
      try {
        inner->wait();
        onInnerDone(nullptr);
      } catch (...) {
        onInnerDone(std::current_exception());
      }
    }).detach();
  }
  return work;
}

void FtBackend::checkRoot(int root, const char* name) const {
  const int size = currentSize();
  TORCH_CHECK_VALUE(
      root >= 0 && root < size,
      "ft: ",
      name,
      ": root rank ",
      root,
      " is out of range for world_size ",
      size);
}

void FtBackend::checkPeer(int peer, const char* name, const char* role) const {
  const int size = currentSize();
  TORCH_CHECK_VALUE(
      peer >= 0 && peer < size && peer != currentRank(),
      "ft: ",
      name,
      ": ",
      role,
      " rank ",
      peer,
      " is invalid (world_size ",
      size,
      ", own rank ",
      currentRank(),
      ")");
}

c10::intrusive_ptr<c10d::Work> FtBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  checkTensors(tensors, "broadcast");
  checkRoot(opts.rootRank, "broadcast");
  return launch(
      c10d::OpType::BROADCAST, "broadcast", tensors, opts.timeout,
      [tensors, opts](c10d::Backend& inner) mutable {
        return inner.broadcast(tensors, opts);
      });
}

c10::intrusive_ptr<c10d::Work> FtBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  checkTensors(tensors, "allreduce");
  auto reduce = transportReduce(opts.reduceOp, tensors, "allreduce");
  c10d::AllreduceOptions innerOpts = opts;
  innerOpts.reduceOp = reduce.op;
  return launch(
      c10d::OpType::ALLREDUCE, "allreduce", tensors, opts.timeout,
      [tensors, innerOpts](c10d::Backend& inner) mutable {
        return inner.allreduce(tensors, innerOpts);
      },
      reduce.finalize);
}

c10::intrusive_ptr<c10d::Work> FtBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  checkTensors(tensors, "allreduce_coalesced");
  auto reduce = transportReduce(opts.reduceOp, tensors, "allreduce_coalesced");
  c10d::AllreduceCoalescedOptions innerOpts = opts;
  innerOpts.reduceOp = reduce.op;
  return launch(
      c10d::OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", tensors,
      opts.timeout,
      [tensors, innerOpts](c10d::Backend& inner) mutable {
        return inner.allreduce_coalesced(tensors, innerOpts);
      },
      reduce.finalize);
}

c10::intrusive_ptr<c10d::Work> FtBackend::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  checkTensors(tensors, "reduce");
  checkRoot(opts.rootRank, "reduce");
  // Only the root holds the reduced value.
  auto reduce = transportReduce(
      opts.reduceOp, tensors, "reduce", opts.rootRank == currentRank());
  c10d::ReduceOptions innerOpts = opts;
  innerOpts.reduceOp = reduce.op;
  return launch(
      c10d::OpType::REDUCE, "reduce", tensors, opts.timeout,
      [tensors, innerOpts](c10d::Backend& inner) mutable {
        return inner.reduce(tensors, innerOpts);
      },
      reduce.finalize);
}

c10::intrusive_ptr<c10d::Work> FtBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::AllgatherOptions& opts) {
  checkTensors(inputTensors, "allgather");
  checkTensorLists(outputTensors, "allgather");
  return launch(
      c10d::OpType::ALLGATHER, "allgather", flatten(outputTensors), opts.timeout,
      [outputTensors, inputTensors, opts](c10d::Backend& inner) mutable {
        return inner.allgather(outputTensors, inputTensors, opts);
      });
}

c10::intrusive_ptr<c10d::Work> FtBackend::_allgather_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    const c10d::AllgatherOptions& opts) {
  checkTensors({outputBuffer, inputBuffer}, "all_gather_into_tensor");
  TORCH_CHECK_VALUE(
      outputBuffer.numel() == inputBuffer.numel() * currentSize(),
      "ft: all_gather_into_tensor: output has ",
      outputBuffer.numel(),
      " elements, expected input (",
      inputBuffer.numel(),
      ") x world_size (",
      currentSize(),
      ")");
  return launch(
      c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor", {outputBuffer},
      opts.timeout,
      [outputBuffer, inputBuffer, opts](c10d::Backend& inner) mutable {
        return inner._allgather_base(outputBuffer, inputBuffer, opts);
      });
}

c10::intrusive_ptr<c10d::Work> FtBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputTensorLists,
    std::vector<at::Tensor>& inputTensors,
    const c10d::AllgatherOptions& opts) {
  checkTensors(inputTensors, "allgather_coalesced");
  checkTensorLists(outputTensorLists, "allgather_coalesced");
  return launch(
      c10d::OpType::ALLGATHER_COALESCED, "allgather_coalesced",
      flatten(outputTensorLists), opts.timeout,
      [outputTensorLists, inputTensors, opts](c10d::Backend& inner) mutable {
        return inner.allgather_coalesced(outputTensorLists, inputTensors, opts);
      });
}

c10::intrusive_ptr<c10d::Work> FtBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  checkTensors(inputs, "allgather_into_tensor_coalesced");
  checkTensors(outputs, "allgather_into_tensor_coalesced");
  return launch(
      c10d::OpType::COALESCED, "allgather_into_tensor_coalesced", outputs,
      opts.timeout,
      [outputs, inputs, opts](c10d::Backend& inner) mutable {
        return inner.allgather_into_tensor_coalesced(outputs, inputs, opts);
      });
}

c10::intrusive_ptr<c10d::Work> FtBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::GatherOptions& opts) {
  checkTensors(inputTensors, "gather");
  checkTensorLists(outputTensors, "gather");
  checkRoot(opts.rootRank, "gather");
  return launch(
      c10d::OpType::GATHER, "gather", flatten(outputTensors), opts.timeout,
      [outputTensors, inputTensors, opts](c10d::Backend& inner) mutable {
        return inner.gather(outputTensors, inputTensors, opts);
      });
}

c10::intrusive_ptr<c10d::Work> FtBackend::scatter(
    std::vector<at::Tensor>& outputTensors,
    std::vector<std::vector<at::Tensor>>& inputTensors,
    const c10d::ScatterOptions& opts) {
  checkTensors(outputTensors, "scatter");
  checkTensorLists(inputTensors, "scatter");
  checkRoot(opts.rootRank, "scatter");
  return launch(
      c10d::OpType::SCATTER, "scatter", outputTensors, opts.timeout,
      [outputTensors, inputTensors, opts](c10d::Backend& inner) mutable {
        return inner.scatter(outputTensors, inputTensors, opts);
      });
}

c10::intrusive_ptr<c10d::Work> FtBackend::reduce_scatter(
    std::vector<at::Tensor>& outputTensors,
    std::vector<std::vector<at::Tensor>>& inputTensors,
    const c10d::ReduceScatterOptions& opts) {
  checkTensors(outputTensors, "reduce_scatter");
  checkTensorLists(inputTensors, "reduce_scatter");
  auto reduce =
      transportReduce(opts.reduceOp, outputTensors, "reduce_scatter");
  c10d::ReduceScatterOptions innerOpts = opts;
  innerOpts.reduceOp = reduce.op;
  return launch(
      c10d::OpType::REDUCE_SCATTER, "reduce_scatter", outputTensors,
      opts.timeout,
      [outputTensors, inputTensors, innerOpts](c10d::Backend& inner) mutable {
        return inner.reduce_scatter(outputTensors, inputTensors, innerOpts);
      },
      reduce.finalize);
}

c10::intrusive_ptr<c10d::Work> FtBackend::_reduce_scatter_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    const c10d::ReduceScatterOptions& opts) {
  checkTensors({outputBuffer, inputBuffer}, "reduce_scatter_tensor");
  TORCH_CHECK_VALUE(
      inputBuffer.numel() == outputBuffer.numel() * currentSize(),
      "ft: reduce_scatter_tensor: input has ",
      inputBuffer.numel(),
      " elements, expected output (",
      outputBuffer.numel(),
      ") x world_size (",
      currentSize(),
      ")");
  auto reduce =
      transportReduce(opts.reduceOp, {outputBuffer}, "reduce_scatter_tensor");
  c10d::ReduceScatterOptions innerOpts = opts;
  innerOpts.reduceOp = reduce.op;
  return launch(
      c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor",
      {outputBuffer}, opts.timeout,
      [outputBuffer, inputBuffer, innerOpts](c10d::Backend& inner) mutable {
        return inner._reduce_scatter_base(outputBuffer, inputBuffer, innerOpts);
      },
      reduce.finalize);
}

c10::intrusive_ptr<c10d::Work> FtBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  checkTensors(outputs, "reduce_scatter_tensor_coalesced");
  checkTensors(inputs, "reduce_scatter_tensor_coalesced");
  auto reduce = transportReduce(
      opts.reduceOp, outputs, "reduce_scatter_tensor_coalesced");
  c10d::ReduceScatterOptions innerOpts = opts;
  innerOpts.reduceOp = reduce.op;
  return launch(
      kReduceScatterTensorCoalesced,
      "reduce_scatter_tensor_coalesced", outputs, opts.timeout,
      [outputs, inputs, innerOpts](c10d::Backend& inner) mutable {
        return inner.reduce_scatter_tensor_coalesced(outputs, inputs, innerOpts);
      },
      reduce.finalize);
}

c10::intrusive_ptr<c10d::Work> FtBackend::alltoall_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  checkTensors({outputBuffer, inputBuffer}, "all_to_all_single");
  return launch(
      c10d::OpType::ALLTOALL_BASE, "all_to_all_single", {outputBuffer},
      opts.timeout,
      [outputBuffer, inputBuffer, outputSplitSizes, inputSplitSizes, opts](
          c10d::Backend& inner) mutable {
        return inner.alltoall_base(
            outputBuffer, inputBuffer, outputSplitSizes, inputSplitSizes, opts);
      });
}

c10::intrusive_ptr<c10d::Work> FtBackend::alltoall(
    std::vector<at::Tensor>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::AllToAllOptions& opts) {
  checkTensors(outputTensors, "all_to_all");
  checkTensors(inputTensors, "all_to_all");
  return launch(
      c10d::OpType::ALLTOALL, "all_to_all", outputTensors, opts.timeout,
      [outputTensors, inputTensors, opts](c10d::Backend& inner) mutable {
        return inner.alltoall(outputTensors, inputTensors, opts);
      });
}

c10::intrusive_ptr<c10d::Work> FtBackend::send(
    std::vector<at::Tensor>& tensors,
    int dstRank,
    int tag) {
  checkTensors(tensors, "send");
  checkPeer(dstRank, "send", "destination");
  return launch(
      c10d::OpType::SEND, "send", tensors, milliseconds(-1),
      [tensors, dstRank, tag](c10d::Backend& inner) mutable {
        return inner.send(tensors, dstRank, tag);
      });
}

c10::intrusive_ptr<c10d::Work> FtBackend::recv(
    std::vector<at::Tensor>& tensors,
    int srcRank,
    int tag) {
  checkTensors(tensors, "recv");
  checkPeer(srcRank, "recv", "source");
  return launch(
      c10d::OpType::RECV, "recv", tensors, milliseconds(-1),
      [tensors, srcRank, tag](c10d::Backend& inner) mutable {
        return inner.recv(tensors, srcRank, tag);
      });
}

c10::intrusive_ptr<c10d::Work> FtBackend::recvAnysource(
    std::vector<at::Tensor>& tensors,
    int tag) {
  checkTensors(tensors, "recv");
  return launch(
      c10d::OpType::RECVANYSOURCE, "recv (any source)", tensors,
      milliseconds(-1),
      [tensors, tag](c10d::Backend& inner) mutable {
        return inner.recvAnysource(tensors, tag);
      });
}

c10::intrusive_ptr<c10d::Work> FtBackend::barrier(
    const c10d::BarrierOptions& opts) {
#ifdef FT_USE_NCCL
  // A CUDA barrier runs over NCCL (and its wait() blocks the CPU) when the
  // backend has a CUDA device; otherwise every barrier is a Gloo one.
  const int device = cudaDevice_.load();
  if (device >= 0 && opts.device && opts.device->is_cuda()) {
    const int index = opts.device->has_index() ? opts.device->index() : device;
    auto token = at::empty(
        {1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, index));
    return launch(
        c10d::OpType::BARRIER, "barrier", {token}, opts.timeout,
        [index, opts](c10d::Backend& inner) {
          return static_cast<NcclLane&>(inner).barrierOn(index, opts.timeout);
        });
  }
#endif
  return launch(
      c10d::OpType::BARRIER, "barrier", {}, opts.timeout,
      [opts](c10d::Backend& inner) mutable { return inner.barrier(opts); });
}

} // namespace ft
