// ft.coordination._grpc_server.Channel: unary gRPC calls from Python through
// gRPC C++, for ft's lighthouse and ManagerServer clients
// (ft/coordination/clients.py picks it, or grpcio, per client).
//
// Why: a grpcio call costs ~0.2 ms of CPU and ~0.3 ms of latency on loopback,
// most of it in grpcio's Python/Cython layer, under the GIL that every client
// thread of a process shares. Here the whole call (HTTP/2, waiting for the
// answer) runs in C++ with the GIL released; Python pays one function call.
// The calling thread drives the call itself (a completion queue of its own,
// polled by that thread, as gRPC's synchronous stubs do): no hand-off to
// another thread and back.

#include "grpc_client.hpp"
#include "call_stream_wire.hpp"
#include "request_auth.hpp"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <pybind11/stl.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// How long past a call's deadline to wait for gRPC to end it. gRPC ends a call
// at its deadline by itself; this only bounds the wait should it not.
constexpr auto kPastDeadlineGrace = std::chrono::seconds(2);
// While a call waits, it looks for a pending signal (Ctrl-C) this often: a
// quorum may wait for minutes, and grpcio's calls can be interrupted too.
constexpr auto kSignalCheckPeriod = std::chrono::milliseconds(200);
// After a cancellation, gRPC completes the call without the network; allow it
// this long.
constexpr auto kCancelGrace = std::chrono::seconds(5);

// The header with which ft's lighthouse confirms a heartbeat stream
// (grpc_server.cpp: CallReactor::onStreamedHeartbeat).
constexpr const char* kStreamConfirmedHeader = "ft-heartbeat-stream";

// After a stream's write failed, how long its pending read may take to bring
// the server's status before the stream is cancelled (the call is already
// over: this is local work).
constexpr auto kStreamEndGrace = std::chrono::seconds(1);

// The exception Python sees for a call that ended with a status other than OK:
// args (code: int, the gRPC status code; details: str).
PyObject* gCallError = nullptr;

bool interpreterFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// Releases the GIL for its scope, for a wait that may outlast the interpreter:
// a daemon thread still in a call when Python exits. Taking the GIL back while
// the interpreter finalizes ends the thread with pthread_exit (Python up
// to 3.13), whose unwinding through this destructor (noexcept) is
// std::terminate: the process would abort at exit. Such a thread parks here
// instead, as Python 3.14 parks its own, until the exiting process takes it
// down.
class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) {}
  ~GilRelease() {
    while (interpreterFinalizing()) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    PyEval_RestoreThread(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

// A Python bytes object's contents, in place: valid while it lives (GIL held).
std::string_view bytesView(const py::bytes& b) {
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(b.ptr(), &data, &size) != 0)
    throw py::error_already_set();
  return {data, static_cast<size_t>(size)};
}

// grpcio-style options ([(name, int or str)],
// ft.coordination._rpc.CHANNEL_OPTIONS) as gRPC C++ channel arguments. GIL
// held.
grpc::ChannelArguments channelArguments(
    const std::vector<std::pair<std::string, py::object>>& options) {
  grpc::ChannelArguments args;
  for (const auto& [name, value] : options) {
    if (py::isinstance<py::bool_>(value) || py::isinstance<py::int_>(value)) {
      args.SetInt(name, value.cast<int>());
    } else if (py::isinstance<py::str>(value)) {
      args.SetString(name, value.cast<std::string>());
    } else {
      throw py::type_error(
          "channel option " + name + ": an int or a str is required");
    }
  }
  return args;
}

// The calls' deadlines: gRPC's ClientContext takes a system_clock time point.
using Clock = std::chrono::system_clock;

Clock::time_point deadlineAfter(double seconds) {
  // A NaN or negative timeout is an expired deadline; a huge one is capped (a
  // year) so that the time point does not overflow.
  if (!(seconds > 0))
    seconds = 0;
  seconds = std::min(seconds, 365.0 * 24 * 3600);
  return Clock::now() +
      std::chrono::duration_cast<Clock::duration>(
             std::chrono::duration<double>(seconds));
}

// `body` as the request gRPC sends: behind a fresh signature (the leading auth
// field, request_auth.hpp) when there is a signer. GIL not needed.
grpc::ByteBuffer requestBuffer(
    ft_auth::RequestSigner* signer,
    const std::string& method,
    grpc::Slice body) {
  if (signer == nullptr)
    return grpc::ByteBuffer(&body, 1);
  grpc::Slice head(
      ft_auth::signedPrefix(signer->token(
          method,
          reinterpret_cast<const char*>(body.begin()),
          body.size())));
  grpc::Slice parts[2] = {std::move(head), std::move(body)};
  return grpc::ByteBuffer(parts, 2);
}

// Raises CallError(code, details) for a status other than OK. GIL held.
[[noreturn]] void raiseCallError(const grpc::Status& status) {
  py::tuple args = py::make_tuple(
      static_cast<int>(status.error_code()),
      status.error_message());
  PyErr_SetObject(gCallError, args.ptr());
  throw py::error_already_set();
}

// Drops channel references handed over by gRPC's callback threads, on a thread
// of ft's own.
//
// Why: a heartbeat stream's call (ClientStream::Call) is driven by gRPC's
// callback threads and ends in OnDone on one of them. When its client is gone
// by then, the call holds the last reference to the channel. Dropped there, the
// channel is destroyed on the callback thread; when it was the last user of
// gRPC's shared callback queue, releasing the queue joins the queue's threads,
// this one included, and frees the queue under it: gRPC aborts the process
// ("assertion failed: prior > 0" in grpc_cq_internal_unref). Here the last
// reference goes on a thread that gRPC never joins.
//
// Contract:
// - `drop(ref)`, from any thread, takes the reference; the releaser thread
//   (started at the first drop) lets go of it soon after. The caller blocks
//   for a short lock only, and never runs the reference's destructor.
// - `stop(grace)` runs once, at interpreter exit (registered with Python's
//   atexit by bindClient, so before the interpreter and gRPC's globals are torn
//   down): the thread lets go of what it was handed and is joined, within
//   `grace` (past it, the thread is left to the exiting process). References
//   handed over after stop() are kept, never destroyed: destroying a channel
//   while the process tears down is what this class exists to avoid, and the
//   process is exiting.
// - In a child forked from this process the releaser starts afresh
//   (pthread_atfork): the parent's thread does not exist there, and its lock
//   may have been held at the fork.
class ChannelReleaser {
 public:
  using Ref = std::shared_ptr<grpc::GenericStub>;

  static void drop(Ref ref) {
    current()->take(std::move(ref));
  }

  static void stop(std::chrono::milliseconds grace) {
    current()->stopAndJoin(grace);
  }

  // Once, when the module loads (before any thread of its own exists).
  static void install() {
    pthread_atfork(nullptr, nullptr, [] {
      // Only the forking thread exists in the child: no lock is needed. The
      // parent's releaser (its lock possibly held) is left unused, not freed.
      gCurrent.store(new ChannelReleaser(), std::memory_order_release);
    });
  }

 private:
  // Never freed: a detached thread or a late drop may still use it at exit.
  static ChannelReleaser* current() {
    ChannelReleaser* r = gCurrent.load(std::memory_order_acquire);
    if (r != nullptr)
      return r;
    auto* fresh = new ChannelReleaser();
    if (gCurrent.compare_exchange_strong(r, fresh, std::memory_order_acq_rel))
      return fresh;
    delete fresh; // another thread installed one first
    return r;
  }

  void take(Ref ref) {
    std::lock_guard<std::mutex> g(mu_);
    if (stopping_) {
      new Ref(std::move(ref)); // kept for good (see the contract)
      return;
    }
    queue_.push_back(std::move(ref));
    if (!thread_.joinable())
      thread_ = std::thread([this] { run(); });
    cv_.notify_one();
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      std::vector<Ref> batch;
      batch.swap(queue_);
      lock.unlock();
      batch.clear(); // the channels' destructors run here, unlocked
      lock.lock();
      if (stopping_ && queue_.empty())
        break;
    }
    finished_ = true;
    cv_.notify_all();
  }

  void stopAndJoin(std::chrono::milliseconds grace) {
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_)
      return;
    stopping_ = true;
    cv_.notify_all();
    if (!thread_.joinable())
      return;
    const bool finished = cv_.wait_for(lock, grace, [&] { return finished_; });
    lock.unlock();
    if (finished)
      thread_.join();
    else
      thread_.detach(); // still inside a channel's destructor: left to exit
  }

  static std::atomic<ChannelReleaser*> gCurrent;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Ref> queue_;
  std::thread thread_;
  bool stopping_ = false;
  bool finished_ = false;
};

