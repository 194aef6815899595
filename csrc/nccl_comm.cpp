// See nccl_comm.hpp for the contract.
#ifdef FT_USE_NCCL

#include "nccl_comm.hpp"
#include "c10d_compat.hpp"
#include "host_staging.hpp"
#include "work.hpp"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace ft {

namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

// Poll intervals. Every wait below is bounded by the op's deadline (or the
// configure()'s) and ends early on abort(); these only set how often it looks.
//
// Rank 0's unique id travels through the store, whose own wait abort() could
// not interrupt; each check is a store round trip, so it is coarse.
constexpr milliseconds kUniqueIdPoll(5);
// A non-blocking ncclCommInitRankConfig reports progress only through
// ncclCommGetAsyncError, polled with commMutex released so abort() gets in.
// Init takes tens of milliseconds at least.
constexpr milliseconds kInitPoll(1);
// An enqueue on a non-blocking communicator settles within microseconds, on
// the caller's path.
constexpr microseconds kSettlePoll(100);
// A blocking wait() whose own bound comes before the op's deadline: c10
// futures have no timed wait. A barrier's wait() is on the caller's path.
constexpr microseconds kCompletionPoll(200);
// The poller checks completion events, which have no host callback it could
// make NCCL calls from, while ops are pending.
constexpr microseconds kEventPoll(100);
// abort() waiting for the lane stream to empty: what is left there is copies
// or kernels ending, which take microseconds to milliseconds.
constexpr microseconds kDrainPoll(200);

// How long abort() waits, after ncclCommAbort, for the work still queued on
// the lane stream (an allgather's copy-out of its flat buffer, say) to run,
// so that none of it writes into a caller's tensor after abort() returned.
// Bounded because that work may sit behind the caller's own stream (each op
// waits for it first), whose work ft does not control; past the bound abort()
// returns with a warning.
constexpr milliseconds kAbortDrainBound(5000);

// The deadline of the op this thread is issuing: NcclTransport::run() sets it
// around the c10d call, whose signature has no room for it, and runOp() waits
// against it (a lazy connect, a call settling). It is the op's FtWork's
// deadline, so the watchdog and the lane give up at the same moment.
thread_local const Clock::time_point* tlsOpDeadline = nullptr;

class OpDeadlineScope {
 public:
  explicit OpDeadlineScope(const Clock::time_point& deadline)
      : previous_(tlsOpDeadline) {
    tlsOpDeadline = &deadline;
  }
  ~OpDeadlineScope() {
    tlsOpDeadline = previous_;
  }
  OpDeadlineScope(const OpDeadlineScope&) = delete;
  OpDeadlineScope& operator=(const OpDeadlineScope&) = delete;

 private:
  const Clock::time_point* const previous_;
};

[[noreturn]] void throwBackend(const std::string& message) {
  C10_THROW_ERROR(DistBackendError, "ft: " + message);
}

void checkCuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError(); // clear the sticky-free error state
    throwBackend(std::string(what) + " failed: " + cudaGetErrorString(err));
  }
}

std::string ncclMessage(ncclResult_t r, ncclComm_t comm) {
  std::string msg = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') {
    msg += " (";
    msg += last;
    msg += ")";
  }
  return msg;
}

ncclDataType_t ncclTypeOf(at::ScalarType type, const char* op) {
  switch (type) {
    case at::kFloat:
      return ncclFloat32;
    case at::kHalf:
      return ncclFloat16;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kDouble:
      return ncclFloat64;
    case at::kInt:
      return ncclInt32;
    case at::kLong:
      return ncclInt64;
    case at::kChar:
      return ncclInt8;
    case at::kByte:
    case at::kBool:
      return ncclUint8;
    default:
      TORCH_CHECK_TYPE(
          false,
          "ft: ",
          op,
          ": dtype ",
          type,
          " is not supported on the NCCL path");
  }
  return ncclFloat32; // unreachable
}

ncclRedOp_t
ncclOpOf(const c10d::ReduceOp& op, at::ScalarType type, const char* name) {
  if (type == at::kBool) {
    // NCCL has no bool: SUM/MAX are "any", PRODUCT/MIN are "all" on bytes.
    if (op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::MAX) {
      return ncclMax;
    }
    if (op == c10d::ReduceOp::PRODUCT || op == c10d::ReduceOp::MIN) {
      return ncclMin;
    }
  }
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return ncclSum;
    case c10d::ReduceOp::PRODUCT:
      return ncclProd;
    case c10d::ReduceOp::MIN:
      return ncclMin;
    case c10d::ReduceOp::MAX:
      return ncclMax;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK_TYPE(
          at::isFloatingType(type),
          "ft: ",
          name,
          ": ReduceOp.AVG needs floating-point tensors, got ",
          type);
      return ncclAvg;
    default:
      TORCH_CHECK_NOT_IMPLEMENTED(
          false,
          "ft: ",
          name,
          ": this reduce op is not supported on the NCCL path "
          "(supported: SUM, AVG, PRODUCT, MIN, MAX)");
  }
  return ncclSum; // unreachable
}

// All tensors of an op: CUDA, one device. Returns the device index.
int deviceOf(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK_VALUE(!tensors.empty(), "ft: ", op, ": no tensors");
  const auto device = tensors.front().device();
  for (const auto& t : tensors) {
    TORCH_CHECK_VALUE(
        t.is_cuda() && t.device() == device,
        "ft: ",
        op,
        ": all tensors must be on one CUDA device, got ",
        device,
        " and ",
        t.device());
  }
  return device.index();
}

void* ptr(const at::Tensor& t) {
  return t.data_ptr();
}

} // namespace

namespace {

// Lane streams are never destroyed, only handed from a released lane to the
// next one on the same device. Why: recordStream makes the caching allocator
// remember the lane stream of every tensor an op touched, and it records an
// event on that stream when the tensor is freed, which can be long after the
// lane (and its generation) is gone. A destroyed stream there is a fatal CUDA
// error ("context is destroyed") inside a tensor's destructor. A stream is
// only reused once its previous lane has released it and its queued work has
// drained, so live lanes never share one or wait on each other.
std::atomic<int> liveStreams{0};
std::mutex streamPoolMutex;
std::vector<std::pair<int, cudaStream_t>> freeStreams; // (device, stream)

cudaStream_t acquireLaneStream(int device) {
  {
    std::lock_guard<std::mutex> lock(streamPoolMutex);
    for (auto it = freeStreams.begin(); it != freeStreams.end(); ++it) {
      if (it->first != device) {
        continue;
      }
      // A stream released right after an abort may still hold the aborted
      // lane's queued work; a new lane behind it would wait for that.
      const cudaError_t q = cudaStreamQuery(it->second);
      (void)cudaGetLastError();
      if (q != cudaSuccess) {
        continue;
      }
      cudaStream_t stream = it->second;
      freeStreams.erase(it);
      liveStreams.fetch_add(1);
      return stream;
    }
  }
  cudaStream_t stream = nullptr;
  checkCuda(
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
      "cudaStreamCreate");
  liveStreams.fetch_add(1);
  return stream;
}

void releaseLaneStream(int device, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(streamPoolMutex);
  freeStreams.emplace_back(device, stream);
  liveStreams.fetch_sub(1);
}

} // namespace

