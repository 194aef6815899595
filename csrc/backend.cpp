#include "backend.hpp"
#include "c10d_compat.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <thread>
#include <tuple>
#include <utility>

#include "host_staging.hpp"
#include "lane.hpp"
#include "transport.hpp"

namespace ft {

namespace {

using std::chrono::milliseconds;

// Generations whose NCCL communicators may wait for the Reaper at once (each
// ~750 ms of ncclCommAbort there); beyond that, configure() aborts in place.
constexpr size_t kMaxDeferredDeviceAborts = 4;

// How long, beyond the op timeout, the Reaper waits for an aborted
// generation's inner ops to finish before releasing its transports anyway.
// The abort severed their sockets, so they normally end at once; the bound
// matters only if an inner op ignores that, and then Gloo's own timeout
// (timeout + max(1 s, timeout / 10), see makeGloo in bindings.cpp) ends it,
// within 2 s for timeouts up to 20 s. Releasing sooner would destroy a
// communicator under a running op.
constexpr milliseconds kReapDrainGrace(2000);

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
  checkTensorDevice(t, op);
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

void checkTensors(
    const std::vector<std::vector<at::Tensor>>& lists,
    const char* op) {
  for (const auto& list : lists) {
    checkTensors(list, op);
  }
}

// Each tensor argument of an op, in turn.
template <typename... Args>
void checkEach(const char* op, const Args&... args) {
  (checkTensors(args, op), ...);
}

// An op's output argument as the tensors its FtWork reports: one list.
std::vector<at::Tensor> tensorList(const at::Tensor& tensor) {
  return {tensor};
}

std::vector<at::Tensor> tensorList(const std::vector<at::Tensor>& tensors) {
  return tensors;
}

std::vector<at::Tensor> tensorList(
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
template <typename Opts>
struct TransportReduction {
  Opts inner; // the caller's options, with the reduce op the transport runs
  std::function<void(int)> finalize;
};

template <typename Opts>
TransportReduction<Opts> onTransport(
    const Opts& opts,
    std::vector<at::Tensor> outputs,
    const char* name,
    bool holdsResult = true) {
  TransportReduction<Opts> reduction{opts, nullptr};
  const c10d::ReduceOp& op = opts.reduceOp;
  if (!outputs.empty() && outputs.front().is_cuda()) {
    return reduction;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(
      op != c10d::ReduceOp::PREMUL_SUM,
      "ft: ",
      name,
      ": ReduceOp.PREMUL_SUM is not supported on the Gloo path");
  if (op != c10d::ReduceOp::AVG) {
    return reduction;
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
  if (holdsResult) {
    reduction.finalize = [outputs = std::move(outputs)](int size) {
      for (const auto& t : outputs) {
        t.div_(size);
      }
    };
  }
  reduction.inner.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
  return reduction;
}

// The inner op of an adapter: `method` called on the communicator the op is
// dispatched to, with copies of the adapter's arguments (the c10d methods take
// their tensor lists by mutable reference). `staged` makes the same call on
// host copies of the tensors (host_staging.hpp).
template <typename... Params, typename... Args>
InnerCall callOnInner(
    c10::intrusive_ptr<c10d::Work> (c10d::Backend::*method)(Params...),
    Args... args) {
  auto invoke = [method](auto argsTuple) -> Issue {
    return [method,
            argsTuple = std::move(argsTuple)](c10d::Backend& inner) mutable {
      return std::apply(
          [&](auto&... arg) { return (inner.*method)(arg...); },
          argsTuple);
    };
  };
  auto argsTuple = std::make_tuple(std::move(args)...);
  InnerCall call;
  call.direct = invoke(argsTuple);
  call.staged = [invoke, argsTuple](HostStaging& staging) {
    return invoke(
        std::apply(
            [&](const auto&... arg) {
              return std::make_tuple(staging.stageArg(arg)...);
            },
            argsTuple));
  };
  return call;
}

// callOnInner(method, args..., options): the adapter's arguments with its
// options (the last one) replaced by `options`.
template <typename Method, typename Args, size_t... I, typename Opts>
InnerCall callWithOptions(
    Method method,
    const Args& args,
    std::index_sequence<I...> /*allButLast*/,
    const Opts& options) {
  return callOnInner(method, std::get<I>(args)..., options);
}

// A lane's communicator (Gloo's, or an NcclLane): its c10d method of an
// adapter's own name runs the op.
using Lane = c10d::Backend;

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
      // As many workers as generations may wait there with a deferred device
      // abort, so those are all aborted at once.
      reaper_(timeout + kReapDrainGrace, kMaxDeferredDeviceAborts) {
  TORCH_CHECK_VALUE(
      numLanes >= 1 && numLanes <= 64,
      "ft: num_lanes must be in [1, 64], got ",
      numLanes);
  TORCH_CHECK_VALUE(
      timeout.count() > 0,
      "ft: timeout must be positive, got ",
      timeout.count(),
      " ms");
  watchdog_ =
      std::make_unique<DeadlineWatchdog>([this] { return sweepDeadlines(); });
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

std::shared_ptr<Generation> FtBackend::requireGeneration(
    const char* name) const {
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
  const auto connectStarted = Clock::now();

  const uint64_t epoch = abortEpoch_.load();
  const milliseconds timeout(timeoutMs_.load());
  Transports transports;
  try {
    transports = makeTransports(
        {store, rank, size, numLanes_, timeout, hostStageSharedGpu_.load()});
  } catch (const std::exception&) {
    C10_THROW_ERROR(
        DistBackendError,
        "ft: configure(rank=" + std::to_string(rank) + ", world_size=" +
            std::to_string(size) + ") could not connect to its peers within " +
            std::to_string(timeout.count()) +
            " ms: " + messageOf(std::current_exception()));
  }
  timings.glooMs = msSince(connectStarted);
  auto generation = std::make_shared<Generation>(
      id,
      rank,
      size,
      numLanes_,
      std::move(transports));
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
    // Published first, so abort() from another thread reaches (and aborts)
    // a communicator whose init is in progress.
    const int device = cudaDevice_.load();
    if (device >= 0) {
      const auto deviceStarted = Clock::now();
      const auto deadline = started + timeout;
      auto lease = generation->lease();
      for (const auto& transport : lease.all()) {
        try {
          transport->connect(device, deadline);
        } catch (const std::exception&) {
          const std::string message = "configure(rank=" + std::to_string(rank) +
              ", world_size=" + std::to_string(size) +
              ") could not create its " + transport->name() +
              " communicators within " + std::to_string(timeout.count()) +
              " ms: " + messageOf(std::current_exception());
          generation->abort(
              Clock::now() >= deadline ? FailureKind::kDeadline
                                       : FailureKind::kCommunication,
              message);
          C10_THROW_ERROR(DistBackendError, "ft: " + message);
        }
      }
      timings.ncclMs = msSince(deviceStarted);
    }
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
  checkCudaDeviceSupported(device);
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
  reaper_.setDrainTimeout(timeout + kReapDrainGrace);
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
  return generation ? generation->enforceDeadlines(Clock::now()) : std::nullopt;
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
    const Generation::Lease& transports,
    int lane,
    const Op& op,
    const std::vector<at::Tensor>& tensors,
    std::chrono::milliseconds timeout) {
  if (!symmetricOp(op.type)) {
    return;
  }
  const char* name = op.name;
  int64_t numel = 0;
  int64_t shapeHash = 0;
  for (const auto& t : tensors) {
    numel += t.numel();
    for (auto d : t.sizes()) {
      shapeHash = shapeHash * 31 + d;
    }
  }
  const int64_t signature[kSignatureLength] = {
      static_cast<int64_t>(op.type),
      tensors.empty() ? -1
                      : static_cast<int64_t>(tensors.front().scalar_type()),
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
    Transport* cpu = transports.serving(c10::Device(c10::kCPU));
    TORCH_CHECK(cpu != nullptr, "the generation was released");
    auto gather = callOnInner(
        &c10d::Backend::allgather,
        all,
        in,
        c10d::AllgatherOptions());
    blockingRegion()([&] {
      cpu->run(lane, gather.direct, Clock::now() + timeout)->wait(timeout);
    });
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
      disagreement +=
          "; rank " + std::to_string(r) + " calls " + describeSignature(theirs);
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

c10::intrusive_ptr<c10d::Work> FtBackend::submit(
    const Op& op,
    std::vector<at::Tensor> outputs,
    std::chrono::milliseconds optsTimeout,
    const InnerCall& call,
    Finalize finalize) {
  const char* name = op.name;
  auto generation = requireGeneration(name);
  if (auto failure = generation->failure()) {
    C10_THROW_ERROR(
        DistBackendError,
        std::string("ft: ") + name + " refused: generation " +
            std::to_string(generation->id) + " has failed (" +
            failure->message + "); call configure() to build a new one");
  }
  const int laneIndex = currentLane();
  generation->checkLane(laneIndex);
  const milliseconds timeout =
      optsTimeout.count() > 0 ? optsTimeout : milliseconds(timeoutMs_.load());
  // Held while the op is issued, so the Reaper cannot release the transports
  // under it.
  auto transports = generation->lease();
  if (checkAgreement_.load()) {
    verifyAgreement(*generation, transports, laneIndex, op, outputs, timeout);
  }
  // Dispatch on the device: each transport serves one kind of tensor. No
  // tensors (a CPU barrier) means the CPU transport.
  const c10::Device device =
      outputs.empty() ? c10::Device(c10::kCPU) : outputs.front().device();
  Transport* transport = transports.serving(device);
  // An empty lease means the generation was released (so aborted): track()
  // refuses the op below.
  TORCH_CHECK_VALUE(
      transport != nullptr || transports.all().empty(),
      "ft: ",
      name,
      ": this build of ft has no transport for ",
      device.type(),
      " tensors");
  auto work = c10::make_intrusive<FtWork>(
      generation->rank,
      op.type,
      name,
      std::move(outputs),
      Clock::now() + timeout,
      timeout,
      laneIndex,
      generation->id);
  if (transport == nullptr || !generation->track(work)) {
    C10_THROW_ERROR(
        DistBackendError,
        std::string("ft: ") + name + " refused: generation " +
            std::to_string(generation->id) + " was aborted");
  }

  // Before issuing: a transport may connect (or wait for a non-blocking call
  // to settle) inside run(), and the watchdog bounds that too.
  watchdog_->poke(work->deadline());
  c10::intrusive_ptr<c10d::Work> inner;
  std::shared_ptr<HostStaging> staging;
  std::vector<at::Tensor>
      written; // what a staged op copies back (only then filled)
  try {
    blockingRegion()([&] {
      // A CUDA op on a lane NCCL cannot carry (ranks share a GPU) runs on the
      // lane's Gloo communicator over host copies of its tensors.
      const bool stage = device.is_cuda()
          ? transport->hostStaged(laneIndex, device, work->deadline())
          : stageCpuOps_.load();
      if (!stage) {
        inner = transport->run(laneIndex, call.direct, work->deadline());
        return;
      }
      Transport* cpu = transports.serving(c10::Device(c10::kCPU));
      TORCH_INTERNAL_ASSERT(cpu != nullptr, "ft: no CPU transport to stage on");
      transport = cpu; // its failedBy() judges what run() throws now
      staging =
          std::make_shared<HostStaging>(/*forceCpuCopies=*/device.is_cpu());
      written = work->result();
      inner = cpu->run(laneIndex, call.staged(*staging), work->deadline());
      hostStagedOps_.fetch_add(1);
    });
  } catch (...) {
    auto error = std::current_exception();
    work->fail(error);
    if (transport->failedBy(error)) {
      // The communicator failed, missed the deadline or was aborted while the
      // op was issued: the generation is unusable.
      generation->abort(
          FailureKind::kCommunication,
          std::string(name) + " on lane " + std::to_string(laneIndex) +
              " failed: " + messageOf(error));
    }
    // Otherwise the transport validated and refused the op before sending
    // anything, so the generation stays usable.
    generation->innerDone(work.get());
    std::rethrow_exception(error);
  }
  // The inner Work owns the tensors Gloo uses; holding it here means Gloo's
  // threads never drop the last C++ reference to a caller's tensor.
  work->holdInner(inner);

  if (staging) {
    // The result lands in the caller's tensors on success only, and before
    // the op's own finalize (an average divides what was copied back).
    finalize = [staging,
                written = std::move(written),
                then = std::move(finalize)](int size) {
      staging->copyBack(written);
      if (then) {
        then(size);
      }
    };
  }
  std::weak_ptr<Generation> weakGeneration = generation;
  const int size = generation->size;
  auto onInnerDone =
      [weakGeneration, work, size, finalize = std::move(finalize)](
          std::exception_ptr error) {
        auto generation = weakGeneration.lock();
        if (error) {
          const std::string message =
              "inner communicator error: " + messageOf(error);
          if (generation) {
            if (auto failure = generation->failure()) {
              // Already failed (a missed deadline, abort(), ...): this error is
              // most likely the consequence of the abort severing the sockets;
              // report the cause.
              error = generation->failureErrorFor(*work, failure->message);
            } else {
              generation->abort(FailureKind::kCommunication, message);
            }
          }
          work->fail(error);
        } else {
          work->succeed(
              finalize ? std::function<void()>([&] { finalize(size); })
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

void FtBackend::checkWorldMultiple(
    const at::Tensor& whole,
    const char* wholeRole,
    const at::Tensor& part,
    const char* partRole,
    const char* name) const {
  const int size = currentSize();
  TORCH_CHECK_VALUE(
      whole.numel() == part.numel() * size,
      "ft: ",
      name,
      ": ",
      wholeRole,
      " has ",
      whole.numel(),
      " elements, expected ",
      partRole,
      " (",
      part.numel(),
      ") x world_size (",
      size,
      ")");
}

template <auto Method, typename... Args>
c10::intrusive_ptr<c10d::Work> FtBackend::run(const Op& op, Args&... args) {
  const auto argsTuple = std::tie(args...);
  std::vector<at::Tensor> outputs = tensorList(std::get<0>(argsTuple));
  const auto& last = std::get<sizeof...(Args) - 1>(argsTuple);
  if constexpr (!requires { last.timeout; }) {
    // Point-to-point ops carry no options: the backend's timeout applies.
    auto call = callOnInner(Method, args...);
    return submit(op, std::move(outputs), c10d::kUnsetTimeout, call);
  } else if constexpr (!requires { last.reduceOp; }) {
    auto call = callOnInner(Method, args...);
    return submit(op, std::move(outputs), last.timeout, call);
  } else {
    // A rooted reduction's result is the root's only.
    bool holdsResult = true;
    if constexpr (requires { last.rootRank; }) {
      holdsResult = last.rootRank == currentRank();
    }
    auto [inner, finalize] = onTransport(last, outputs, op.name, holdsResult);
    auto call = callWithOptions(
        Method,
        argsTuple,
        std::make_index_sequence<sizeof...(Args) - 1>(),
        inner);
    return submit(op, std::move(outputs), last.timeout, call, finalize);
  }
}

// The op adapters: each names itself once (its Op), checks its arguments, and
// hands run() the c10d method of its own name and its own arguments.

FT_C10D_DEFINE(FtBackend, broadcast) {
  const Op op{c10d::OpType::BROADCAST, "broadcast"};
  checkTensors(tensors, op.name);
  checkRoot(opts.rootRank, op.name);
  return run<&Lane::broadcast>(op, tensors, opts);
}

FT_C10D_DEFINE(FtBackend, allreduce) {
  const Op op{c10d::OpType::ALLREDUCE, "allreduce"};
  checkTensors(tensors, op.name);
  return run<&Lane::allreduce>(op, tensors, opts);
}

FT_C10D_DEFINE(FtBackend, allreduce_coalesced) {
  const Op op{c10d::OpType::ALLREDUCE_COALESCED, "allreduce_coalesced"};
  checkTensors(tensors, op.name);
  return run<&Lane::allreduce_coalesced>(op, tensors, opts);
}

FT_C10D_DEFINE(FtBackend, reduce) {
  const Op op{c10d::OpType::REDUCE, "reduce"};
  checkTensors(tensors, op.name);
  checkRoot(opts.rootRank, op.name);
  return run<&Lane::reduce>(op, tensors, opts);
}

FT_C10D_DEFINE(FtBackend, allgather) {
  const Op op{c10d::OpType::ALLGATHER, "allgather"};
  checkEach(op.name, inputTensors, outputTensors);
  return run<&Lane::allgather>(op, outputTensors, inputTensors, opts);
}

FT_C10D_DEFINE(FtBackend, _allgather_base) {
  const Op op{c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor"};
  checkTensors({outputBuffer, inputBuffer}, op.name);
  checkWorldMultiple(outputBuffer, "output", inputBuffer, "input", op.name);
  return run<&Lane::_allgather_base>(op, outputBuffer, inputBuffer, opts);
}

FT_C10D_DEFINE(FtBackend, allgather_coalesced) {
  const Op op{c10d::OpType::ALLGATHER_COALESCED, "allgather_coalesced"};
  checkEach(op.name, inputTensors, outputTensors);
  return run<&Lane::allgather_coalesced>(op, outputTensors, inputTensors, opts);
}

FT_C10D_DEFINE(FtBackend, allgather_into_tensor_coalesced) {
  const Op op{c10d::OpType::COALESCED, "allgather_into_tensor_coalesced"};
  checkEach(op.name, inputs, outputs);
  return run<&Lane::allgather_into_tensor_coalesced>(op, outputs, inputs, opts);
}

FT_C10D_DEFINE(FtBackend, gather) {
  const Op op{c10d::OpType::GATHER, "gather"};
  checkEach(op.name, inputTensors, outputTensors);
  checkRoot(opts.rootRank, op.name);
  return run<&Lane::gather>(op, outputTensors, inputTensors, opts);
}

FT_C10D_DEFINE(FtBackend, scatter) {
  const Op op{c10d::OpType::SCATTER, "scatter"};
  checkEach(op.name, outputTensors, inputTensors);
  checkRoot(opts.rootRank, op.name);
  return run<&Lane::scatter>(op, outputTensors, inputTensors, opts);
}

FT_C10D_DEFINE(FtBackend, reduce_scatter) {
  const Op op{c10d::OpType::REDUCE_SCATTER, "reduce_scatter"};
  checkEach(op.name, outputTensors, inputTensors);
  return run<&Lane::reduce_scatter>(op, outputTensors, inputTensors, opts);
}

FT_C10D_DEFINE(FtBackend, _reduce_scatter_base) {
  const Op op{c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor"};
  checkTensors({outputBuffer, inputBuffer}, op.name);
  checkWorldMultiple(inputBuffer, "input", outputBuffer, "output", op.name);
  return run<&Lane::_reduce_scatter_base>(op, outputBuffer, inputBuffer, opts);
}

FT_C10D_DEFINE(FtBackend, reduce_scatter_tensor_coalesced) {
  const Op op{kReduceScatterTensorCoalesced, "reduce_scatter_tensor_coalesced"};
  checkEach(op.name, outputs, inputs);
  return run<&Lane::reduce_scatter_tensor_coalesced>(op, outputs, inputs, opts);
}

FT_C10D_DEFINE(FtBackend, alltoall_base) {
  const Op op{c10d::OpType::ALLTOALL_BASE, "all_to_all_single"};
  checkTensors({outputBuffer, inputBuffer}, op.name);
  return run<&Lane::alltoall_base>(
      op,
      outputBuffer,
      inputBuffer,
      outputSplitSizes,
      inputSplitSizes,
      opts);
}

FT_C10D_DEFINE(FtBackend, alltoall) {
  const Op op{c10d::OpType::ALLTOALL, "all_to_all"};
  checkEach(op.name, outputTensors, inputTensors);
  return run<&Lane::alltoall>(op, outputTensors, inputTensors, opts);
}

FT_C10D_DEFINE(FtBackend, send) {
  const Op op{c10d::OpType::SEND, "send"};
  checkTensors(tensors, op.name);
  checkPeer(dstRank, op.name, "destination");
  return run<&Lane::send>(op, tensors, dstRank, tag);
}

FT_C10D_DEFINE(FtBackend, recv) {
  const Op op{c10d::OpType::RECV, "recv"};
  checkTensors(tensors, op.name);
  checkPeer(srcRank, op.name, "source");
  return run<&Lane::recv>(op, tensors, srcRank, tag);
}

FT_C10D_DEFINE(FtBackend, recvAnysource) {
  const Op op{c10d::OpType::RECVANYSOURCE, "recv (any source)"};
  checkTensors(tensors, op.name);
  return run<&Lane::recvAnysource>(op, tensors, tag);
}

FT_C10D_DEFINE(FtBackend, barrier) {
  const Op op{c10d::OpType::BARRIER, "barrier"};
  // A CUDA barrier runs on the CUDA transport (and its wait() blocks the CPU)
  // when the backend has a CUDA device (only an NCCL build lets one be set);
  // otherwise every barrier is a CPU one.
  const int device = cudaDevice_.load();
  if (device >= 0 && opts.device && opts.device->is_cuda()) {
    c10d::BarrierOptions onDevice = opts;
    onDevice.device = at::Device(
        at::kCUDA,
        opts.device->has_index() ? opts.device->index() : device);
    auto token = at::empty(
        {1},
        at::TensorOptions().dtype(at::kInt).device(*onDevice.device));
    auto call = callOnInner(&c10d::Backend::barrier, onDevice);
    return submit(op, {token}, opts.timeout, call);
  }
  auto call = callOnInner(&c10d::Backend::barrier, opts);
  return submit(op, {}, opts.timeout, call);
}

} // namespace ft