std::atomic<ChannelReleaser*> ChannelReleaser::gCurrent{nullptr};

// How long interpreter exit waits for the releaser to let go of the channels
// it was handed: destroying a channel is local work (its connection closes,
// gRPC's callback threads are joined), normally well under a millisecond.
constexpr auto kReleaserStopGrace = std::chrono::seconds(5);

// One client-streaming call kept open across sends: the lighthouse's heartbeat
// stream (LighthouseService.HeartbeatStream), where one message costs the
// server a DATA frame instead of a whole call.
//
// Contract:
// - Made by `Channel.open_stream(method)`; nothing reaches the network before
//   the first send. It keeps the channel's connection and signing key even if
//   the channel is closed first.
// - `send(request, timeout_s)` writes one message (signed, as a call's request
//   is, when the channel has a key), opening the call first when none is open.
//   It returns once gRPC has taken the message for the transport (the first
//   message of a call: once the server also confirmed the stream with its
//   headers, which ft's lighthouse sends after recording that message), within
//   timeout_s, GIL released. It raises
//   CallError(code, details) when the call is over: the server's status when
//   the server ended it (UNIMPLEMENTED from a server without the method,
//   INVALID_ARGUMENT for a message it does not take, ...), UNAVAILABLE when the
//   connection is down or broke, DEADLINE_EXCEEDED when the message was not
//   taken (or the stream not confirmed) in time. The call is then gone; the
//   next send opens a new one. A later message that send() accepted may still
//   be refused by the server, or lost with the connection: that error comes
//   with the next send.
// - The call is driven by gRPC's threads (callback API), which read the
//   connection between sends: a server's end of the call is seen by the next
//   send. (A completion queue polled by the sender would read it only while
//   a send waits.)
// - `close(timeout_s)` half-closes an open call and waits (at most timeout_s,
//   then cancels) for its status, returned as (code, details); None when no
//   call was open. The stream can be used again afterwards.
// - Thread-safe: sends and closes are serialized.
class ClientStream {
 public:
  ClientStream(
      std::shared_ptr<grpc::GenericStub> stub,
      std::shared_ptr<ft_auth::RequestSigner> signer,
      std::string method)
      : stub_(std::move(stub)),
        signer_(std::move(signer)),
        method_(std::move(method)) {}

  ~ClientStream() {
    // Nothing to wait for: the call ends by itself once cancelled, and its
    // reactor and state go with it.
    std::lock_guard<std::mutex> g(mu_);
    if (call_)
      letGo(/*cancel=*/true);
  }

  void send(const py::bytes& request, double timeoutS) {
    const std::string_view contents = bytesView(request);
    grpc::Slice body(contents.data(), contents.size());
    grpc::Status status;
    {
      GilRelease nogil;
      std::lock_guard<std::mutex> g(mu_);
      status = sendLocked(std::move(body), deadlineAfter(timeoutS));
    }
    if (!status.ok())
      raiseCallError(status);
  }

  py::object close(double timeoutS) {
    bool wasOpen = false;
    grpc::Status status;
    {
      GilRelease nogil;
      std::lock_guard<std::mutex> g(mu_);
      wasOpen = static_cast<bool>(call_);
      if (wasOpen)
        status = closeLocked(deadlineAfter(timeoutS));
    }
    if (!wasOpen)
      return py::none();
    return py::make_tuple(
        static_cast<int>(status.error_code()),
        status.error_message());
  }