int ncclLiveStreams() {
  return liveStreams.load();
}

namespace {

// ncclCommRevoke (NCCL 2.28.7 and later) stops a communicator's in-flight
// work without joining its proxy threads, which ncclCommAbort does with
// 500 ms polls (about a second on an H200). Found at run time in the libnccl
// this process loaded, so one build serves older libraries too (they abort
// in place). FT_NCCL_REVOKE=0 turns it off.
using RevokeFn = ncclResult_t (*)(ncclComm_t, int);
constexpr int kRevokeDefault = 0; // NCCL_REVOKE_DEFAULT: the only flag value
constexpr int kFirstRevokeVersion = 22807; // 2.28.7

RevokeFn linkedRevoke() {
  static const RevokeFn fn = []() -> RevokeFn {
    const char* env = std::getenv("FT_NCCL_REVOKE");
    if (env != nullptr && std::string(env) == "0") {
      return nullptr;
    }
    int version = 0;
    if (ncclGetVersion(&version) != ncclSuccess ||
        version < kFirstRevokeVersion) {
      return nullptr;
    }
    void* lib = dlopen("libnccl.so.2", RTLD_LAZY | RTLD_NOLOAD);
    if (lib == nullptr) {
      return nullptr;
    }
    return reinterpret_cast<RevokeFn>(dlsym(lib, "ncclCommRevoke"));
  }();
  return fn;
}

} // namespace

bool ncclRevokeAvailable() {
  return linkedRevoke() != nullptr;
}

int ncclLinkedVersion() {
  int version = 0;
  ncclResult_t r = ncclGetVersion(&version);
  TORCH_CHECK(
      r == ncclSuccess,
      "ft: ncclGetVersion failed: ",
      ncclGetErrorString(r));
  return version;
}

class NcclWork;

struct NcclLane::State {
  State(
      c10::intrusive_ptr<c10d::Store> store,
      int rank,
      int size,
      int lane,
      bool hostStageSharedGpu)
      : store(std::move(store)),
        rank(rank),
        size(size),
        lane(lane),
        hostStageSharedGpu(hostStageSharedGpu) {}
  ~State();

  const c10::intrusive_ptr<c10d::Store> store;
  const int rank;
  const int size;
  const int lane;
  const bool hostStageSharedGpu;

  std::mutex initMutex; // one connect() at a time
  // Ranks share a GPU: no communicator; ops run host-staged (hostStaged()).
  std::atomic<bool> hostStaged{false};
  // Serializes every call on `comm` (enqueue, async-error poll, abort).
  std::mutex commMutex;
  ncclComm_t comm = nullptr;
  bool revoked = false; // ncclCommRevoke was called on `comm` (commMutex)
  std::atomic<int> device{-1};
  cudaStream_t stream = nullptr;
  std::atomic<bool> aborted{false};
  std::atomic<bool> connected{false};
  // runOp calls in progress: ops that may still be putting work on `stream`
  // after closeIfIdle() looked at it.
  std::atomic<int> launching{0};

  std::mutex eventMutex;
  std::vector<cudaEvent_t> freeEvents;

  std::mutex pollMutex;
  std::condition_variable pollCv;
  std::deque<c10::intrusive_ptr<NcclWork>> pending;
  bool stopPoller = false;
  std::thread poller;

  cudaEvent_t takeEvent() {
    {
      std::lock_guard<std::mutex> lock(eventMutex);
      if (!freeEvents.empty()) {
        cudaEvent_t e = freeEvents.back();
        freeEvents.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device.load()));
    checkCuda(
        cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
        "cudaEventCreate");
    return e;
  }
  void giveEvent(cudaEvent_t e) {
    if (e != nullptr) {
      std::lock_guard<std::mutex> lock(eventMutex);
      freeEvents.push_back(e);
    }
  }

  void abortComm();
  // Stops the communicator's in-flight work with ncclCommRevoke and waits,
  // until `until` at most, for it to be quiescent; later ops are refused as
  // after abortComm(). The communicator is torn down (ncclCommAbort) when the
  // lane is destroyed, which only the Reaper does. False where revoke is not
  // available or did not take: the caller aborts in place.
  bool revokeComm(Clock::time_point until);
  void waitForKeys(
      const std::vector<std::string>& keys,
      Clock::time_point deadline,
      const std::string& what);
  bool decideSharedGpu(
      int device,
      Clock::time_point deadline,
      const std::string& where);
  // After abortComm(): waits, until `until` at most, for every op being
  // enqueued to finish and for the lane stream to empty.
  void drainStream(Clock::time_point until);
  // Waits while a non-blocking call on `comm` is in progress. `lock` holds
  // commMutex on entry and on return.
  ncclResult_t settle(
      ncclResult_t r,
      std::unique_lock<std::mutex>& lock,
      Clock::time_point deadline,
      const char* what);
  void pollLoop();
};

// The inner Work of one NCCL op. Its future (no devices: completed by the
// poller once the completion event has fired) drives the FtWork.
class NcclWork : public c10d::Work {
 public:
  NcclWork(
      int rank,
      c10d::OpType opType,
      std::shared_ptr<NcclLane::State> state,
      int device,
      std::vector<at::Tensor> outputs,
      std::vector<at::Tensor> inputs,
      bool blockingWait,
      Clock::time_point deadline)
      : c10d::Work(rank, opType),
        state_(std::move(state)),
        device_(device),
        deadline_(deadline),
        outputs_(std::move(outputs)),
        inputs_(std::move(inputs)),
        blockingWait_(blockingWait),
        future_(
            c10::make_intrusive<c10::ivalue::Future>(
                c10::ListType::create(c10::TensorType::get()))) {
    ready = state_->takeEvent();
    end = state_->takeEvent();
  }

  ~NcclWork() override {
    state_->giveEvent(ready);
    state_->giveEvent(end);
  }