 private:
  // What the call's reactor (gRPC's threads) and this object share.
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    grpc::ByteBuffer outgoing; // the message being written
    grpc::ByteBuffer response;
    bool writing = false;
    bool writeFailed = false; // a write failed: the call is over
    bool ended = false; // the server ended the call (its answer or a failure)
    // The server's headers confirmed the stream: it recorded the first message.
    bool confirmed = false;
    bool done = false; // gRPC is done with the call; `status` is its status
    grpc::Status status;
  };

  // One open call, driven by gRPC's own threads (callback API): they read
  // the connection whether or not a send is under way, so a server that ends
  // the stream is seen at the next send. It deletes itself when gRPC is done
  // with it (OnDone), which a hold defers until its owner lets go.
  class Call
      : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    Call(
        std::shared_ptr<grpc::GenericStub> stub,
        const std::string& method,
        std::shared_ptr<Shared> shared)
        : stub_(std::move(stub)), shared_(std::move(shared)) {
      stub_->PrepareBidiStreamingCall(&ctx_, method, grpc::StubOptions(), this);
      StartRead(&shared_->response);
      AddHold();
      StartCall();
    }
    void cancel() {
      ctx_.TryCancel();
    }
    void OnWriteDone(bool ok) override {
      std::lock_guard<std::mutex> g(shared_->mu);
      shared_->writing = false;
      shared_->writeFailed = shared_->writeFailed || !ok;
      shared_->cv.notify_all();
    }
    void OnReadInitialMetadataDone(bool ok) override {
      // A server without the stream answers with a status alone, no header.
      const auto& headers = ctx_.GetServerInitialMetadata();
      const bool confirmed =
          ok && headers.find(kStreamConfirmedHeader) != headers.end();
      std::lock_guard<std::mutex> g(shared_->mu);
      shared_->confirmed = confirmed;
      shared_->cv.notify_all();
    }
    void OnReadDone(bool) override {
      std::lock_guard<std::mutex> g(shared_->mu);
      shared_->ended = true;
      shared_->cv.notify_all();
    }
    void OnDone(const grpc::Status& status) override {
      {
        std::lock_guard<std::mutex> g(shared_->mu);
        shared_->status = status;
        shared_->done = true;
        shared_->cv.notify_all();
      }
      // This call may hold the channel's last reference (its client is gone):
      // never dropped on gRPC's callback thread (see ChannelReleaser).
      ChannelReleaser::Ref stub = std::move(stub_);
      delete this;
      ChannelReleaser::drop(std::move(stub));
    }

   private:
    grpc::ClientContext ctx_;
    // The channel outlives the call; OnDone hands it to the releaser.
    std::shared_ptr<grpc::GenericStub> stub_;
    const std::shared_ptr<Shared> shared_;
  };

  // Waits (mu_ held, GIL released) until `ready` holds or `deadline` passes.
  template <typename Ready>
  bool waitUntil(Clock::time_point deadline, Ready ready) {
    std::unique_lock<std::mutex> lock(shared_->mu);
    return shared_->cv.wait_until(lock, deadline, [&] {
      return ready(*shared_);
    });
  }

  static bool over(const Shared& s) {
    return s.writeFailed || s.ended || s.done;
  }

  grpc::Status sendLocked(grpc::Slice body, Clock::time_point deadline) {
    if (!call_) {
      shared_ = std::make_shared<Shared>();
      call_ = new Call(stub_, method_, shared_);
    }
    grpc::Status previous = awaitWrite(deadline);
    if (!previous.ok())
      return previous;
    {
      std::lock_guard<std::mutex> g(shared_->mu);
      shared_->outgoing =
          requestBuffer(signer_.get(), method_, std::move(body));
      shared_->writing = true;
    }
    call_->StartWrite(&shared_->outgoing);
    grpc::Status written = awaitWrite(deadline);
    if (!written.ok())
      return written;
    // The first message of a call counts as delivered only once the server
    // confirmed the stream (after recording it): a server without the stream
    // refuses it instead, and the caller sends that message another way.
    if (!waitUntil(deadline, [](const Shared& s) {
          return s.confirmed || over(s);
        }))
      return abandon(
          grpc::StatusCode::DEADLINE_EXCEEDED,
          "Deadline Exceeded (the server did not confirm the stream)");
    bool confirmed = false;
    {
      std::lock_guard<std::mutex> g(shared_->mu);
      confirmed = shared_->confirmed;
    }
    return confirmed ? grpc::Status::OK : end(/*endedByClient=*/false);
  }

  // Waits until the message being written was taken (or the call ended).
  grpc::Status awaitWrite(Clock::time_point deadline) {
    if (!waitUntil(deadline, [](const Shared& s) {
          return !s.writing || over(s);
        }))
      return abandon(
          grpc::StatusCode::DEADLINE_EXCEEDED,
          "Deadline Exceeded (the stream did not take the message)");
    bool isOver = false;
    {
      std::lock_guard<std::mutex> g(shared_->mu);
      isOver = over(*shared_);
    }
    return isOver ? end(/*endedByClient=*/false) : grpc::Status::OK;
  }

  grpc::Status closeLocked(Clock::time_point deadline) {
    grpc::Status previous = awaitWrite(deadline);
    if (!previous.ok())
      return previous;
    call_->StartWritesDone();
    // The server answers once it has read the half-close.
    if (!waitUntil(deadline, [](const Shared& s) { return s.ended || s.done; }))
      return abandon(
          grpc::StatusCode::DEADLINE_EXCEEDED,
          "Deadline Exceeded (closing the stream)");
    return end(/*endedByClient=*/true);
  }

  // The call is over (or closed): its status, and the call gone.
  grpc::Status end(bool endedByClient) {
    std::shared_ptr<Shared> shared = shared_;
    // After a failed write the server's status follows by itself (cancelling
    // would replace it); only a call that does not end is cancelled.
    const bool ended = waitUntil(
        Clock::now() + kStreamEndGrace,
        [](const Shared& s) { return s.ended || s.done; });
    letGo(/*cancel=*/!ended);
    std::unique_lock<std::mutex> lock(shared->mu);
    if (!shared->cv.wait_until(lock, Clock::now() + kCancelGrace, [&] {
          return shared->done;
        }))
      return grpc::Status(
          grpc::StatusCode::UNAVAILABLE,
          "the stream did not end");
    grpc::Status status = shared->status;
    if (status.ok() && !endedByClient)
      status = grpc::Status(
          grpc::StatusCode::UNAVAILABLE,
          "the server ended the stream");
    return status;
  }

  // Cancels the call and lets it go.
  grpc::Status abandon(grpc::StatusCode code, const std::string& why) {
    letGo(/*cancel=*/true);
    return grpc::Status(code, why);
  }

  // Hands the call to gRPC for good: from here on only gRPC's threads touch
  // it (it deletes itself once done).
  void letGo(bool cancel) {
    Call* call = call_;
    call_ = nullptr;
    if (cancel)
      call->cancel();
    call->RemoveHold();
    shared_.reset();
  }

  const std::shared_ptr<grpc::GenericStub> stub_;
  const std::shared_ptr<ft_auth::RequestSigner> signer_;
  const std::string method_;
  std::mutex mu_;        // serializes sends and closes
  Call* call_ = nullptr; // valid until letGo()
  std::shared_ptr<Shared> shared_;
};

// A gRPC ByteBuffer's bytes, copied into one string; nullopt when gRPC cannot
// read the buffer (never an empty message in its place: protobuf would read
// that as a valid, all-default answer).
std::optional<std::string> bufferBytes(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok())
    return std::nullopt;
  std::string out;
  out.reserve(buffer.Length());
  for (const auto& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// The status of a call whose answer gRPC delivered but could not read.
grpc::Status unreadableAnswer() {
  return grpc::Status(
      grpc::StatusCode::INTERNAL,
      "the server's answer could not be read");
}

// Unary calls of one method carried as messages of one long-lived call (a
// call stream, e.g. LighthouseService.QuorumStream; the server:
// grpc_server.cpp, CallStreamReactor), one at a time. Why: each call costs
// the server (and this client) a new HTTP/2 stream, headers, a call object
// and trailers; a message on an open stream is one DATA frame each way.
//
// Contract:
// - Made by `Channel.open_call_stream(stream_method, method)`; nothing reaches
//   the network before the first call. It keeps the channel's connection and
//   signing key even if the channel is closed first.
// - `call(request, timeout_s, wait_for_ready)` sends `request` as one
//   CallStreamRequest (signed for `method`, as a call of `method` is, when the
//   channel has a key; timeout_ms its timeout), opening the stream first when
//   none is open, and waits for its answer with the GIL released. It returns
//   the response's bytes, or raises CallError(code, details) with the
//   answer's status; the stream stays open for the next call.
// - When the stream ends before the answer, the request was not answered and
//   may be sent again (on a new stream, or as a call): it raises the stream's
//   status (UNIMPLEMENTED from a server without the method, UNAVAILABLE when
//   the connection broke or the server ended the stream) and the next call
//   opens a new stream. At timeout_s it cancels the stream, which cancels the
//   request at the server, and raises DEADLINE_EXCEEDED. A signal handler that
//   raises (Ctrl-C) cancels it too, and its exception propagates.
// - It returns None at once, sending nothing, while another thread's call
//   uses the stream (that caller makes a unary call instead), and after
//   close().
// - The calling thread drives the stream (a completion queue of the stream's
//   own, polled only during calls), as Channel.call does: no hand-off to
//   another thread. Between calls one read is pending, which completes only
//   if the stream ends (the server sends nothing unasked): a stream the
//   server ended, or whose connection broke, while idle is replaced by a new
//   one at the next call, which does not fail for it.
// - `close()` cancels an open stream (after a call in flight returns); later
//   calls return None.
class ClientCallStream {
 public:
  ClientCallStream(
      std::shared_ptr<grpc::GenericStub> stub,
      std::shared_ptr<ft_auth::RequestSigner> signer,
      std::string streamMethod,
      std::string method)
      : stub_(std::move(stub)),
        signer_(std::move(signer)),
        streamMethod_(std::move(streamMethod)),
        method_(std::move(method)) {}

  ~ClientCallStream() {
    std::lock_guard<std::mutex> g(mu_);
    if (open_)
      tearDown();
  }

  py::object
  call(const py::bytes& request, double timeoutS, bool waitForReady) {
    std::unique_lock<std::mutex> busy(mu_, std::try_to_lock);
    if (!busy.owns_lock() || closed_)
      return py::none();
    const std::string_view body = bytesView(request);
    std::string response;
    grpc::Status status;
    {
      // `request` stays referenced by the caller for the whole call.
      GilRelease nogil;
      status = callLocked(body, timeoutS, waitForReady, &response);
    }
    if (status.error_code() == grpc::StatusCode::CANCELLED &&
        PyErr_Occurred() != nullptr) {
      throw py::error_already_set(); // a signal handler raised meanwhile
    }
    if (!status.ok())
      raiseCallError(status);
    return py::bytes(response);
  }

  void close() {
    GilRelease nogil;
    std::lock_guard<std::mutex> g(mu_);
    closed_ = true;
    if (open_)
      tearDown();
  }

 private:
  // The operations of an open stream, as completion-queue tags and as bits of
  // Open::pending.
  enum Op : uintptr_t { kStart = 1, kWrite = 2, kRead = 4, kFinish = 8 };

  struct Open {
    grpc::ClientContext ctx;
    grpc::CompletionQueue cq;
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> rw;
    grpc::ByteBuffer out;
    grpc::ByteBuffer in;
    grpc::Status status;
    uintptr_t pending = 0;
    bool finishIssued = false;
  };

  static void* tag(Op op) {
    return reinterpret_cast<void*>(op);
  }

  // Waits for the stream's next completion until `until`, checking for
  // signals meanwhile unless `interrupted` is null. Returns the operation (0:
  // none by `until`, or a signal handler raised: then *interrupted).
  uintptr_t next(Clock::time_point until, bool* ok, bool* interrupted) {
    while (true) {
      const Clock::time_point now = Clock::now();
      if (now >= until)
        return 0;
      void* got = nullptr;
      auto r = open_->cq.AsyncNext(
          &got,
          ok,
          std::min(until, now + kSignalCheckPeriod));
      if (r == grpc::CompletionQueue::GOT_EVENT) {
        const auto op = reinterpret_cast<uintptr_t>(got);
        open_->pending &= ~op;
        return op;
      }
      if (r != grpc::CompletionQueue::TIMEOUT || interrupted == nullptr ||
          interpreterFinalizing())
        continue;
      py::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() != 0) {
        *interrupted = true;
        return 0;
      }
    }
  }

  // Waits (until `until`) for the operations in `ops` that are pending.
  // False: they did not complete, or a signal handler raised.
  bool settle(uintptr_t ops, Clock::time_point until, bool* interrupted) {
    while ((open_->pending & ops) != 0) {
      bool ok = false;
      if (next(until, &ok, interrupted) == 0)
        return false;
    }
    return true;
  }

  grpc::Status callLocked(
      std::string_view body,
      double timeoutS,
      bool waitForReady,
      std::string* response) {
    // The stream has no deadline of its own: the request's is kept here (the
    // server's copy, timeout_ms, only shapes its answer).
    const Clock::time_point deadline = deadlineAfter(timeoutS);
    bool interrupted = false;
    auto failed = [&](grpc::Status why) {
      tearDown();
      return interrupted
          ? grpc::Status(grpc::StatusCode::CANCELLED, "interrupted")
          : why;
    };
    const grpc::Status late(
        grpc::StatusCode::DEADLINE_EXCEEDED,
        "Deadline Exceeded");
    if (open_ && endedWhileIdle())
      tearDown(); // the server ended it, or the connection broke: a new one
    if (!open_) {
      open_ = std::make_unique<Open>();
      open_->ctx.set_wait_for_ready(waitForReady);
      open_->rw = stub_->PrepareCall(&open_->ctx, streamMethod_, &open_->cq);
      open_->pending |= kStart;
      open_->rw->StartCall(tag(kStart));
    }
    // The stream is started and the previous request's write completed (its
    // answer came after it).
    if (!settle(kStart | kWrite, deadline, &interrupted))
      return failed(late);
    std::string head;
    if (signer_ != nullptr)
      head = ft_auth::signedPrefix(
          signer_->token(method_, body.data(), body.size()));
    // What is left of the timeout now (opening the stream may have taken some).
    const double ms = std::ceil(
        std::chrono::duration<double, std::milli>(deadline - Clock::now())
            .count());
    const int64_t timeoutMs =
        static_cast<int64_t>(std::clamp(ms, 1.0, 365.0 * 24 * 3600 * 1000));
    grpc::Slice message(ft_call_stream::encodeRequest(timeoutMs, head, body));
    open_->out = grpc::ByteBuffer(&message, 1);
    open_->pending |= kWrite;
    open_->rw->Write(open_->out, tag(kWrite));
    if (!(open_->pending & kRead)) {
      // (A stream in use already has its read pending: see below.)
      open_->pending |= kRead;
      open_->rw->Read(&open_->in, tag(kRead));
    }
    bool readOk = false;
    while (open_->pending & kRead) {
      bool ok = false;
      const uintptr_t op = next(deadline, &ok, &interrupted);
      if (op == 0)
        return failed(late);
      if (op == kRead)
        readOk = ok;
      // A failed write (the stream is over) shows as a failed read too.
    }
    if (!readOk)
      return ended();
    const std::optional<std::string> answer = bufferBytes(open_->in);
    open_->in.Clear();
    // The next read is pending while the stream is idle: the server sends
    // nothing between answers, so it completes only when the stream ends, and
    // the next request then opens a new stream instead of failing on this one.
    open_->pending |= kRead;
    open_->rw->Read(&open_->in, tag(kRead));
    if (!answer)
      return failed(unreadableAnswer());
    ft_call_stream::Response r;
    if (!ft_call_stream::decodeResponse(*answer, &r))
      return failed(
          grpc::Status(
              grpc::StatusCode::INTERNAL,
              "the server's call stream answer is not a CallStreamResponse"));
    if (r.code != 0)
      return grpc::Status(static_cast<grpc::StatusCode>(r.code), r.details);
    response->assign(r.response);
    return grpc::Status::OK;
  }

  // Whether the idle stream's pending read completed: the stream ended (or
  // the server sent something unasked). Does not wait.
  bool endedWhileIdle() {
    while (open_->pending & kRead) {
      void* got = nullptr;
      bool ok = false;
      if (open_->cq.AsyncNext(&got, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC)) !=
          grpc::CompletionQueue::GOT_EVENT)
        return false;
      open_->pending &= ~reinterpret_cast<uintptr_t>(got);
    }
    return true;
  }

  // The stream ended before answering: its status, the stream gone.
  // (The read failed: the status is known, and finishing is local work.)
  grpc::Status ended() {
    open_->pending |= kFinish;
    open_->finishIssued = true;
    open_->rw->Finish(&open_->status, tag(kFinish));
    // No signal checks: this is local work, and an interruption here would
    // turn the stream's status into a retried failure.
    const bool finished =
        settle(kWrite | kFinish, Clock::now() + kStreamEndGrace, nullptr);
    grpc::Status status = finished
        ? open_->status
        : grpc::Status(grpc::StatusCode::UNAVAILABLE, "the stream did not end");
    if (status.ok())
      status = grpc::Status(
          grpc::StatusCode::UNAVAILABLE,
          "the server ended the call stream");
    tearDown();
    return status;
  }

  // Cancels the stream, waits for gRPC to complete what is pending (local
  // work, no network), and lets it go.
  void tearDown() {
    Open* o = open_.get();
    o->ctx.TryCancel();
    const auto until = Clock::now() + kCancelGrace;
    bool settled = settle(kStart | kWrite | kRead, until, nullptr);
    if (settled && !o->finishIssued) {
      o->finishIssued = true;
      o->pending |= kFinish;
      o->rw->Finish(&o->status, tag(kFinish));
    }
    settled = settled && settle(kFinish, until, nullptr);
    if (!settled) {
      // gRPC still holds the context, the queue and the buffers: kept alive
      // (leaked) rather than freed under it. Only a gRPC that ignores a
      // cancellation gets here.
      (void)open_.release();
      return;
    }
    o->rw.reset();
    o->cq.Shutdown();
    void* got = nullptr;
    bool ok = false;
    while (o->cq.Next(&got, &ok)) {
    }
    open_.reset();
  }

  const std::shared_ptr<grpc::GenericStub> stub_;
  const std::shared_ptr<ft_auth::RequestSigner> signer_;
  const std::string streamMethod_;
  const std::string method_;
  std::mutex mu_; // one call at a time
  std::unique_ptr<Open> open_;
  bool closed_ = false; // close() was called: calls return None
};