  bool isCompleted() override {
    return future_->completed();
  }
  bool isSuccess() const override {
    return future_->completed() && !future_->hasError();
  }
  std::exception_ptr exception() const override {
    return future_->completed() && future_->hasError()
        ? future_->exception_ptr()
        : nullptr;
  }
  std::vector<at::Tensor> result() override {
    return outputs_;
  }

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    if (blockingWait_) {
      return block(timeout);
    }
    if (future_->completed() && future_->hasError()) {
      std::rethrow_exception(future_->exception_ptr());
    }
    // The caller's current stream waits for the op; the CPU does not.
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    auto current = c10::cuda::getCurrentCUDAStream(device_);
    checkCuda(
        cudaStreamWaitEvent(current.stream(), end, 0),
        "cudaStreamWaitEvent");
    return true;
  }

  void synchronize() override {
    block(kNoTimeout);
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

  // Blocks the CPU until the poller has seen the op finish, or the caller's
  // own `timeout` passes. Against the op's deadline: the backend's watchdog
  // aborts a late op then and the poller fails the future, so a wait allowed
  // to last that long just sleeps on the future.
  bool block(std::chrono::milliseconds timeout) {
    const auto until = timeout == kNoTimeout ? Clock::time_point::max()
                                             : Clock::now() + timeout;
    if (until >= deadline_) {
      future_->wait();
    } else {
      while (!future_->completed()) {
        if (Clock::now() >= until) {
          throwBackend(
              "wait() timed out after " + std::to_string(timeout.count()) +
              " ms");
        }
        std::this_thread::sleep_for(kCompletionPoll);
      }
    }
    if (future_->hasError()) {
      std::rethrow_exception(future_->exception_ptr());
    }
    // Order the caller's stream after the op too.
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    auto current = c10::cuda::getCurrentCUDAStream(device_);
    checkCuda(
        cudaStreamWaitEvent(current.stream(), end, 0),
        "cudaStreamWaitEvent");
    return true;
  }

  void complete(std::exception_ptr error) {
    if (future_->completed()) {
      return;
    }
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }

  cudaEvent_t ready = nullptr;
  cudaEvent_t end = nullptr;

 private:
  std::shared_ptr<NcclLane::State> state_;
  const int device_;
  const Clock::time_point deadline_; // the op's
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> inputs_;
  const bool blockingWait_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

NcclLane::State::~State() {
  abortComm();
  const int dev = device.load();
  if (dev < 0) {
    return;
  }
  if (stream != nullptr) {
    releaseLaneStream(dev, stream); // not destroyed: see acquireLaneStream
  }
  // Best effort: at process exit the driver may already be gone.
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  (void)cudaSetDevice(dev);
  for (cudaEvent_t e : freeEvents) {
    (void)cudaEventDestroy(e);
  }
  (void)cudaSetDevice(current);
  (void)cudaGetLastError();
}

void NcclLane::State::abortComm() {
  aborted.store(true);
  {
    std::lock_guard<std::mutex> lock(commMutex);
    if (comm != nullptr) {
      const int dev = device.load();
      if (dev >= 0) {
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
        (void)ncclCommAbort(comm);
      } else {
        (void)ncclCommAbort(comm);
      }
      comm = nullptr;
    }
  }
  pollCv.notify_all();
}

bool NcclLane::State::revokeComm(Clock::time_point until) {
  const RevokeFn revoke = linkedRevoke();
  if (revoke == nullptr) {
    return false;
  }
  std::unique_lock<std::mutex> lock(commMutex);
  if (comm == nullptr) {
    aborted.store(true);
    lock.unlock();
    pollCv.notify_all();
    return true; // never connected, or already torn down: nothing runs
  }
  if (!connected.load()) {
    return false; // an init in progress: ncclCommAbort ends it
  }
  aborted.store(true);
  const int dev = device.load();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
  if (!revoked) {
    const ncclResult_t r = revoke(comm, kRevokeDefault);
    if (r != ncclSuccess && r != ncclInProgress) {
      return false;
    }
    revoked = true;
  }
  // Quiescent once the state leaves ncclInProgress: the kernels have stopped.
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    if (q != ncclSuccess || state != ncclInProgress) {
      break;
    }
    if (Clock::now() >= until) {
      TORCH_WARN(
          "ft: NCCL lane ",
          lane,
          ": the revoked communicator was not quiescent after ",
          kAbortDrainBound.count(),
          " ms");
      break;
    }
    lock.unlock();
    std::this_thread::sleep_for(kSettlePoll);
    lock.lock();
  }
  lock.unlock();
  pollCv.notify_all(); // the poller fails what is pending
  return true;
}

ncclResult_t NcclLane::State::settle(
    ncclResult_t r,
    std::unique_lock<std::mutex>& lock,
    Clock::time_point deadline,
    const char* what) {
  while (r == ncclInProgress) {
    lock.unlock();
    std::this_thread::sleep_for(kSettlePoll);
    lock.lock();
    if (aborted.load() || comm == nullptr) {
      throwBackend(
          std::string(what) + " on NCCL lane " + std::to_string(lane) +
          " was aborted");
    }
    if (Clock::now() >= deadline) {
      lock.unlock();
      abortComm();
      lock.lock();
      throwBackend(
          std::string(what) + " on NCCL lane " + std::to_string(lane) +
          " missed its deadline; the communicator was aborted");
    }
    ncclResult_t state = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    r = q != ncclSuccess ? q : state;
  }
  return r;
}

void NcclLane::State::pollLoop() {
  const int dev = device.load();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
  auto laneStream = c10::cuda::getStreamFromExternal(
      stream,
      static_cast<c10::DeviceIndex>(dev));
  std::unique_lock<std::mutex> lock(pollMutex);
  while (true) {
    pollCv.wait(lock, [&] { return stopPoller || !pending.empty(); });
    if (pending.empty()) {
      return;
    }
    std::vector<c10::intrusive_ptr<NcclWork>> batch(
        pending.begin(),
        pending.end());
    const bool stopping = stopPoller;
    lock.unlock();

    std::string failure;
    if (aborted.load()) {
      failure = "the NCCL communicator of lane " + std::to_string(lane) +
          " was aborted";
    } else if (stopping) {
      failure = "the NCCL lane " + std::to_string(lane) + " was released";
    } else {
      std::lock_guard<std::mutex> commLock(commMutex);
      if (comm != nullptr) {
        ncclResult_t state = ncclSuccess;
        ncclResult_t q = ncclCommGetAsyncError(comm, &state);
        ncclResult_t r = q != ncclSuccess ? q : state;
        if (r != ncclSuccess && r != ncclInProgress) {
          failure = "NCCL communicator of lane " + std::to_string(lane) +
              " failed: " + ncclMessage(r, comm);
        }
      }
    }

    size_t finished = 0;
    std::vector<std::pair<c10::intrusive_ptr<NcclWork>, std::exception_ptr>>
        done;
    for (auto& work : batch) {
      std::exception_ptr error;
      if (!failure.empty()) {
        try {
          throwBackend(failure);
        } catch (...) {
          error = std::current_exception();
        }
      } else {
        cudaError_t q = cudaEventQuery(work->end);
        if (q == cudaErrorNotReady) {
          break; // one stream: later ops finish later
        }
        if (q != cudaSuccess) {
          (void)cudaGetLastError();
          try {
            throwBackend(
                std::string("CUDA error on NCCL lane ") + std::to_string(lane) +
                ": " + cudaGetErrorString(q));
          } catch (...) {
            error = std::current_exception();
          }
        }
      }
      done.emplace_back(work, error);
      ++finished;
    }
    batch.clear();
    if (finished > 0) {
      lock.lock();
      for (size_t i = 0; i < finished && !pending.empty(); ++i) {
        pending.pop_front(); // `done` still holds these
      }
      lock.unlock();
      {
        // Completing runs the FtWork's callbacks; with the lane stream
        // current, a CUDA-aware future records its events on the stream the
        // op ran on.
        c10::cuda::CUDAStreamGuard streamGuard(laneStream);
        for (auto& [work, error] : done) {
          work->complete(error);
        }
      }
      // Dropping the last reference to a caller's tensor may need the GIL:
      // never here. The releaser drops them after the FtWork (FIFO).
      for (auto& entry : done) {
        releaseLater(std::move(entry.first));
      }
      done.clear();
    }
    lock.lock();
    if (!pending.empty() && finished == 0) {
      pollCv.wait_for(lock, kEventPoll);
    }
  }
}