// One channel (one HTTP/2 connection, reconnected by gRPC as needed) to one
// server.
//
// Contract:
// - Made with a `signing_key` (the job secret's gRPC key, ft.utils.auth), the
//   channel signs every request itself: a fresh token per call, carried in the
//   request's leading auth field (request_auth.hpp), with the GIL released.
//   The key stays in this object's memory. The tokens are bound to the server
//   id last given to `set_server_id` (its streams' tokens too).
// - `call(method, request, timeout_s, wait_for_ready, sign=True)` makes one
//   unary call of `method` (e.g. "/torchft.LighthouseService/Heartbeat") with
//   the serialized `request`, signed when the channel has a key and `sign`
//   (the server-id call is not). It returns the
//   serialized response, or raises CallError
//   (code, details) with the call's gRPC status: DEADLINE_EXCEEDED once
//   `timeout_s` has passed, UNAVAILABLE when the server cannot be reached (at
//   once, or at the deadline with `wait_for_ready`), and the server's own
//   status otherwise. It holds the GIL only to read its arguments and build its
//   result, never while it waits, and it returns by the deadline (plus
//   kPastDeadlineGrace should gRPC not end the call itself). A signal handler
//   that raises (Ctrl-C) cancels the call and its exception propagates.
// - `wait_connected(timeout_s)` waits (GIL released) until the channel is
//   connected, at most `timeout_s`; returns whether it is.
// - Thread-safe: any number of threads may call at once. After `close()`,
//   calls raise ValueError; calls already in flight finish normally.
class ClientChannel {
 public:
  ClientChannel(
      const std::string& target,
      const std::vector<std::pair<std::string, py::object>>& options,
      const py::bytes& signingKey) {
    grpc::ChannelArguments args = channelArguments(options);
    std::string key = signingKey;
    if (!key.empty())
      signer_ = std::make_shared<ft_auth::RequestSigner>(std::move(key));
    GilRelease nogil;
    channel_ = grpc::CreateCustomChannel(
        target,
        grpc::InsecureChannelCredentials(),
        args);
    stub_ = std::make_shared<grpc::GenericStub>(channel_);
  }

  // The server id the channel's signatures are bound to from now on
  // (request_auth.hpp); nothing without a signing key.
  void setServerId(const std::string& serverId) {
    if (signer_ != nullptr)
      signer_->setServerId(serverId);
  }

  py::bytes call(
      const std::string& method,
      const py::bytes& request,
      double timeoutS,
      bool waitForReady,
      bool sign) {
    std::shared_ptr<grpc::GenericStub> stub = currentStub();
    const std::string_view contents = bytesView(request);
    // A copy: the call may outlive this frame (see the end of run()).
    grpc::Slice body(contents.data(), contents.size());
    grpc::ByteBuffer response;
    grpc::Status status;
    {
      GilRelease nogil;
      // Signed when sent: each attempt of a retried call gets its own nonce.
      status =
          run(*stub,
              method,
              requestBuffer(
                  sign ? signer_.get() : nullptr,
                  method,
                  std::move(body)),
              deadlineAfter(timeoutS),
              waitForReady,
              &response);
    }
    if (status.error_code() == grpc::StatusCode::CANCELLED &&
        PyErr_Occurred() != nullptr) {
      throw py::error_already_set(); // a signal handler raised meanwhile
    }
    if (!status.ok())
      raiseCallError(status);
    std::optional<py::bytes> bytes = toBytes(response);
    if (!bytes)
      raiseCallError(unreadableAnswer());
    return *std::move(bytes);
  }

  std::unique_ptr<ClientStream> openStream(const std::string& method) {
    return std::make_unique<ClientStream>(currentStub(), signer_, method);
  }

  std::unique_ptr<ClientCallStream> openCallStream(
      const std::string& streamMethod,
      const std::string& method) {
    return std::make_unique<ClientCallStream>(
        currentStub(),
        signer_,
        streamMethod,
        method);
  }

  bool waitConnected(double timeoutS) {
    std::shared_ptr<grpc::Channel> channel;
    {
      std::lock_guard<std::mutex> g(mu_);
      channel = channel_;
    }
    if (!channel)
      throw py::value_error("Cannot wait on a closed channel");
    GilRelease nogil;
    return channel->WaitForConnected(deadlineAfter(timeoutS));
  }

  void close() {
    std::shared_ptr<grpc::Channel> channel;
    std::shared_ptr<grpc::GenericStub> stub;
    {
      std::lock_guard<std::mutex> g(mu_);
      channel = std::move(channel_);
      stub = std::move(stub_);
    }
    // Dropped without the GIL: the last reference tears the connection down.
    GilRelease nogil;
    stub.reset();
    channel.reset();
  }

 private:
  std::shared_ptr<grpc::GenericStub> currentStub() {
    std::lock_guard<std::mutex> g(mu_);
    if (!stub_)
      throw py::value_error("Cannot invoke RPC on closed channel!");
    return stub_;
  }

  // The call, GIL released. On a pending Python exception (a signal handler
  // raised) it cancels the call and returns CANCELLED with the exception set.
  static grpc::Status run(
      grpc::GenericStub& stub,
      const std::string& method,
      const grpc::ByteBuffer& request,
      Clock::time_point deadline,
      bool waitForReady,
      grpc::ByteBuffer* response) {
    // Heap-held, in case the call outlives this frame (see the end).
    struct Pending {
      grpc::ClientContext ctx;
      grpc::CompletionQueue cq;
      grpc::ByteBuffer response;
      grpc::Status status;
    };
    auto p = std::make_unique<Pending>();
    p->ctx.set_deadline(deadline);
    p->ctx.set_wait_for_ready(waitForReady);
    auto rpc = stub.PrepareUnaryCall(&p->ctx, method, request, &p->cq);
    rpc->StartCall();
    void* const kDone = p.get();
    rpc->Finish(&p->response, &p->status, kDone);
    const Clock::time_point giveUp = deadline + kPastDeadlineGrace;
    bool done = false;
    bool interrupted = false;
    while (!done) {
      const Clock::time_point now = Clock::now();
      if (now >= giveUp)
        break;
      void* tag = nullptr;
      bool ok = false;
      auto r = p->cq.AsyncNext(
          &tag,
          &ok,
          std::min(giveUp, now + kSignalCheckPeriod));
      if (r == grpc::CompletionQueue::GOT_EVENT && tag == kDone) {
        done = true;
      } else if (
          r == grpc::CompletionQueue::TIMEOUT && !interpreterFinalizing()) {
        py::gil_scoped_acquire gil;
        if (PyErr_CheckSignals() != 0) {
          interrupted = true;
          break;
        }
      }
    }
    if (!done) {
      // Interrupted, or gRPC did not end the call by its deadline: cancel it
      // and wait for the completion (local, no network) before the context
      // and the queue go.
      p->ctx.TryCancel();
      void* tag = nullptr;
      bool ok = false;
      const auto until = Clock::now() + kCancelGrace;
      while (!done &&
             p->cq.AsyncNext(&tag, &ok, until) ==
                 grpc::CompletionQueue::GOT_EVENT) {
        done = tag == kDone;
      }
    }
    grpc::Status status = interrupted
        ? grpc::Status(grpc::StatusCode::CANCELLED, "interrupted")
        : done
        ? p->status
        : grpc::Status(
              grpc::StatusCode::DEADLINE_EXCEEDED,
              "Deadline Exceeded (the call did not end at its deadline)");
    if (!done) {
      // gRPC still holds the context, the queue and the response buffer:
      // kept alive (leaked) rather than freed under it. Only a gRPC that
      // ignores both the deadline and the cancellation gets here.
      (void)rpc.release();
      (void)p.release();
      return status;
    }
    *response = std::move(p->response);
    p->cq.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (p->cq.Next(&tag, &ok)) {
    }
    return status;
  }