NcclLane::NcclLane(
    c10::intrusive_ptr<c10d::Store> store,
    int rank,
    int size,
    int lane,
    bool hostStageSharedGpu)
    : c10d::Backend(rank, size),
      state_(
          std::make_shared<State>(
              std::move(store),
              rank,
              size,
              lane,
              hostStageSharedGpu)) {}

NcclLane::~NcclLane() {
  state_->abortComm();
  {
    std::lock_guard<std::mutex> lock(state_->pollMutex);
    state_->stopPoller = true;
  }
  state_->pollCv.notify_all();
  if (state_->poller.joinable()) {
    if (state_->poller.get_id() == std::this_thread::get_id()) {
      // The last reference went away on the poller itself (an abort it
      // raised raced with the Reaper); it exits on its own and the state,
      // shared with it, outlives it.
      state_->poller.detach();
    } else {
      state_->poller.join();
    }
  }
}

bool NcclLane::connected() const {
  return state_->connected.load();
}

bool NcclLane::hostStaged() const {
  return state_->hostStaged.load();
}

namespace {

// The physical GPU behind `device`, as every process names it.
std::string deviceUuid(int device) {
  cudaDeviceProp prop;
  checkCuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  static const char* kHex = "0123456789abcdef";
  std::string id = "GPU-";
  for (unsigned char byte : prop.uuid.bytes) {
    id += kHex[byte >> 4];
    id += kHex[byte & 15];
  }
  return id;
}

void checkBoundDevice(const NcclLane::State& s, int device) {
  TORCH_CHECK_VALUE(
      s.device.load() == device,
      "ft: NCCL lane ",
      s.lane,
      " is bound to cuda:",
      s.device.load(),
      ", got a tensor on cuda:",
      device);
}

std::string describeSharing(const std::vector<std::vector<int>>& groups) {
  std::string text;
  for (const auto& group : groups) {
    text += text.empty() ? "ranks " : "; ranks ";
    for (size_t i = 0; i < group.size(); ++i) {
      text += (i == 0 ? "" : (i + 1 == group.size() ? " and " : ", ")) +
          std::to_string(group[i]);
    }
  }
  return text + " are on one GPU";
}

} // namespace

bool NcclLane::closeIfIdle() {
  State& s = *state_;
  // Under commMutex: an op being enqueued finishes first, and every later one
  // sees `aborted` and is refused.
  std::lock_guard<std::mutex> lock(s.commMutex);
  s.aborted.store(true);
  if (s.comm != nullptr && !s.connected.load()) {
    return false; // ncclCommInitRankConfig still in progress
  }
  if (s.launching.load() > 0) {
    return false; // an op may be putting work on the stream right now
  }
  if (s.stream == nullptr) {
    return true; // never connected: nothing was ever enqueued
  }
  // The stream is this lane's alone, so it holds every kernel and copy of its
  // ops (also those of an op that failed after enqueueing, never in `pending`).
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(s.device.load()));
  const cudaError_t q = cudaStreamQuery(s.stream);
  (void)
      cudaGetLastError(); // NotReady must not linger as the caller's last error
  return q == cudaSuccess;
}

int NcclLane::device() const {
  return state_->device.load();
}

void NcclLane::abort() {
  const auto until = Clock::now() + kAbortDrainBound;
  if (!state_->revokeComm(until)) {
    state_->abortComm();
  }
  state_->drainStream(until);
}

void NcclLane::State::drainStream(Clock::time_point until) {
  // Ops reach the stream only once the lane has connected, and `stream` was
  // set before `connected`.
  if (!connected.load()) {
    return;
  }
  const int dev = device.load();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
  while (true) {
    // An op being enqueued may still add to the stream (see closeIfIdle).
    if (launching.load() == 0) {
      const cudaError_t q = cudaStreamQuery(stream);
      // NotReady must not linger as the caller's last error.
      (void)cudaGetLastError();
      if (q != cudaErrorNotReady) {
        return; // empty, or failed: nothing more runs there either way
      }
    }
    if (Clock::now() >= until) {
      TORCH_WARN(
          "ft: NCCL lane ",
          lane,
          ": its stream still held work ",
          kAbortDrainBound.count(),
          " ms after the abort; it may yet write into its ops' tensors");
      return;
    }
    std::this_thread::sleep_for(kDrainPoll);
  }
}

// Polls the lane's store until every key in `keys` is set, so that abort()
// and the deadline can end the wait; `what` names it in the errors.
void NcclLane::State::waitForKeys(
    const std::vector<std::string>& keys,
    Clock::time_point deadline,
    const std::string& what) {
  while (!store->check(keys)) {
    if (aborted.load()) {
      throwBackend(what + " was aborted");
    }
    if (Clock::now() >= deadline) {
      throwBackend(what + " missed its deadline");
    }
    std::this_thread::sleep_for(kUniqueIdPoll);
  }
}

// Which GPU each rank is on: NCCL cannot make a communicator with two ranks
// on one GPU (it fails the init, on every rank), so the lane decides before
// asking it, the same way on every rank (they all read the same UUIDs).
// Returns whether the lane is host-staged; throws ValueError where the job
// refuses to share GPUs.
bool NcclLane::State::decideSharedGpu(
    int device,
    Clock::time_point deadline,
    const std::string& where) {
  store->set("dev/" + std::to_string(rank), deviceUuid(device));
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) {
    keys.push_back("dev/" + std::to_string(r));
  }
  waitForKeys(keys, deadline, where + ", while the ranks named their GPUs,");
  std::vector<std::string> ids;
  for (const auto& key : keys) {
    const auto bytes = store->get(key);
    ids.emplace_back(bytes.begin(), bytes.end());
  }
  const auto sharing = sharedDevices(ids);
  if (sharing.empty()) {
    return false;
  }
  const std::string why = describeSharing(sharing) + " (" +
      ids[sharing.front().front()] +
      "), and NCCL cannot run a communicator with two ranks on one GPU";
  TORCH_CHECK_VALUE(
      hostStageSharedGpu,
      "ft: NCCL lane ",
      lane,
      ": ",
      why,
      ". Give every rank its own GPU (ft-launch places replica groups on their "
      "own GPUs where there are enough), or allow host-staged collectives "
      "(shared_gpu=\"host-staged\", FT_SHARED_GPU=host-staged)");
  TORCH_WARN_ONCE(
      "ft: ",
      why,
      ": CUDA collectives go host-staged over Gloo (pinned host copy, Gloo, "
      "copy back), much slower than NCCL. Give every rank its own GPU for "
      "NCCL speed, or set FT_SHARED_GPU=error to refuse instead.");
  return true;
}