  // GIL held. nullopt: gRPC could not read the buffer.
  static std::optional<py::bytes> toBytes(const grpc::ByteBuffer& buffer) {
    grpc::Slice single;
    if (buffer.TrySingleSlice(&single).ok()) {
      return py::bytes(
          reinterpret_cast<const char*>(single.begin()),
          single.size());
    }
    std::optional<std::string> bytes = bufferBytes(buffer);
    if (!bytes)
      return std::nullopt;
    return py::bytes(*bytes);
  }

  std::shared_ptr<ft_auth::RequestSigner> signer_; // set once, then read-only
  std::mutex mu_;
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<grpc::GenericStub> stub_;
};

// What a load run counts (LoadGenerator's contract below).
struct LoadResult {
  uint64_t sent = 0;
  uint64_t ok = 0;
  uint64_t failed = 0;
  uint64_t streamsFailed = 0;
  double sendS = 0;
  std::string firstError;
};

// The heartbeat-stream load of one LoadGenerator::run_streams (its contract
// below): one client-streaming call per connection, opened before the clock
// starts, the messages written on schedule (one due while its stream still
// writes the previous one goes out right after it), every stream closed after
// the last one and collected before the queue goes. One thread, GIL released.
class StreamedLoad {
 public:
  StreamedLoad(
      const std::vector<std::unique_ptr<grpc::GenericStub>>& stubs,
      const std::string& method,
      const std::vector<grpc::ByteBuffer>& requests)
      : stubs_(stubs), method_(method), requests_(requests) {}

 private:
  // One heartbeat stream and its operations' tags (each op's tag is its own
  // address; the op knows its stream).
  struct Stream;
  struct StreamOp {
    Stream* stream;
    enum Kind { kStart, kRead, kWrite, kWritesDone, kFinish } kind;
  };
  struct Stream {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> rw;
    grpc::ByteBuffer response;
    grpc::Status status;
    StreamOp start{this, StreamOp::kStart};
    StreamOp read{this, StreamOp::kRead};
    StreamOp write{this, StreamOp::kWrite};
    StreamOp writesDone{this, StreamOp::kWritesDone};
    StreamOp finish{this, StreamOp::kFinish};
    bool started = false;
    bool broken = false;
    bool writing = false;
    bool closing = false;
    bool finished = false;
    bool finishIssued = false;
    // The answer (or the stream's end) was read; gRPC wants that before
    // Finish. Posted at start, so that a stream the server ends early is seen.
    bool readDone = false;
    uint64_t backlog = 0; // messages due while writing
    size_t next = 0;      // which request goes next
  };

 public:
  LoadResult run(double rate, double durationS, double timeoutS) {
    const std::vector<grpc::ByteBuffer>& requests = requests_;
    LoadResult r;
    grpc::CompletionQueue cq;
    std::vector<std::unique_ptr<Stream>> streams;
    size_t openOps = 0; // operations started and not yet completed
    auto startWrite = [&](Stream* s) {
      s->writing = true;
      ++openOps;
      s->rw->Write(requests[s->next++ % requests.size()], &s->write);
    };
    auto issueFinish = [&](Stream* s) {
      s->finishIssued = true;
      ++openOps;
      s->rw->Finish(&s->status, &s->finish);
    };
    auto closeStream = [&](Stream* s) {
      s->closing = true;
      if (!s->broken) {
        ++openOps;
        s->rw->WritesDone(&s->writesDone);
      }
      if (s->readDone)
        issueFinish(s);
    };
    bool allSent = false;
    auto handle = [&](void* tag, bool ok) {
      --openOps;
      auto* op = static_cast<StreamOp*>(tag);
      Stream* s = op->stream;
      switch (op->kind) {
        case StreamOp::kStart:
          s->started = ok;
          s->broken = !ok;
          if (ok) {
            ++openOps;
            s->rw->Read(&s->response, &s->read);
          } else {
            s->readDone = true;
          }
          break;
        case StreamOp::kRead:
          s->readDone = true;
          if (s->closing && !s->finishIssued)
            issueFinish(s);
          break;
        case StreamOp::kWrite:
          s->writing = false;
          if (ok) {
            ++r.ok;
          } else {
            ++r.failed;
            s->broken = true;
          }
          if (s->backlog > 0 && !s->broken) {
            --s->backlog;
            startWrite(s);
          } else if (s->broken) {
            r.failed += s->backlog;
            s->backlog = 0;
          }
          if (allSent && !s->writing && !s->closing)
            closeStream(s);
          break;
        case StreamOp::kWritesDone:
          break;
        case StreamOp::kFinish:
          s->finished = true;
          if (!s->status.ok() && r.streamsFailed++ == 0)
            r.firstError = std::to_string(s->status.error_code()) + ": " +
                s->status.error_message();
          break;
      }
    };
    // Takes the completions until `until` (sleeps when none can come).
    auto reap = [&](Clock::time_point until) {
      void* tag = nullptr;
      bool ok = false;
      while (Clock::now() < until) {
        if (openOps == 0) {
          std::this_thread::sleep_until(until);
          return;
        }
        if (cq.AsyncNext(&tag, &ok, until) != grpc::CompletionQueue::GOT_EVENT)
          return;
        handle(tag, ok);
      }
    };
    const auto connectBy = deadlineAfter(timeoutS);
    for (auto& stub : stubs_) {
      auto s = std::make_unique<Stream>();
      s->rw = stub->PrepareCall(&s->ctx, method_, &cq);
      ++openOps;
      s->rw->StartCall(&s->start);
      streams.push_back(std::move(s));
    }
    size_t started = 0;
    while (started < streams.size() && Clock::now() < connectBy) {
      void* tag = nullptr;
      bool ok = false;
      if (cq.AsyncNext(&tag, &ok, connectBy) !=
          grpc::CompletionQueue::GOT_EVENT)
        break;
      if (static_cast<StreamOp*>(tag)->kind == StreamOp::kStart)
        ++started;
      handle(tag, ok);
    }
    const uint64_t total = static_cast<uint64_t>(rate * durationS);
    const auto start = Clock::now();
    const auto interval = std::chrono::duration<double>(1.0 / rate);
    for (uint64_t i = 0; i < total; ++i) {
      const auto due = start +
          std::chrono::duration_cast<Clock::duration>(
                           interval * static_cast<double>(i));
      if (Clock::now() < due)
        reap(due);
      Stream* s = streams[i % streams.size()].get();
      ++r.sent;
      if (!s->started || s->broken) {
        ++r.failed;
      } else if (s->writing) {
        ++s->backlog;
      } else {
        startWrite(s);
      }
    }
    r.sendS = std::chrono::duration<double>(Clock::now() - start).count();
    allSent = true;
    for (auto& s : streams) {
      if (!s->writing && !s->closing && s->started)
        closeStream(s.get());
    }
    const auto giveUp = deadlineAfter(timeoutS) + kPastDeadlineGrace;
    while (openOps > 0) {
      void* tag = nullptr;
      bool ok = false;
      if (cq.AsyncNext(&tag, &ok, giveUp) != grpc::CompletionQueue::GOT_EVENT)
        break;
      handle(tag, ok);
    }
    // Whatever gRPC did not end by now: cancel, then collect everything
    // before the queue and the streams go.
    for (auto& s : streams) {
      if (!s->finished)
        s->ctx.TryCancel();
      if (s->started && !s->closing)
        closeStream(s.get());
    }
    while (openOps > 0) {
      void* tag = nullptr;
      bool ok = false;
      if (cq.AsyncNext(&tag, &ok, Clock::now() + kCancelGrace) !=
          grpc::CompletionQueue::GOT_EVENT)
        break;
      handle(tag, ok);
    }
    for (auto& s : streams) {
      if (!s->finished && r.streamsFailed++ == 0)
        r.firstError = "stream did not end";
    }
    cq.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq.Next(&tag, &ok)) {
    }
    return r;
  }

 private:
  const std::vector<std::unique_ptr<grpc::GenericStub>>& stubs_;
  const std::string& method_;
  const std::vector<grpc::ByteBuffer>& requests_;
};