void NcclLane::connect(int device, Clock::time_point deadline) {
  State& s = *state_;
  std::lock_guard<std::mutex> initLock(s.initMutex);
  if (s.connected.load() || s.hostStaged.load()) {
    checkBoundDevice(s, device);
    if (s.aborted.load()) {
      throwBackend("NCCL lane " + std::to_string(s.lane) + " was aborted");
    }
    return;
  }
  if (s.aborted.load()) {
    throwBackend(
        "NCCL lane " + std::to_string(s.lane) +
        " was aborted before it connected");
  }
  const std::string where = "NCCL init of lane " + std::to_string(s.lane) +
      " (rank " + std::to_string(s.rank) + " of " + std::to_string(s.size) +
      ")";
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  if (s.decideSharedGpu(device, deadline, where)) {
    s.device.store(device);
    s.hostStaged.store(true);
    return;
  }
  if (s.stream == nullptr) {
    s.device.store(device);
    s.stream = acquireLaneStream(device);
  }

  ncclUniqueId uid;
  std::memset(&uid, 0, sizeof(uid));
  if (s.rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&uid);
    if (r != ncclSuccess) {
      throwBackend(
          where + ": ncclGetUniqueId failed: " + ncclGetErrorString(r));
    }
    const auto* bytes = reinterpret_cast<const uint8_t*>(&uid);
    s.store->set("uid", std::vector<uint8_t>(bytes, bytes + sizeof(uid)));
  } else {
    s.waitForKeys(
        {"uid"},
        deadline,
        where + ", waiting for rank 0's unique id,");
    auto bytes = s.store->get("uid");
    TORCH_CHECK(
        bytes.size() == sizeof(uid),
        "ft: ",
        where,
        ": bad unique id in the store");
    std::memcpy(&uid, bytes.data(), sizeof(uid));
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  {
    std::unique_lock<std::mutex> lock(s.commMutex);
    if (s.aborted.load()) {
      throwBackend(where + " was aborted");
    }
    ncclComm_t comm = nullptr;
    ncclResult_t r =
        ncclCommInitRankConfig(&comm, s.size, uid, s.rank, &config);
    if (comm != nullptr) {
      s.comm = comm; // reachable by abort() while the init is in progress
    }
    if (r != ncclSuccess && r != ncclInProgress) {
      lock.unlock();
      s.abortComm();
      throwBackend(
          where + ": ncclCommInitRankConfig failed: " + ncclGetErrorString(r));
    }
    while (true) {
      if (s.aborted.load() || s.comm == nullptr) {
        throwBackend(where + " was aborted");
      }
      ncclResult_t state = ncclSuccess;
      ncclResult_t q = ncclCommGetAsyncError(s.comm, &state);
      ncclResult_t now = q != ncclSuccess ? q : state;
      if (now == ncclSuccess) {
        break;
      }
      if (now != ncclInProgress) {
        const std::string msg = ncclMessage(now, s.comm);
        lock.unlock();
        s.abortComm();
        throwBackend(where + " failed: " + msg);
      }
      if (Clock::now() >= deadline) {
        lock.unlock();
        s.abortComm();
        throwBackend(
            where +
            " missed its deadline (a peer never joined); "
            "the communicator was aborted");
      }
      lock.unlock();
      std::this_thread::sleep_for(kInitPoll);
      lock.lock();
    }
  }
  s.connected.store(true);
  s.poller = std::thread([state = state_] { state->pollLoop(); });
}

namespace {

struct OpSpec {
  c10d::OpType type;
  const char* name;
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> outputs;
  // Runs on the lane stream before the NCCL calls (staging copies).
  std::function<void()> pre;
  // The NCCL calls (one, or a group); returns the last call's result.
  std::function<ncclResult_t(ncclComm_t, cudaStream_t)> nccl;
  // Runs on the lane stream after the NCCL calls (copies out).
  std::function<void()> post;
  bool blockingWait = false;
};

} // namespace

// Shared by every op: see the stream semantics in nccl_comm.hpp.
static c10::intrusive_ptr<c10d::Work> runOp(
    const std::shared_ptr<NcclLane::State>& statePtr,
    NcclLane& lane,
    OpSpec spec) {
  NcclLane::State& s = *statePtr;
  std::vector<at::Tensor> all = spec.inputs;
  all.insert(all.end(), spec.outputs.begin(), spec.outputs.end());
  const int device = deviceOf(all, spec.name);
  TORCH_INTERNAL_ASSERT(
      tlsOpDeadline != nullptr,
      "ft: an NCCL op issued outside NcclTransport::run()");
  const Clock::time_point deadline = *tlsOpDeadline;
  lane.connect(device, deadline);
  TORCH_CHECK_VALUE(
      !s.hostStaged.load(),
      "ft: ",
      spec.name,
      ": NCCL lane ",
      s.lane,
      " is host-staged (ranks share a GPU); its ops run on the CPU transport");

  const auto dev = static_cast<c10::DeviceIndex>(device);
  c10::cuda::CUDAGuard guard(dev);
  auto caller = c10::cuda::getCurrentCUDAStream(dev);
  auto laneStream = c10::cuda::getStreamFromExternal(s.stream, dev);
  auto work = c10::make_intrusive<NcclWork>(
      s.rank,
      spec.type,
      statePtr,
      device,
      spec.outputs,
      spec.inputs,
      spec.blockingWait,
      deadline);
  // Counted until this function returns, whichever way (see closeIfIdle).
  struct Launching {
    std::atomic<int>& count;
    explicit Launching(std::atomic<int>& c) : count(c) {
      count.fetch_add(1);
    }
    ~Launching() {
      count.fetch_sub(1);
    }
  } launching(s.launching);

  checkCuda(cudaEventRecord(work->ready, caller.stream()), "cudaEventRecord");
  checkCuda(
      cudaStreamWaitEvent(s.stream, work->ready, 0),
      "cudaStreamWaitEvent");
  {
    c10::cuda::CUDAStreamGuard streamGuard(laneStream);
    if (spec.pre) {
      spec.pre();
    }
    {
      std::unique_lock<std::mutex> lock(s.commMutex);
      if (s.aborted.load() || s.comm == nullptr) {
        throwBackend(
            std::string(spec.name) + ": NCCL lane " + std::to_string(s.lane) +
            " was aborted");
      }
      ncclResult_t r = spec.nccl(s.comm, s.stream);
      // Non-blocking communicator: the kernels are on the stream only once
      // the call has settled.
      r = s.settle(r, lock, deadline, spec.name);
      if (r != ncclSuccess) {
        const std::string msg =
            s.comm ? ncclMessage(r, s.comm) : ncclGetErrorString(r);
        lock.unlock();
        s.abortComm();
        throwBackend(
            std::string(spec.name) + " on NCCL lane " + std::to_string(s.lane) +
            " failed: " + msg);
      }
    }
    if (spec.post) {
      spec.post();
    }
    checkCuda(cudaEventRecord(work->end, s.stream), "cudaEventRecord");
  }
  // Keep the caller's tensors' memory from being reused before the lane
  // stream is done with it.
  for (const auto& t : all) {
    if (t.storage().data_ptr().get() != nullptr) {
      c10::cuda::CUDACachingAllocator::recordStream(
          t.storage().data_ptr(),
          laneStream);
    }
  }
  {
    std::lock_guard<std::mutex> lock(s.pollMutex);
    s.pending.push_back(work);
  }
  s.pollCv.notify_all();
  return work;
}