// Open-loop load for benchmarks (bench/quorum_vs_torchft.py): the heartbeats of
// a thousand replica groups, 10,240 a second, which Python threads cannot send
// from one machine.
//
// Contract:
// - The constructor opens `connections` channels to `target` (each its own TCP
// connection, as
//   each group's client has one) with `options`, and waits until all are
//   connected, at most `connect_timeout_s` (else RuntimeError).
// - `run(method, bodies, rate, duration_s, timeout_s)` starts rate x duration_s
// unary calls
//   of `method`, on schedule whether or not earlier ones have been answered
//   (open loop: a slow server does not slow the load down), cycling over
//   `bodies` and the connections, each call with deadline `timeout_s`. It
//   returns once every call has ended (by its deadline at the latest;
//   kPastDeadlineGrace more should gRPC not end one), as a dict: sent, ok,
//   failed, send_s (from the first call to the last one sent), first_error. One
//   thread (the caller's, GIL released) sends and reaps; nothing in it blocks
//   on a call.
// - `run_streams(method, bodies, rate, duration_s, timeout_s)` sends the same
//   load as messages on one client-streaming call per connection (the
//   heartbeat stream), each stream opened before the clock starts and closed
//   after the last message; a message due while its stream still writes the
//   previous one goes out right after it. `ok`/`failed` count messages
//   written or not; `streams_failed` counts streams that did not end OK (the
//   first one's status in first_error). Returns by timeout_s after the last
//   message plus kPastDeadlineGrace.
// - Not thread-safe: one run at a time.
class LoadGenerator {
 public:
  LoadGenerator(
      const std::string& target,
      const std::vector<std::pair<std::string, py::object>>& options,
      int connections,
      double connectTimeoutS) {
    if (connections < 1)
      throw py::value_error("connections must be >= 1");
    grpc::ChannelArguments args = channelArguments(options);
    // Its own subchannel pool per channel: one connection each, not one shared.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    GilRelease nogil;
    const auto deadline = deadlineAfter(connectTimeoutS);
    for (int i = 0; i < connections; ++i) {
      auto channel = grpc::CreateCustomChannel(
          target,
          grpc::InsecureChannelCredentials(),
          args);
      stubs_.push_back(std::make_unique<grpc::GenericStub>(channel));
      channels_.push_back(std::move(channel));
    }
    for (auto& channel : channels_) {
      if (!channel->WaitForConnected(deadline)) {
        throw std::runtime_error(
            "load generator: could not connect to " + target);
      }
    }
  }

  // The load as unary calls (run) or over streams (run_streams).
  template <bool kOnStreams>
  py::dict run(
      const std::string& method,
      const std::vector<py::bytes>& bodies,
      double rate,
      double durationS,
      double timeoutS) {
    return load(
        method,
        bodies,
        rate,
        durationS,
        timeoutS,
        kOnStreams ? &LoadGenerator::sendOnStreams : &LoadGenerator::send);
  }

 private:
  // The request bodies as gRPC buffers (copied: built with the GIL held, sent
  // without it).
  static std::vector<grpc::ByteBuffer> toBuffers(
      const std::vector<py::bytes>& bodies) {
    std::vector<grpc::ByteBuffer> out;
    out.reserve(bodies.size());
    for (const auto& b : bodies) {
      std::string data = b;
      grpc::Slice slice(data);
      out.emplace_back(&slice, 1);
    }
    return out;
  }

  using Result = LoadResult;
  using Sender = Result (LoadGenerator::*)(
      const std::string&,
      const std::vector<grpc::ByteBuffer>&,
      double,
      double,
      double);

  // Checks the arguments, sends the load with `sender` (GIL released), and
  // returns the counts as a dict.
  py::dict load(
      const std::string& method,
      const std::vector<py::bytes>& bodies,
      double rate,
      double durationS,
      double timeoutS,
      Sender sender) {
    if (bodies.empty() || !(rate > 0) || !(durationS > 0) || !(timeoutS > 0))
      throw py::value_error(
          "bodies must not be empty; rate, duration_s and timeout_s must be > "
          "0");
    const std::vector<grpc::ByteBuffer> requests = toBuffers(bodies);
    Result r;
    {
      GilRelease nogil;
      r = (this->*sender)(method, requests, rate, durationS, timeoutS);
    }
    py::dict out;
    out["sent"] = r.sent;
    out["ok"] = r.ok;
    out["failed"] = r.failed;
    out["send_s"] = r.sendS;
    out["first_error"] = r.firstError;
    out["streams_failed"] = r.streamsFailed;
    return out;
  }

  Result sendOnStreams(
      const std::string& method,
      const std::vector<grpc::ByteBuffer>& requests,
      double rate,
      double durationS,
      double timeoutS) {
    return StreamedLoad(stubs_, method, requests)
        .run(rate, durationS, timeoutS);
  }

  struct Pending {
    grpc::ClientContext ctx;
    grpc::ByteBuffer response;
    grpc::Status status;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> rpc;
  };