c10::intrusive_ptr<c10d::Work> NcclLane::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  TORCH_CHECK_VALUE(!tensors.empty(), "ft: allreduce: no tensors");
  const auto dtype = ncclTypeOf(tensors.front().scalar_type(), "allreduce");
  const auto op =
      ncclOpOf(opts.reduceOp, tensors.front().scalar_type(), "allreduce");
  OpSpec spec{c10d::OpType::ALLREDUCE, "allreduce", tensors, tensors};
  spec.nccl = [tensors, dtype, op](ncclComm_t comm, cudaStream_t stream) {
    if (tensors.size() == 1) {
      const auto& t = tensors.front();
      return ncclAllReduce(ptr(t), ptr(t), t.numel(), dtype, op, comm, stream);
    }
    ncclGroupStart();
    for (const auto& t : tensors) {
      ncclAllReduce(ptr(t), ptr(t), t.numel(), dtype, op, comm, stream);
    }
    return ncclGroupEnd();
  };
  return runOp(state_, *this, std::move(spec));
}

c10::intrusive_ptr<c10d::Work> NcclLane::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  c10d::AllreduceOptions single;
  single.reduceOp = opts.reduceOp;
  single.timeout = opts.timeout;
  auto work = allreduce(tensors, single);
  return work;
}

c10::intrusive_ptr<c10d::Work> NcclLane::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "ft: reduce: expected one tensor");
  const auto dtype = ncclTypeOf(tensors.front().scalar_type(), "reduce");
  const auto op =
      ncclOpOf(opts.reduceOp, tensors.front().scalar_type(), "reduce");
  const int root = static_cast<int>(opts.rootRank);
  OpSpec spec{c10d::OpType::REDUCE, "reduce", tensors, tensors};
  spec.nccl = [t = tensors.front(), dtype, op, root](
                  ncclComm_t comm,
                  cudaStream_t stream) {
    return ncclReduce(ptr(t), ptr(t), t.numel(), dtype, op, root, comm, stream);
  };
  return runOp(state_, *this, std::move(spec));
}

c10::intrusive_ptr<c10d::Work> NcclLane::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  TORCH_CHECK_VALUE(!tensors.empty(), "ft: broadcast: no tensors");
  const auto dtype = ncclTypeOf(tensors.front().scalar_type(), "broadcast");
  const int root = static_cast<int>(opts.rootRank);
  OpSpec spec{c10d::OpType::BROADCAST, "broadcast", tensors, tensors};
  spec.nccl = [tensors, dtype, root](ncclComm_t comm, cudaStream_t stream) {
    ncclGroupStart();
    for (const auto& t : tensors) {
      ncclBroadcast(ptr(t), ptr(t), t.numel(), dtype, root, comm, stream);
    }
    return ncclGroupEnd();
  };
  return runOp(state_, *this, std::move(spec));
}

c10::intrusive_ptr<c10d::Work> NcclLane::allgather(
    std::vector<std::vector<at::Tensor>>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::AllgatherOptions& /*opts*/) {
  TORCH_CHECK_VALUE(
      inputTensors.size() == 1 && outputTensors.size() == 1,
      "ft: allgather: expected one input tensor and one output list");
  const auto& in = inputTensors.front();
  const auto& outs = outputTensors.front();
  TORCH_CHECK_VALUE(
      static_cast<int>(outs.size()) == getSize(),
      "ft: allgather: expected ",
      getSize(),
      " output tensors, got ",
      outs.size());
  for (const auto& o : outs) {
    TORCH_CHECK_VALUE(
        o.numel() == in.numel() && o.scalar_type() == in.scalar_type(),
        "ft: allgather: every output must match the input's size and dtype");
  }
  const auto dtype = ncclTypeOf(in.scalar_type(), "allgather");
  auto flat = std::make_shared<at::Tensor>();
  OpSpec spec{c10d::OpType::ALLGATHER, "allgather", inputTensors, outs};
  const int64_t n = in.numel();
  const int size = getSize();
  spec.pre = [flat, in, n, size] {
    *flat = at::empty({n * size}, in.options());
  };
  spec.nccl = [flat, in, n, dtype](ncclComm_t comm, cudaStream_t stream) {
    return ncclAllGather(ptr(in), ptr(*flat), n, dtype, comm, stream);
  };
  spec.post = [flat, outs, n] {
    for (size_t i = 0; i < outs.size(); ++i) {
      outs[i].view({-1}).copy_(
          flat->narrow(0, static_cast<int64_t>(i) * n, n),
          true);
    }
    flat->reset();
  };
  return runOp(state_, *this, std::move(spec));
}

c10::intrusive_ptr<c10d::Work> NcclLane::_allgather_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    const c10d::AllgatherOptions& /*opts*/) {
  TORCH_CHECK_TYPE(
      outputBuffer.scalar_type() == inputBuffer.scalar_type(),
      "ft: all_gather_into_tensor: input and output dtypes differ");
  const auto dtype =
      ncclTypeOf(inputBuffer.scalar_type(), "all_gather_into_tensor");
  OpSpec spec{
      c10d::OpType::_ALLGATHER_BASE,
      "all_gather_into_tensor",
      {inputBuffer},
      {outputBuffer}};
  spec.nccl = [out = outputBuffer,
               in = inputBuffer,
               dtype](ncclComm_t comm, cudaStream_t stream) {
    return ncclAllGather(ptr(in), ptr(out), in.numel(), dtype, comm, stream);
  };
  return runOp(state_, *this, std::move(spec));
}

c10::intrusive_ptr<c10d::Work> NcclLane::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& /*opts*/) {
  TORCH_CHECK_VALUE(
      outputs.size() == inputs.size() && !inputs.empty(),
      "ft: allgather_into_tensor_coalesced: need as many outputs as inputs");
  const auto dtype = ncclTypeOf(
      inputs.front().scalar_type(),
      "allgather_into_tensor_coalesced");
  OpSpec spec{
      c10d::OpType::COALESCED,
      "allgather_into_tensor_coalesced",
      inputs,
      outputs};
  spec.nccl = [outputs, inputs, dtype](ncclComm_t comm, cudaStream_t stream) {
    ncclGroupStart();
    for (size_t i = 0; i < inputs.size(); ++i) {
      ncclAllGather(
          ptr(inputs[i]),
          ptr(outputs[i]),
          inputs[i].numel(),
          dtype,
          comm,
          stream);
    }
    return ncclGroupEnd();
  };
  return runOp(state_, *this, std::move(spec));
}

c10::intrusive_ptr<c10d::Work> NcclLane::reduce_scatter(
    std::vector<at::Tensor>& outputTensors,
    std::vector<std::vector<at::Tensor>>& inputTensors,
    const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(
      outputTensors.size() == 1 && inputTensors.size() == 1,
      "ft: reduce_scatter: expected one output tensor and one input list");
  const auto& out = outputTensors.front();
  const auto& ins = inputTensors.front();
  TORCH_CHECK_VALUE(
      static_cast<int>(ins.size()) == getSize(),
      "ft: reduce_scatter: expected ",
      getSize(),
      " input tensors, got ",
      ins.size());
  for (const auto& i : ins) {
    TORCH_CHECK_VALUE(
        i.numel() == out.numel() && i.scalar_type() == out.scalar_type(),
        "ft: reduce_scatter: every input must match the output's size and "
        "dtype");
  }
  const auto dtype = ncclTypeOf(out.scalar_type(), "reduce_scatter");
  const auto op = ncclOpOf(opts.reduceOp, out.scalar_type(), "reduce_scatter");
  auto flat = std::make_shared<at::Tensor>();
  OpSpec spec{
      c10d::OpType::REDUCE_SCATTER,
      "reduce_scatter",
      ins,
      outputTensors};
  const int64_t n = out.numel();
  spec.pre = [flat, ins, n] {
    std::vector<at::Tensor> views;
    views.reserve(ins.size());
    for (const auto& i : ins) {
      views.push_back(i.view({-1}));
    }
    *flat = at::cat(views);
  };
  spec.nccl = [flat, out, n, dtype, op](ncclComm_t comm, cudaStream_t stream) {
    return ncclReduceScatter(ptr(*flat), ptr(out), n, dtype, op, comm, stream);
  };
  spec.post = [flat] { flat->reset(); };
  return runOp(state_, *this, std::move(spec));
}

c10::intrusive_ptr<c10d::Work> NcclLane::_reduce_scatter_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_TYPE(
      outputBuffer.scalar_type() == inputBuffer.scalar_type(),
      "ft: reduce_scatter_tensor: input and output dtypes differ");
  const auto dtype =
      ncclTypeOf(outputBuffer.scalar_type(), "reduce_scatter_tensor");
  const auto op = ncclOpOf(
      opts.reduceOp,
      outputBuffer.scalar_type(),
      "reduce_scatter_tensor");
  OpSpec spec{
      c10d::OpType::_REDUCE_SCATTER_BASE,
      "reduce_scatter_tensor",
      {inputBuffer},
      {outputBuffer}};
  spec.nccl = [out = outputBuffer, in = inputBuffer, dtype, op](
                  ncclComm_t comm,
                  cudaStream_t stream) {
    return ncclReduceScatter(
        ptr(in),
        ptr(out),
        out.numel(),
        dtype,
        op,
        comm,
        stream);
  };
  return runOp(state_, *this, std::move(spec));
}

c10::intrusive_ptr<c10d::Work> NcclLane::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(
      outputs.size() == inputs.size() && !inputs.empty(),
      "ft: reduce_scatter_tensor_coalesced: need as many outputs as inputs");
  const auto dtype = ncclTypeOf(
      outputs.front().scalar_type(),
      "reduce_scatter_tensor_coalesced");
  const auto op = ncclOpOf(
      opts.reduceOp,
      outputs.front().scalar_type(),
      "reduce_scatter_tensor_coalesced");
  OpSpec spec{
      kReduceScatterTensorCoalesced,
      "reduce_scatter_tensor_coalesced",
      inputs,
      outputs};
  spec.nccl =
      [outputs, inputs, dtype, op](ncclComm_t comm, cudaStream_t stream) {
        ncclGroupStart();
        for (size_t i = 0; i < inputs.size(); ++i) {
          ncclReduceScatter(
              ptr(inputs[i]),
              ptr(outputs[i]),
              outputs[i].numel(),
              dtype,
              op,
              comm,
              stream);
        }
        return ncclGroupEnd();
      };
  return runOp(state_, *this, std::move(spec));
}

c10::intrusive_ptr<c10d::Work> NcclLane::alltoall_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& /*opts*/) {
  const int size = getSize();
  TORCH_CHECK_TYPE(
      outputBuffer.scalar_type() == inputBuffer.scalar_type(),
      "ft: all_to_all_single: input and output dtypes differ");
  const auto dtype = ncclTypeOf(inputBuffer.scalar_type(), "all_to_all_single");
  // Offsets and counts in elements; splits are in rows of dim 0.
  auto layout = [size](
                    const at::Tensor& t,
                    const std::vector<int64_t>& splits,
                    const char* which) {
    std::vector<int64_t> counts(size), offsets(size);
    const int64_t rows = t.dim() > 0 ? t.size(0) : 1;
    const int64_t rowElems = rows > 0 ? t.numel() / rows : 0;
    if (splits.empty()) {
      TORCH_CHECK_VALUE(
          rows % size == 0,
          "ft: all_to_all_single: ",
          which,
          " dim 0 (",
          rows,
          ") is not divisible by world_size ",
          size);
      for (int p = 0; p < size; ++p) {
        counts[p] = rows / size * rowElems;
        offsets[p] = p * counts[p];
      }
    } else {
      TORCH_CHECK_VALUE(
          static_cast<int>(splits.size()) == size,
          "ft: all_to_all_single: ",
          which,
          " split sizes need world_size entries");
      int64_t at = 0;
      for (int p = 0; p < size; ++p) {
        counts[p] = splits[p] * rowElems;
        offsets[p] = at;
        at += counts[p];
      }
      TORCH_CHECK_VALUE(
          at <= t.numel(),
          "ft: all_to_all_single: ",
          which,
          " split sizes exceed the tensor");
    }
    return std::make_pair(counts, offsets);
  };
  auto [sendCounts, sendOffsets] =
      layout(inputBuffer, inputSplitSizes, "input");
  auto [recvCounts, recvOffsets] =
      layout(outputBuffer, outputSplitSizes, "output");
  const size_t elem = inputBuffer.element_size();
  OpSpec spec{
      c10d::OpType::ALLTOALL_BASE,
      "all_to_all_single",
      {inputBuffer},
      {outputBuffer}};
  spec.nccl = [in = inputBuffer,
               out = outputBuffer,
               sendCounts = sendCounts,
               sendOffsets = sendOffsets,
               recvCounts = recvCounts,
               recvOffsets = recvOffsets,
               elem,
               dtype,
               size](ncclComm_t comm, cudaStream_t stream) {
    auto* src = static_cast<char*>(ptr(in));
    auto* dst = static_cast<char*>(ptr(out));
    ncclGroupStart();
    for (int p = 0; p < size; ++p) {
      if (sendCounts[p] > 0) {
        ncclSend(
            src + sendOffsets[p] * elem,
            sendCounts[p],
            dtype,
            p,
            comm,
            stream);
      }
      if (recvCounts[p] > 0) {
        ncclRecv(
            dst + recvOffsets[p] * elem,
            recvCounts[p],
            dtype,
            p,
            comm,
            stream);
      }
    }
    return ncclGroupEnd();
  };
  return runOp(state_, *this, std::move(spec));
}