 public:
  // `rounds` rounds of one call per request in `bodies` (request i on
  // connection i mod connections), all started at once; each round is timed
  // from its first call's start to its last answer, and the next starts once
  // every call of this one ended. A quorum round when the bodies are the
  // Quorum requests of a quorum's members. GIL released throughout.
  py::dict runRounds(
      const std::string& method,
      const std::vector<py::bytes>& bodies,
      int rounds,
      double timeoutS) {
    if (bodies.empty() || rounds < 1 || !(timeoutS > 0))
      throw py::value_error(
          "bodies must not be empty; rounds and timeout_s must be > 0");
    const std::vector<grpc::ByteBuffer> requests = toBuffers(bodies);
    std::vector<double> times;
    uint64_t failed = 0;
    std::string firstError;
    {
      GilRelease nogil;
      // Heap-held: left alive (leaked) should gRPC not end a cancelled call.
      auto cq = std::make_unique<grpc::CompletionQueue>();
      for (int round = 0; round < rounds; ++round) {
        std::vector<std::unique_ptr<Pending>> calls;
        const auto start = Clock::now();
        const auto deadline = deadlineAfter(timeoutS);
        for (size_t i = 0; i < requests.size(); ++i) {
          auto p = std::make_unique<Pending>();
          p->ctx.set_deadline(deadline);
          p->rpc = stubs_[i % stubs_.size()]->PrepareUnaryCall(
              &p->ctx,
              method,
              requests[i],
              cq.get());
          p->rpc->StartCall();
          p->rpc->Finish(&p->response, &p->status, p.get());
          calls.push_back(std::move(p));
        }
        size_t done = 0;
        const auto giveUp = deadline + kPastDeadlineGrace;
        while (done < calls.size()) {
          void* tag = nullptr;
          bool ok = false;
          if (cq->AsyncNext(&tag, &ok, giveUp) !=
              grpc::CompletionQueue::GOT_EVENT)
            break;
          ++done;
          auto* p = static_cast<Pending*>(tag);
          if (!p->status.ok() && failed++ == 0)
            firstError = std::to_string(p->status.error_code()) + ": " +
                p->status.error_message();
        }
        times.push_back(
            std::chrono::duration<double>(Clock::now() - start).count());
        if (done < calls.size()) {
          // Not ended by gRPC in time: cancel, and collect them all before
          // they go.
          failed += calls.size() - done;
          for (auto& p : calls)
            p->ctx.TryCancel();
          while (done < calls.size()) {
            void* tag = nullptr;
            bool ok = false;
            if (cq->AsyncNext(&tag, &ok, Clock::now() + kCancelGrace) !=
                grpc::CompletionQueue::GOT_EVENT)
              break;
            ++done;
          }
          if (done < calls.size()) {
            for (auto& p : calls)
              p.release(); // gRPC may still write to them
            cq.release();
            throw std::runtime_error("load generator: calls did not end");
          }
          break;
        }
      }
      cq->Shutdown();
      void* tag = nullptr;
      bool ok = false;
      while (cq->Next(&tag, &ok)) {
      }
    }
    py::dict out;
    out["round_s"] = times;
    out["failed"] = failed;
    out["first_error"] = firstError;
    return out;
  }

 private:
  Result send(
      const std::string& method,
      const std::vector<grpc::ByteBuffer>& requests,
      double rate,
      double durationS,
      double timeoutS) {
    Result r;
    grpc::CompletionQueue cq;
    std::unordered_set<Pending*> open;
    // Takes the calls that end until `until`; with `untilNoneOpen`, only until
    // every call has ended.
    auto reap = [&](Clock::time_point until, bool untilNoneOpen) {
      void* tag = nullptr;
      bool ok = false;
      while (cq.AsyncNext(&tag, &ok, until) ==
             grpc::CompletionQueue::GOT_EVENT) {
        auto* p = static_cast<Pending*>(tag);
        if (p->status.ok()) {
          ++r.ok;
        } else {
          if (r.failed++ == 0)
            r.firstError = std::to_string(p->status.error_code()) + ": " +
                p->status.error_message();
        }
        open.erase(p);
        delete p;
        if (Clock::now() >= until || (untilNoneOpen && open.empty()))
          return;
      }
    };
    const uint64_t total = static_cast<uint64_t>(rate * durationS);
    const auto start = Clock::now();
    const auto interval = std::chrono::duration<double>(1.0 / rate);
    Clock::time_point lastDeadline = start;
    for (uint64_t i = 0; i < total; ++i) {
      const auto due = start +
          std::chrono::duration_cast<Clock::duration>(
                           interval * static_cast<double>(i));
      if (Clock::now() < due)
        reap(due, false);
      auto* p = new Pending();
      lastDeadline = deadlineAfter(timeoutS);
      p->ctx.set_deadline(lastDeadline);
      p->rpc = stubs_[i % stubs_.size()]->PrepareUnaryCall(
          &p->ctx,
          method,
          requests[i % requests.size()],
          &cq);
      p->rpc->StartCall();
      p->rpc->Finish(&p->response, &p->status, p);
      open.insert(p);
      ++r.sent;
    }
    r.sendS = std::chrono::duration<double>(Clock::now() - start).count();
    const auto giveUp = lastDeadline + kPastDeadlineGrace;
    while (!open.empty() && Clock::now() < giveUp)
      reap(giveUp, true);
    // Only calls gRPC failed to end by their deadline are left: cancel them,
    // then collect everything before the queue goes.
    for (Pending* p : open)
      p->ctx.TryCancel();
    cq.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq.Next(&tag, &ok)) {
      auto* p = static_cast<Pending*>(tag);
      if (open.erase(p) != 0) {
        ++r.failed;
        delete p;
      }
    }
    return r;
  }

  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;
};

} // namespace

void bindClient(py::module_& m) {
  gCallError = PyErr_NewException(
      "ft.coordination._grpc_server.CallError",
      PyExc_RuntimeError,
      nullptr);
  if (gCallError == nullptr)
    throw py::error_already_set();
  m.attr("CallError") = py::handle(gCallError);

  ChannelReleaser::install();
  // At interpreter exit, before gRPC's and Python's globals go (see
  // ChannelReleaser's contract).
  py::module_::import("atexit").attr("register")(py::cpp_function([] {
    GilRelease nogil;
    ChannelReleaser::stop(kReleaserStopGrace);
  }));

  py::class_<ClientChannel>(m, "Channel")
      .def(
          py::init<
              const std::string&,
              const std::vector<std::pair<std::string, py::object>>&,
              const py::bytes&>(),
          py::arg("target"),
          py::arg("options"),
          py::arg("signing_key") = py::bytes())
      .def(
          "call",
          &ClientChannel::call,
          py::arg("method"),
          py::arg("request"),
          py::arg("timeout"),
          py::arg("wait_for_ready"),
          py::arg("sign") = true)
      .def("set_server_id", &ClientChannel::setServerId, py::arg("server_id"))
      .def("wait_connected", &ClientChannel::waitConnected, py::arg("timeout"))
      .def("open_stream", &ClientChannel::openStream, py::arg("method"))
      .def(
          "open_call_stream",
          &ClientChannel::openCallStream,
          py::arg("stream_method"),
          py::arg("method"))
      .def("close", &ClientChannel::close);

  py::class_<ClientCallStream>(m, "ClientCallStream")
      .def(
          "call",
          &ClientCallStream::call,
          py::arg("request"),
          py::arg("timeout"),
          py::arg("wait_for_ready"))
      .def("close", &ClientCallStream::close);

  py::class_<ClientStream>(m, "ClientStream")
      .def("send", &ClientStream::send, py::arg("request"), py::arg("timeout"))
      .def("close", &ClientStream::close, py::arg("timeout"));

  py::class_<LoadGenerator> loadGenerator(m, "LoadGenerator");
  loadGenerator
      .def(
          py::init<
              const std::string&,
              const std::vector<std::pair<std::string, py::object>>&,
              int,
              double>(),
          py::arg("target"),
          py::arg("options"),
          py::arg("connections"),
          py::arg("connect_timeout_s"))
      .def(
          "run_rounds",
          &LoadGenerator::runRounds,
          py::arg("method"),
          py::arg("bodies"),
          py::arg("rounds"),
          py::arg("timeout_s"));
  for (const auto& [name, run] :
       {std::pair{"run", &LoadGenerator::run<false>},
        std::pair{"run_streams", &LoadGenerator::run<true>}}) {
    loadGenerator.def(
        name,
        run,
        py::arg("method"),
        py::arg("bodies"),
        py::arg("rate"),
        py::arg("duration_s"),
        py::arg("timeout_s"));
  }
}