c10::intrusive_ptr<c10d::Work>
NcclLane::send(std::vector<at::Tensor>& tensors, int dstRank, int /*tag*/) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "ft: send: expected one tensor");
  const auto dtype = ncclTypeOf(tensors.front().scalar_type(), "send");
  OpSpec spec{c10d::OpType::SEND, "send", tensors, {}};
  spec.nccl = [t = tensors.front(),
               dtype,
               dstRank](ncclComm_t comm, cudaStream_t stream) {
    return ncclSend(ptr(t), t.numel(), dtype, dstRank, comm, stream);
  };
  return runOp(state_, *this, std::move(spec));
}

c10::intrusive_ptr<c10d::Work>
NcclLane::recv(std::vector<at::Tensor>& tensors, int srcRank, int /*tag*/) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "ft: recv: expected one tensor");
  const auto dtype = ncclTypeOf(tensors.front().scalar_type(), "recv");
  OpSpec spec{c10d::OpType::RECV, "recv", {}, tensors};
  spec.nccl = [t = tensors.front(),
               dtype,
               srcRank](ncclComm_t comm, cudaStream_t stream) {
    return ncclRecv(ptr(t), t.numel(), dtype, srcRank, comm, stream);
  };
  return runOp(state_, *this, std::move(spec));
}

c10::intrusive_ptr<c10d::Work> NcclLane::barrier(
    const c10d::BarrierOptions& opts) {
  TORCH_CHECK_VALUE(
      opts.device && opts.device->is_cuda() && opts.device->has_index(),
      "ft: barrier: the NCCL lane needs the CUDA device to run on");
  const int device = opts.device->index();
  auto token = at::zeros(
      {1},
      at::TensorOptions().dtype(at::kInt).device(
          at::Device(at::kCUDA, device)));
  OpSpec spec{c10d::OpType::BARRIER, "barrier", {token}, {token}};
  spec.nccl = [token](ncclComm_t comm, cudaStream_t stream) {
    return ncclAllReduce(
        ptr(token),
        ptr(token),
        1,
        ncclInt32,
        ncclSum,
        comm,
        stream);
  };
  spec.blockingWait = true;
  return runOp(state_, *this, std::move(spec));
}

namespace {

class NcclTransport final : public Transport {
 public:
  explicit NcclTransport(std::vector<c10::intrusive_ptr<NcclLane>> lanes)
      : lanes_(std::move(lanes)) {}

  const char* name() const override {
    return "NCCL";
  }
  bool serves(const c10::Device& device) const override {
    return device.is_cuda();
  }
  void connect(int device, Clock::time_point deadline) override {
    for (const auto& lane : lanes_) {
      lane->connect(device, deadline);
    }
  }
  c10::intrusive_ptr<c10d::Work>
  run(int lane, const Issue& issue, Clock::time_point deadline) override {
    OpDeadlineScope scope(deadline);
    return issue(*lanes_.at(lane));
  }
  bool hostStaged(
      int lane,
      const c10::Device& device,
      Clock::time_point deadline) override {
    const auto& ncclLane = lanes_.at(lane);
    if (ncclLane->connected()) {
      return false; // every op after the first: no lock here; run() checks the
                    // device
    }
    ncclLane->connect(device.has_index() ? device.index() : 0, deadline);
    return ncclLane->hostStaged();
  }
  // The lane raises DistBackendError only when its communicator failed,
  // missed a deadline or was aborted; other errors refused the op up front.
  bool failedBy(const std::exception_ptr& error) const override {
    try {
      std::rethrow_exception(error);
    } catch (const c10::DistBackendError&) {
      return true;
    } catch (...) {
      return false;
    }
  }
  // Nothing to cut without blocking: abort() ends the kernels.
  void sever() noexcept override {}
  bool closeIfIdle() noexcept override {
    bool idle = true;
    for (const auto& lane : lanes_) {
      try {
        idle = lane->closeIfIdle() && idle;
      } catch (...) {
        idle = false; // unsure: abort in place
      }
    }
    return idle;
  }
  // Concurrently (one thread per lane beyond the first): each ncclCommAbort
  // waits on its own proxy threads.
  void abort() noexcept override {
    auto abortOne = [](NcclLane& lane) noexcept {
      try {
        lane.abort();
      } catch (const std::exception& e) {
        // Best effort, like every abort: the communicator is unusable
        // either way.
        TORCH_WARN("ft: aborting an NCCL communicator failed: ", e.what());
      }
    };
    std::vector<std::thread> helpers;
    for (size_t i = 1; i < lanes_.size(); ++i) {
      try {
        helpers.emplace_back(
            [&abortOne, lane = lanes_[i]] { abortOne(*lane); });
      } catch (...) {
        abortOne(*lanes_[i]); // no thread to spare: abort it here
      }
    }
    if (!lanes_.empty()) {
      abortOne(*lanes_.front());
    }
    for (auto& helper : helpers) {
      helper.join();
    }
  }

 private:
  const std::vector<c10::intrusive_ptr<NcclLane>> lanes_;
};

} // namespace

std::shared_ptr<Transport> makeNcclTransport(const TransportSpec& spec) {
  std::vector<c10::intrusive_ptr<NcclLane>> lanes;
  lanes.reserve(spec.numLanes);
  for (int i = 0; i < spec.numLanes; ++i) {
    auto laneStore = c10::make_intrusive<c10d::PrefixStore>(
        "nccl" + std::to_string(i),
        spec.store);
    lanes.push_back(
        c10::make_intrusive<NcclLane>(
            laneStore,
            spec.rank,
            spec.size,
            i,
            spec.hostStageSharedGpu));
  }
  return std::make_shared<NcclTransport>(std::move(lanes));
}

} // namespace ft

#endif // FT_USE_NCCL
