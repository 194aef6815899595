// ft.coordination._grpc_server: a gRPC server in C++ whose calls are answered
// by Python.
//
// Why: a Python grpcio server spends ~0.5 ms of CPU per request in its own
// machinery (poller thread, thread-pool hand-off, GIL ping-pong), which made
// the lighthouse's quorum round at 8 replica groups CPU-bound. Here gRPC's C++
// callback API owns the connections, the HTTP/2 work and the call lifetimes;
// Python sees one function call per request (`handler(call, request_bytes)`)
// and answers whenever it likes, from any thread, with `call.reply(...)`,
// `call.write(...)` or `call.finish(...)`. Which service and method a call is
// for is Python's business (`call.method`, e.g.
// "/torchft.LighthouseService/Quorum"): the server is generic and knows no
// protobuf types.
//
// Contract:
// - `handler(call, request_bytes)` runs on a gRPC thread with the GIL held,
// once per call, after
//   the call's single request message arrived. It must not block for long:
//   answer later from another thread if the answer needs waiting for (a quorum
//   does).
// - Call methods never call back into Python and never block on the network:
// they queue a gRPC
//   operation and return. They may be called from any thread, any number of
//   times; everything after the first finish is ignored (return value false).
// - When a call ends without Python having finished it (the client cancelled,
// went away or its
//   deadline passed), the call's `on_cancel`, if Python set one, is called once
//   with the GIL held: on a gRPC thread, or at once in the setter if the call
//   was already cancelled. gRPC may run it inline inside a Call method issued
//   by Python, so `on_cancel` must not take locks its caller might hold: hand
//   work to another thread. Once Python answers, it is dropped (a cancellation
//   racing with the answer may still call it once).
// - Every call is finished exactly once (gRPC requires it): by Python, or with
// CANCELLED here.
// - Server.shutdown(grace) stops accepting calls, cancels those still open
// after `grace`
//   seconds, and returns once every call is done.
// - The server accepts its TCP connections itself (see Listener) and keeps
// accepting after any
//   accept error, e.g. when the process ran out of file descriptors.
// - With a `verifier` (Server's argument), every call's signature (the
//   request's leading auth field, request_auth.hpp) is checked and taken off
//   here, before Python sees the call, by the same rule as
//   ft.utils.auth.Verifier (see RequestVerifier); a call that fails it is
//   finished UNAUTHENTICATED without taking the GIL, and one that passes
//   reaches Python with `call.verified` true. Without a verifier the field
//   reaches Python, whose dispatcher takes it off.
// - With a `heartbeat` table (Server's argument), a well-formed heartbeat on
//   its method is answered here without the GIL: the replica id and the time
//   it arrived are recorded, and Python collects them with
//   `take_heartbeats()`. Anything unusual (no deadline, a name that is empty,
//   too long or not UTF-8, `leaving`, unknown fields) goes to Python, which
//   answers it, so every error message has one source.
// - Its stream method (client streaming, one heartbeat per message) never
//   reaches Python: each message is checked (signature) and recorded as a
//   unary heartbeat is. A message the table does not take ends the stream
//   (INVALID_ARGUMENT; UNAVAILABLE once the fast path is closed), and the
//   client sends that heartbeat unary. When the client closes its side the
//   stream ends OK with one empty LighthouseHeartbeatResponse.
// - With a `steady_quorum` (Server's argument), every verified request of that
//   method goes through SteadyQuorum (steady_quorum.hpp, its contract): held
//   and answered here while Python has armed it and the request only repeats
//   the previous round with a new step, else handed to Python's handler (the
//   held ones with it). Python takes the held ones back with `steady_take`.
// - With `call_streams` (Server's argument), each such method is a call
//   stream (CallStreamReactor): every message a call of the method it
//   carries, which Python, the signature check and the steady round see as
//   that method's unary call (`call.method` is the carried method's path).

#include "call_stream_wire.hpp"
#include "grpc_client.hpp"
#include "quorum_wire.hpp"
#include "request_auth.hpp"
#include "steady_quorum.hpp"

#include <absl/synchronization/mutex.h>
#include <grpc/support/log.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

class CallReactor;

// Where a call's answer goes: the gRPC call of its own (CallReactor), or one
// message of the call stream that carried its request (CallStreamReactor).
// CallState calls these without its lock held, at most one operation at a
// time, and never again after a finish.
class AnswerSink {
 public:
  virtual ~AnswerSink() = default;
  virtual void startWrite(grpc::ByteBuffer* msg) = 0;
  virtual void startWriteAndFinish(
      grpc::ByteBuffer* msg,
      grpc::Status status) = 0;
  virtual void startFinish(grpc::Status status) = 0;
};

// The GIL, taken from one of gRPC's threads. Those are not Python threads, and
// pybind11 would create and destroy a Python thread state on every acquire
// (most of the Python-side cost of a request); each thread keeps its first one
// instead. The server is shut down before the interpreter finalizes (RpcServer
// does so at exit), so no gRPC thread uses a stale one.
class GrpcThreadGil {
 public:
  GrpcThreadGil() {
    thread_local bool keepsThreadState = false;
    if (!keepsThreadState) {
      gil_.inc_ref();
      keepsThreadState = true;
    }
  }

 private:
  py::gil_scoped_acquire gil_;
};

// A slow reader must not make the server buffer without bound: writes beyond
// this fail.
constexpr size_t kMaxQueuedWrites = 1024;

// State shared by the gRPC reactor (until gRPC is done with the call) and by
// Python's handle on the call (for as long as Python keeps it). `onCancel_` is
// the one Python object: it is only touched with the GIL held, and is empty by
// the time the reactor lets go (OnDone), so the state may die on any thread.
class CallState {
 public:
  // For a call carried by a call stream: `streamsWrites` false (it is unary:
  // one answer, reply or finish; write() is refused), and `sinkOwner` keeps
  // its stream's reactor (`sink`) alive for as long as the call may use it.
  CallState(
      AnswerSink* sink,
      std::string method,
      std::chrono::system_clock::time_point deadline,
      bool streamsWrites = true,
      std::shared_ptr<void> sinkOwner = nullptr)
      : sink_(sink),
        sinkOwner_(std::move(sinkOwner)),
        method_(std::move(method)),
        deadline_(deadline),
        arrived_(ft_steady::steadySeconds()),
        streamsWrites_(streamsWrites) {}

  const std::string& method() const {
    return method_;
  }
  // When the call started: steady-clock seconds (CLOCK_MONOTONIC, Python's
  // time.monotonic()).
  double arrived() const {
    return arrived_;
  }
  // The signature was checked here (set once, before Python sees the call).
  bool verified() const {
    return verified_;
  }
  void markVerified() {
    verified_ = true;
  }
  // Seconds until the caller's deadline (huge when it set none; negative once
  // passed).
  double timeRemaining() const {
    return std::chrono::duration<double>(
               deadline_ - std::chrono::system_clock::now())
        .count();
  }

  bool isActive() {
    std::lock_guard<std::mutex> g(mu_);
    return !cancelled_ && !finishRequested_;
  }

  // Queues one message of a streaming answer. False if the call is over or too
  // far behind.
  bool write(grpc::ByteBuffer msg);
  // The single message of a unary answer, and status OK.
  bool reply(grpc::ByteBuffer msg);
  // Ends the call with `status` once queued writes are out.
  bool finish(grpc::Status status);

  // Python's on_cancel (GIL held for all three).
  void setOnCancel(py::object cb);
  py::object takeOnCancel() {
    hasOnCancel_ = false;
    return std::move(onCancel_);
  }
  py::object peekOnCancel() const {
    return onCancel_ ? onCancel_ : py::object(py::none());
  }
  bool hasOnCancel() const {
    return hasOnCancel_;
  }

  // Reactor events. onCancel returns whether Python has an on_cancel to be
  // told.
  void onWriteDone(bool ok);
  bool onCancel();
  void onDone();

 private:
  // Starts the next gRPC operation; called with mu_ held, releases it before
  // calling gRPC (which may run reactions inline in this thread).
  void pump(std::unique_lock<std::mutex>& lock);
  // The call can no longer be written to; finish it (CANCELLED, `why`) unless
  // Python did.
  void markCancelledLocked(const char* why);

  std::mutex mu_;
  AnswerSink* sink_; // valid until onDone
  const std::shared_ptr<void> sinkOwner_;
  const std::string method_;
  const std::chrono::system_clock::time_point deadline_;
  const double arrived_;
  const bool streamsWrites_;
  bool verified_ = false;
  std::deque<grpc::ByteBuffer> queued_;
  grpc::ByteBuffer
      inFlight_; // the message gRPC is writing; untouched while writing_
  bool writing_ = false;
  bool finishRequested_ = false;
  bool finishStarted_ = false;
  bool cancelled_ = false;
  grpc::Status finalStatus_;
  py::object onCancel_;
  std::atomic<bool> hasOnCancel_{false};
};

using ft_auth::RequestVerifier;

// Heartbeats answered without Python: the latest arrival time per replica id
// since Python last collected them. The request is
// torchft.LighthouseHeartbeatRequest {string replica_id = 1; bool leaving =
// 2;}; only the plain case (field 1 alone, leaving absent or false) is taken
// here.
//
// `streamMethod` (may be empty: none) is the client-streaming form (ft
// extension, LighthouseService.HeartbeatStream): every message of one
// long-lived call is one such request, recorded the same way. Why: a unary call
// costs the server a new HTTP/2 stream, its headers, a call object and its
// trailers; a message on an open stream is one DATA frame. At a thousand groups
// heartbeating ten times a second that is most of the lighthouse's CPU
// (docs/benchmarks.md, "Quorum and lighthouse").
class HeartbeatTable {
 public:
  HeartbeatTable(
      std::string method,
      std::string streamMethod,
      size_t maxNameBytes,
      double noDeadlineS)
      : method_(std::move(method)),
        streamMethod_(std::move(streamMethod)),
        maxNameBytes_(maxNameBytes),
        noDeadlineS_(noDeadlineS) {}

  const std::string& method() const {
    return method_;
  }
  const std::string& streamMethod() const {
    return streamMethod_;
  }

  // A unary heartbeat: true when it was recorded (the caller answers OK);
  // false: leave it to Python. Only calls with a deadline are taken here (a
  // call without one is unusual: Python decides).
  bool recordUnary(const std::string& request, double secondsToDeadline) {
    if (!(secondsToDeadline > 0) || secondsToDeadline > noDeadlineS_)
      return false;
    return record(request);
  }

  // One message of a heartbeat stream or a unary heartbeat: true when it was
  // recorded; false when it is not the plain case (see above).
  bool record(const std::string& request) {
    std::string name;
    if (!parse(request, &name))
      return false;
    const double now = std::chrono::duration<double>(
                           std::chrono::steady_clock::now().time_since_epoch())
                           .count();
    std::lock_guard<std::mutex> g(mu_);
    pending_[std::move(name)] = now;
    return true;
  }

  // Replica ids known valid (members of an issued quorum) heartbeating at
  // `now` (steady-clock seconds).
  void recordIds(const std::vector<std::string>& ids, double now) {
    if (ids.empty())
      return;
    std::lock_guard<std::mutex> g(mu_);
    for (const std::string& id : ids)
      pending_[id] = now;
  }

  // (replica id, steady-clock seconds: CLOCK_MONOTONIC, Python's
  // time.monotonic()) of every heartbeat recorded since the last call, the
  // latest per replica.
  std::vector<std::pair<std::string, double>> take() {
    std::unordered_map<std::string, double> got;
    {
      std::lock_guard<std::mutex> g(mu_);
      got.swap(pending_);
    }
    return std::vector<std::pair<std::string, double>>(got.begin(), got.end());
  }

 private:
  bool parse(const std::string& b, std::string* name) const {
    size_t i = 0;
    bool haveName = false;
    while (i < b.size()) {
      const uint8_t tag = static_cast<uint8_t>(b[i++]);
      if (tag == 0x0A) { // field 1, length-delimited
        uint64_t len = 0;
        int shift = 0;
        while (true) {
          if (i >= b.size() || shift > 28)
            return false;
          const uint8_t c = static_cast<uint8_t>(b[i++]);
          len |= static_cast<uint64_t>(c & 0x7F) << shift;
          if ((c & 0x80) == 0)
            break;
          shift += 7;
        }
        if (len == 0 || len > maxNameBytes_ || len > b.size() - i)
          return false;
        name->assign(b, i, len);
        i += len;
        haveName = true;
      } else if (tag == 0x10) { // field 2 (leaving), varint: only "false" is
                                // taken here
        if (i >= b.size() || b[i] != 0)
          return false;
        ++i;
      } else {
        return false; // unknown or repeated-in-another-form field: Python
                      // decides
      }
    }
    return haveName && ft_wire::validUtf8(*name);
  }

  const std::string method_;
  const std::string streamMethod_;
  const size_t maxNameBytes_;
  const double noDeadlineS_;
  std::mutex mu_;
  std::unordered_map<std::string, double> pending_;
};

class Server;

using SteadyQuorum = ft_steady::SteadyQuorum<CallState>;

// The header of a heartbeat stream's answer that confirms the stream (see
// CallReactor::onStreamedHeartbeat; the client: grpc_client.cpp).
constexpr const char* kHeartbeatStreamHeader = "ft-heartbeat-stream";

// One call's reactor: reads the request, hands it to Python, relays writes and
// the finish.
class CallReactor : public grpc::ServerGenericBidiReactor, public AnswerSink {
 public:
  CallReactor(grpc::GenericCallbackServerContext* ctx, Server* server);
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override {
    state_->onWriteDone(ok);
  }
  void OnCancel() override;
  void OnDone() override;

  void startWrite(grpc::ByteBuffer* msg) override {
    StartWrite(msg);
  }
  void startWriteAndFinish(grpc::ByteBuffer* msg, grpc::Status status)
      override {
    StartWriteAndFinish(msg, grpc::WriteOptions(), status);
  }
  void startFinish(grpc::Status status) override {
    Finish(status);
  }

 private:
  // One message of a heartbeat stream (verified): recorded, and the next one
  // read; anything the table does not take ends the stream, and the client
  // sends that heartbeat unary, so that Python answers it.
  void onStreamedHeartbeat(const std::string& body);

  Server* server_;
  grpc::GenericCallbackServerContext* ctx_; // valid until OnDone
  // A heartbeat stream whose first message was taken.
  bool streaming_ = false;
  grpc::ByteBuffer request_;
  std::shared_ptr<CallState> state_;
};

// A call stream (e.g. LighthouseService.QuorumStream, proto/torchft.proto):
// unary calls of one method carried as messages of one long-lived call.
// Why: a call costs gRPC C++ a new HTTP/2 stream, headers, a call object, a
// reactor and trailers (65-85 us of the lighthouse's CPU per Quorum call); a
// message on an open stream is one DATA frame each way.
//
// Contract:
// - One request at a time: each CallStreamRequest becomes a call of the
//   carried method (a CallState that Python, the steady round and the
//   signature check see exactly as they see that method's unary call, its
//   deadline timeout_ms from when it was read), and its answer (reply or
//   finish) goes back as one CallStreamResponse. The next message is read
//   once that answer is written.
// - A message that is not a CallStreamRequest with timeout_ms > 0 ends the
//   stream INVALID_ARGUMENT. A request that fails its signature is answered
//   UNAUTHENTICATED in its response; the stream goes on.
// - When the stream ends (the client cancelled it, gave up on a request, or
//   went away), the call being answered is cancelled as a unary call would be
//   (on_cancel, dropped from a steady round). When the client closes its side
//   the stream ends OK once the current answer is written.
// - A carried call's deadline is kept by its client (which cancels the stream
//   at it) and by Python (both servers wait with the call's deadline), not by
//   gRPC: is_active() stays true past it until the stream ends.
// - Lifetime: carried calls hold the reactor (shared), so that an answer that
//   races with the stream's end finds it; it answers nothing once the stream
//   ended, and gRPC is done with it at OnDone.
class CallStreamReactor : public grpc::ServerGenericBidiReactor,
                          public AnswerSink {
 public:
  // Made shared, then started (the first read).
  static CallStreamReactor* start(Server* server, std::string carriedMethod) {
    auto r = std::shared_ptr<CallStreamReactor>(
        new CallStreamReactor(server, std::move(carriedMethod)));
    r->self_ = r;
    r->StartRead(&r->in_);
    return r.get();
  }
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

  // The current call's answer, as one message. A carried call is unary: it
  // never streams writes (CallState refuses them), so startWrite is not
  // reached.
  void startWrite(grpc::ByteBuffer*) override {}
  void startWriteAndFinish(grpc::ByteBuffer* msg, grpc::Status status)
      override {
    answer(status, msg);
  }
  void startFinish(grpc::Status status) override {
    answer(status, nullptr);
  }

 private:
  void answer(const grpc::Status& status, const grpc::ByteBuffer* msg);
  // Ends the stream with `status` unless it ended or an answer is being
  // written (then OnWriteDone ends it). True: the caller calls Finish(status)
  // once mu_ is released.
  bool endLocked(const grpc::Status& status);

  CallStreamReactor(Server* server, std::string carriedMethod)
      : server_(server), carriedMethod_(std::move(carriedMethod)) {}

  Server* const server_;
  const std::string carriedMethod_;
  // Its own reference, dropped at OnDone (gRPC's part of its lifetime).
  std::shared_ptr<CallStreamReactor> self_;
  std::mutex mu_;
  grpc::ByteBuffer in_;
  grpc::ByteBuffer out_;               // the answer being written
  std::shared_ptr<CallState> current_; // the request being answered
  bool writing_ = false;
  bool clientClosed_ = false;
  bool cancelled_ = false;
  bool ended_ = false;      // Finish called
  bool endPending_ = false; // end with pendingStatus_ once the write is done
  grpc::Status pendingStatus_;
};

class Service : public grpc::CallbackGenericService {
 public:
  explicit Service(Server* server) : server_(server) {}
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* ctx) override;

 private:
  Server* server_;
};

// The server's listening sockets, and a thread that accepts connections on them
// and hands them to gRPC (ServerBuilder's external connection acceptor: from
// there on a connection is served exactly as one gRPC accepted itself: same
// handshake and its deadline, same transport).
//
// Why not gRPC's own listener: up to at least gRPC 1.51 (Debian 12's), its TCP
// server stops accepting for good after one accept4() error other than
// EAGAIN/EINTR: it logs "Failed accept4: Too many open files" and never re-arms
// the listening socket. The port stays bound and the process alive, but every
// later client times out. Anyone who can reach the port can trigger that by
// opening a few hundred idle connections until the process runs out of
// descriptors, and so cut the lighthouse off from every replica for good (a
// connection cap would not help: any failed accept, whatever its cause, ends
// that listener). Here an accept error leaves the pending connections queued in
// the kernel, and accepting resumes kRetryAfterErrorMs later, for as long as it
// takes. Cost: one poll() wake-up per burst of new connections; nothing per
// request (calls on an established connection never come here).
class Listener {
 public:
  // While accept() fails (e.g. EMFILE, ENFILE, ENOBUFS, ENOMEM), retry this
  // often: the listening socket stays readable meanwhile, so waiting on it
  // would spin.
  static constexpr int kRetryAfterErrorMs = 100;

  Listener() = default;
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  ~Listener() {
    stop();
  }

  // Parses "host:port" / "[v6]:port"; false for anything else.
  static bool splitHostPort(
      const std::string& address,
      std::string* host,
      std::string* port) {
    std::string h, p;
    if (!address.empty() && address[0] == '[') {
      size_t close = address.find(']');
      if (close == std::string::npos || close + 1 >= address.size() ||
          address[close + 1] != ':')
        return false;
      h = address.substr(1, close - 1);
      p = address.substr(close + 2);
    } else {
      size_t colon = address.rfind(':');
      if (colon == std::string::npos)
        return false;
      h = address.substr(0, colon);
      p = address.substr(colon + 1);
      if (h.find(':') != std::string::npos)
        return false; // unbracketed IPv6
    }
    if (p.empty() || p.size() > 5 ||
        p.find_first_not_of("0123456789") != std::string::npos ||
        std::stoi(p) > 65535)
      return false;
    *host = h;
    *port = p;
    return true;
  }

  // Binds and listens as gRPC would: a wildcard host ("", "::", "0.0.0.0") is
  // one dual-stack socket (or IPv4 alone where there is no IPv6), a name every
  // address it resolves to, on one port (port 0 picks it). Throws
  // std::runtime_error when nothing could be bound.
  void bind(
      const std::string& address,
      const std::string& host,
      const std::string& port) {
    std::string firstError;
    auto note = [&](const char* what) {
      if (firstError.empty())
        firstError = std::string(what) + ": " + std::strerror(errno);
    };
    int chosenPort = std::stoi(port);
    if (host.empty() || host == "::" || host == "0.0.0.0" || host == "*") {
      sockaddr_in6 any6{};
      any6.sin6_family = AF_INET6;
      any6.sin6_addr = in6addr_any;
      any6.sin6_port = htons(static_cast<uint16_t>(chosenPort));
      bool dualStack = false;
      if (listenOn(
              reinterpret_cast<sockaddr*>(&any6),
              sizeof(any6),
              &chosenPort,
              &dualStack,
              note) &&
          dualStack)
        return finishBind(address, firstError);
      sockaddr_in any4{};
      any4.sin_family = AF_INET;
      any4.sin_addr.s_addr = htonl(INADDR_ANY);
      any4.sin_port = htons(static_cast<uint16_t>(chosenPort));
      listenOn(
          reinterpret_cast<sockaddr*>(&any4),
          sizeof(any4),
          &chosenPort,
          nullptr,
          note);
      return finishBind(address, firstError);
    }
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
    if (rc != 0) {
      throw std::runtime_error(
          "gRPC server could not bind " + address + ": " + ::gai_strerror(rc));
    }
    std::vector<std::string> seen;
    for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
      std::string key(
          reinterpret_cast<const char*>(ai->ai_addr),
          ai->ai_addrlen);
      if (std::find(seen.begin(), seen.end(), key) != seen.end())
        continue;
      seen.push_back(key);
      sockaddr_storage addr{};
      std::memcpy(&addr, ai->ai_addr, ai->ai_addrlen);
      setPort(reinterpret_cast<sockaddr*>(&addr), chosenPort);
      listenOn(
          reinterpret_cast<sockaddr*>(&addr),
          ai->ai_addrlen,
          &chosenPort,
          nullptr,
          note);
    }
    ::freeaddrinfo(found);
    finishBind(address, firstError);
  }

  int port() const {
    return port_;
  }

  // Hands every connection accepted from now on to `acceptor` (gRPC's, of a
  // started server).
  void start(
      std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor>
          acceptor) {
    acceptor_ = std::move(acceptor);
    if (::pipe(wake_) != 0)
      throw std::runtime_error("gRPC server: pipe() failed");
    for (int fd : wake_)
      ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    thread_ = std::thread([this] { run(); });
  }

  // Stops accepting and joins the thread; connections already handed over are
  // gRPC's. Must run before the gRPC server shuts down: its acceptor refuses,
  // and leaks, later connections.
  void stop() {
    if (thread_.joinable()) {
      char byte = 0;
      while (::write(wake_[1], &byte, 1) < 0 && errno == EINTR) {
      }
      thread_.join();
    }
    for (int& fd : wake_) {
      if (fd >= 0)
        ::close(fd);
      fd = -1;
    }
    for (int fd : fds_)
      ::close(fd);
    fds_.clear();
  }

 private:
  static void setPort(sockaddr* addr, int port) {
    if (addr->sa_family == AF_INET6)
      reinterpret_cast<sockaddr_in6*>(addr)->sin6_port =
          htons(static_cast<uint16_t>(port));
    else if (addr->sa_family == AF_INET)
      reinterpret_cast<sockaddr_in*>(addr)->sin_port =
          htons(static_cast<uint16_t>(port));
  }

  // One listening socket on `addr`. On success with port 0, *port becomes the
  // one picked.
  template <typename Note>
  bool listenOn(
      sockaddr* addr,
      socklen_t len,
      int* port,
      bool* dualStack,
      Note note) {
    setPort(addr, *port);
    int fd = ::socket(addr->sa_family, SOCK_STREAM, 0);
    if (fd < 0) {
      note("socket");
      return false;
    }
    ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    int one = 1, zero = 0;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    ::setsockopt(
        fd,
        IPPROTO_TCP,
        TCP_NODELAY,
        &one,
        sizeof(one)); // inherited by connections
    if (dualStack != nullptr) {
      *dualStack =
          ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero)) == 0;
    }
    if (::bind(fd, addr, len) != 0) {
      note("bind");
      ::close(fd);
      return false;
    }
    // The kernel caps the backlog at net.core.somaxconn, which is what gRPC's
    // listener asks for.
    if (::listen(fd, 65535) != 0) {
      note("listen");
      ::close(fd);
      return false;
    }
    if (*port == 0) {
      sockaddr_storage bound{};
      socklen_t boundLen = sizeof(bound);
      if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &boundLen) ==
          0) {
        *port = bound.ss_family == AF_INET6
            ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
            : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      }
    }
    fds_.push_back(fd);
    port_ = *port;
    return true;
  }

  void finishBind(const std::string& address, const std::string& firstError) {
    if (fds_.empty() || port_ == 0) {
      for (int fd : fds_)
        ::close(fd);
      fds_.clear();
      throw std::runtime_error(
          "gRPC server could not bind " + address +
          (firstError.empty() ? "" : ": " + firstError));
    }
  }

  // Accepts until stop(). Never gives up on a listening socket: an error is
  // either about the one connection (it is gone: go on) or about this process
  // (wait, then try again).
  void run() {
    std::vector<pollfd> polled;
    for (int fd : fds_)
      polled.push_back(pollfd{fd, POLLIN, 0});
    polled.push_back(pollfd{wake_[0], POLLIN, 0});
    bool backingOff = false;
    int lastError = 0;
    while (true) {
      // While backing off, only the wake-up pipe is watched (the listeners are
      // readable).
      for (size_t i = 0; i + 1 < polled.size(); ++i)
        polled[i].events = backingOff ? 0 : POLLIN;
      for (auto& p : polled)
        p.revents = 0;
      int n = ::poll(
          polled.data(),
          polled.size(),
          backingOff ? kRetryAfterErrorMs : -1);
      if (n < 0 && errno != EINTR) {
        // Not expected (EFAULT/EINVAL/ENOMEM): do not spin on it.
        std::this_thread::sleep_for(
            std::chrono::milliseconds(kRetryAfterErrorMs));
        continue;
      }
      if (polled.back().revents != 0)
        return; // stop()
      bool failed = false;
      for (size_t i = 0; i + 1 < polled.size(); ++i) {
        if (!backingOff && polled[i].revents == 0)
          continue;
        int err = acceptAll(polled[i].fd);
        if (err != 0) {
          failed = true;
          if (err != lastError) {
            gpr_log(
                GPR_ERROR,
                "ft gRPC server: accept failed (%s); pending connections wait, "
                "retrying "
                "every %d ms",
                std::strerror(err),
                kRetryAfterErrorMs);
            lastError = err;
          }
        }
      }
      if (!failed && lastError != 0) {
        gpr_log(GPR_INFO, "ft gRPC server: accepting connections again");
        lastError = 0;
      }
      backingOff = failed;
    }
  }

  // Accepts every pending connection of `listenFd`. 0 once none is left; else
  // the errno that stopped it (running out of descriptors, or anything
  // unexpected).
  int acceptAll(int listenFd) {
    while (true) {
#ifdef __linux__
      int fd =
          ::accept4(listenFd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
#else
      int fd = ::accept(listenFd, nullptr, nullptr);
      if (fd >= 0) {
        ::fcntl(fd, F_SETFD, FD_CLOEXEC);
        ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
      }
#endif
      if (fd < 0) {
        int err = errno;
        if (err == EAGAIN || err == EWOULDBLOCK)
          return 0;
        if (err == EINTR || err == ECONNABORTED || err == EPROTO ||
            err == EPERM || err == ENETDOWN || err == ENOPROTOOPT ||
            err == EHOSTDOWN || err == EHOSTUNREACH || err == ENETUNREACH ||
            err == EOPNOTSUPP) {
          continue; // that connection failed (Linux reports its network errors
                    // here); next
        }
        // Out of resources (EMFILE, ENFILE, ENOBUFS, ENOMEM) or unexpected: the
        // connection stays queued, and the caller retries after a pause.
        return err;
      }
      grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters
          params;
      params.listener_fd = listenFd;
      params.fd = fd;
      acceptor_->HandleNewConnection(
          &params); // gRPC owns (and closes) fd from here
    }
  }

  std::vector<int> fds_;
  int port_ = 0;
  int wake_[2] = {-1, -1};
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  std::thread thread_;
};

class Server {
 public:
  Server(
      const std::string& address,
      py::function handler,
      int maxMessageBytes,
      int keepaliveMs,
      std::unique_ptr<RequestVerifier> verifier,
      std::unique_ptr<HeartbeatTable> heartbeats,
      std::unique_ptr<SteadyQuorum> steady,
      std::unordered_map<std::string, std::string> callStreams)
      : handler_(std::move(handler)),
        verifier_(std::move(verifier)),
        heartbeats_(std::move(heartbeats)),
        steady_(std::move(steady)),
        callStreams_(std::move(callStreams)),
        service_(this) {
    grpc::ServerBuilder builder;
    std::string host, port;
    // A Unix socket ("unix:/path", "unix-abstract:name") is left to gRPC's own
    // listener.
    const bool ownListener = address.compare(0, 5, "unix:") != 0 &&
        address.compare(0, 14, "unix-abstract:") != 0;
    if (ownListener && !Listener::splitHostPort(address, &host, &port)) {
      throw std::runtime_error(
          "gRPC server could not bind " + address +
          ": not host:port or [ipv6]:port");
    }
    std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor;
    if (ownListener) {
      // host:port: accepted by Listener, which survives accept errors (see
      // there).
      {
        py::gil_scoped_release nogil; // resolving a name may take a while
        listener_.bind(address, host, port);
      }
      acceptor = builder.experimental().AddExternalConnectionAcceptor(
          grpc::ServerBuilder::experimental_type::ExternalConnectionType::
              FROM_FD,
          grpc::InsecureServerCredentials());
    } else {
      builder.AddListeningPort(
          address,
          grpc::InsecureServerCredentials(),
          &port_);
      builder.AddChannelArgument("grpc.so_reuseport", 0);
    }
    builder.RegisterCallbackGenericService(&service_);
    builder.SetMaxReceiveMessageSize(maxMessageBytes);
    builder.SetMaxSendMessageSize(maxMessageBytes);
    // Accept clients' keepalive pings every few seconds (ft's clients ping
    // every 5 s so that a partition ends their calls); the default policy
    // answers them with GOAWAY.
    builder.AddChannelArgument("grpc.keepalive_permit_without_calls", 1);
    builder.AddChannelArgument(
        "grpc.http2.min_recv_ping_interval_without_data_ms",
        2500);
    builder.AddChannelArgument("grpc.http2.max_ping_strikes", 0);
    if (keepaliveMs > 0) {
      // Ping idle connections, so that the call of a peer that stopped
      // answering ends.
      builder.AddChannelArgument("grpc.keepalive_time_ms", keepaliveMs);
      builder.AddChannelArgument("grpc.keepalive_timeout_ms", keepaliveMs);
    }
    {
      py::gil_scoped_release nogil;
      server_ = builder.BuildAndStart();
    }
    if (server_ && ownListener) {
      port_ = listener_.port();
      listener_.start(std::move(acceptor));
    }
    if (!server_ || port_ == 0) {
      throw std::runtime_error("gRPC server could not bind " + address);
    }
  }

  ~Server() {
    shutdown(0.0);
  }

  int port() const {
    return port_;
  }

  // GIL held on entry. A second caller returns at once (the first one is
  // shutting down).
  void shutdown(double graceSeconds) {
    std::unique_ptr<grpc::Server> server = std::move(server_);
    if (!server)
      return;
    if (!(graceSeconds > 0))
      graceSeconds = 0; // NaN and negatives
    graceSeconds = std::min(graceSeconds, 3600.0);
    if (steady_) {
      // Held rounds the lighthouse did not take back before shutting down.
      for (auto& held : steady_->close()) {
        held.call->finish(
            grpc::Status(
                grpc::StatusCode::UNAVAILABLE,
                "lighthouse is shutting down"));
      }
    }
    {
      py::gil_scoped_release
          nogil; // reactions still running need the GIL to finish
      auto deadline = std::chrono::system_clock::now() +
          std::chrono::microseconds(static_cast<int64_t>(graceSeconds * 1e6));
      listener_.stop(); // first: no connection may reach gRPC's acceptor once
                        // it shuts down
      server->Shutdown(deadline); // returns once every call's OnDone has run
      server.reset();
    }
    // The handler refers back to the Python server object: drop it to break the
    // cycle.
    handler_ = py::function();
  }

  const py::function& handler() const {
    return handler_;
  }
  RequestVerifier* verifier() const {
    return verifier_.get();
  }
  // Whether `method` is the heartbeat stream (open or closed).
  bool isHeartbeatStream(const std::string& method) const {
    return heartbeats_ && !heartbeats_->streamMethod().empty() &&
        method == heartbeats_->streamMethod();
  }
  // The heartbeat fast path while it is open, else nullptr.
  HeartbeatTable* heartbeats() const {
    return heartbeatsOpen_.load(std::memory_order_acquire) ? heartbeats_.get()
                                                           : nullptr;
  }
  // From now on every heartbeat goes to Python (e.g. so that it answers
  // "shutting down").
  void closeHeartbeatFastPath() {
    heartbeatsOpen_.store(false, std::memory_order_release);
  }
  std::vector<std::pair<std::string, double>> takeHeartbeats() {
    if (!heartbeats_)
      return {};
    return heartbeats_->take();
  }
  // The steady quorum round (None: every Quorum request goes to Python).
  SteadyQuorum* steady() const {
    return steady_.get();
  }
  // The method whose calls `method` carries when it is a call stream, else
  // nullptr.
  const std::string* carriedBy(const std::string& method) const {
    auto it = callStreams_.find(method);
    return it == callStreams_.end() ? nullptr : &it->second;
  }
  void recordHeartbeats(const std::vector<std::string>& ids) {
    if (heartbeats_)
      heartbeats_->recordIds(ids, ft_steady::steadySeconds());
  }

  // Calls Python's handler for one request (GIL held by the caller). Returns
  // the error it raised, or "".
  std::string callHandler(
      const std::shared_ptr<CallState>& state,
      const std::string& body) {
    try {
      PyObject* raw = PyBytes_FromStringAndSize(
          body.data(),
          static_cast<Py_ssize_t>(body.size()));
      if (raw == nullptr)
        throw py::error_already_set();
      auto data = py::reinterpret_steal<py::bytes>(raw);
      handler_(py::cast(state), data);
    } catch (py::error_already_set& e) {
      return e.what();
    } catch (const std::exception& e) { // e.g. bad_alloc: never into gRPC
      return e.what();
    }
    return "";
  }

 private:
  py::function handler_;
  // Both fixed at construction, before the first call can arrive; read by gRPC
  // threads.
  const std::unique_ptr<RequestVerifier> verifier_;
  const std::unique_ptr<HeartbeatTable> heartbeats_;
  const std::unique_ptr<SteadyQuorum> steady_;
  // call stream method path -> the unary method path its messages carry
  const std::unordered_map<std::string, std::string> callStreams_;
  std::atomic<bool> heartbeatsOpen_{true};
  Service service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  Listener listener_; // after server_: destroyed (stopped) before it
};

// --- CallState
// ---------------------------------------------------------------------------

bool CallState::write(grpc::ByteBuffer msg) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!streamsWrites_ || finishRequested_ || cancelled_ ||
      queued_.size() >= kMaxQueuedWrites)
    return false;
  queued_.push_back(std::move(msg));
  pump(lock);
  return true;
}

bool CallState::reply(grpc::ByteBuffer msg) {
  std::unique_lock<std::mutex> lock(mu_);
  if (finishRequested_ || cancelled_)
    return false;
  queued_.push_back(std::move(msg));
  finishRequested_ = true;
  finalStatus_ = grpc::Status::OK;
  pump(lock);
  return true;
}

bool CallState::finish(grpc::Status status) {
  std::unique_lock<std::mutex> lock(mu_);
  if (finishRequested_)
    return false;
  finishRequested_ = true;
  finalStatus_ = std::move(status);
  if (cancelled_)
    queued_.clear();
  pump(lock);
  return true;
}

void CallState::pump(std::unique_lock<std::mutex>& lock) {
  if (writing_ || finishStarted_ || sink_ == nullptr)
    return;
  if (!queued_.empty()) {
    inFlight_ = std::move(queued_.front());
    queued_.pop_front();
    AnswerSink* r = sink_;
    if (finishRequested_ && queued_.empty()) {
      // The last message and the status in one operation (one round of gRPC
      // work, not two).
      finishStarted_ = true;
      grpc::Status status = finalStatus_;
      lock.unlock();
      r->startWriteAndFinish(&inFlight_, status);
      return;
    }
    writing_ = true;
    lock.unlock();
    r->startWrite(&inFlight_);
    return;
  }
  if (finishRequested_) {
    finishStarted_ = true;
    AnswerSink* r = sink_;
    grpc::Status status = finalStatus_;
    lock.unlock();
    r->startFinish(status);
  }
}

void CallState::setOnCancel(py::object cb) {
  // GIL held. Stored and flagged under mu_, where onCancel() reads the flag:
  // either the cancellation sees the callback, or this sees the cancellation
  // and calls it now.
  if (cb.is_none())
    cb = py::object();
  py::object previous;
  bool callNow = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (cancelled_) {
      callNow = static_cast<bool>(
          cb); // too late to store: the notice already went out
    } else if (!finishRequested_) {
      previous = std::move(onCancel_);
      onCancel_ = std::move(cb);
      hasOnCancel_ = static_cast<bool>(onCancel_);
    } // else answered: it can no longer be cancelled unanswered
  }
  if (callNow)
    cb();
}

void CallState::markCancelledLocked(const char* why) {
  cancelled_ = true;
  queued_.clear();
  if (!finishRequested_) {
    finishRequested_ = true;
    finalStatus_ = grpc::Status(grpc::StatusCode::CANCELLED, why);
  }
}

void CallState::onWriteDone(bool ok) {
  std::unique_lock<std::mutex> lock(mu_);
  writing_ = false;
  if (!ok) {
    // The stream broke: nothing more can be written; the call still has to be
    // finished.
    markCancelledLocked("the stream broke");
  }
  pump(lock);
}

bool CallState::onCancel() {
  std::unique_lock<std::mutex> lock(mu_);
  const bool notify = hasOnCancel_;
  markCancelledLocked("cancelled");
  pump(lock);
  return notify;
}

void CallState::onDone() {
  std::lock_guard<std::mutex> g(mu_);
  sink_ = nullptr;
  cancelled_ = cancelled_ || !finishRequested_;
}

// --- CallReactor
// -------------------------------------------------------------------------

grpc::ServerGenericBidiReactor* Service::CreateReactor(
    grpc::GenericCallbackServerContext* ctx) {
  if (const std::string* carried = server_->carriedBy(ctx->method()))
    return CallStreamReactor::start(server_, *carried);
  return new CallReactor(ctx, server_);
}

// --- Requests, however they arrived (a call of their own or a call stream)
// ---------------------------------------------------------------------------

std::string bufferToString(const grpc::ByteBuffer& buffer, bool* ok) {
  std::vector<grpc::Slice> slices;
  std::string out;
  *ok = buffer.Dump(&slices).ok();
  if (!*ok)
    return out;
  size_t size = 0;
  for (const auto& s : slices)
    size += s.size();
  out.reserve(size);
  for (const auto& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// With a verifier, checks the signature of `*body` (the request of `state`)
// and takes it off, so that Python and the native paths see the request as
// its client serialized it (request_auth.hpp). False: the call was answered
// (UNAUTHENTICATED, or INTERNAL). Never takes the GIL: a refused call costs
// Python nothing.
bool verifyRequest(Server* server, CallState& state, std::string* body) {
  RequestVerifier* verifier = server->verifier();
  // The server-id call is the one that is not signed: Python answers it.
  if (verifier == nullptr || state.method() == ft_auth::kServerIdMethod)
    return true;
  size_t offset = 0;
  std::string why;
  try {
    const std::string token =
        ft_auth::splitSigned(body->data(), body->size(), &offset);
    why = verifier->verify(
        state.method(),
        body->data() + offset,
        body->size() - offset,
        token);
  } catch (const std::exception& e) { // bad_alloc: never into gRPC's thread
    state.finish(
        grpc::Status(
            grpc::StatusCode::INTERNAL,
            std::string("could not check the signature: ") + e.what()));
    return false;
  }
  if (!why.empty()) {
    state.finish(
        grpc::Status(
            grpc::StatusCode::UNAUTHENTICATED,
            state.method() + ": refused: " + why +
                "; this server requires the job secret "
                "(FT_JOB_SECRET_FILE / FT_JOB_SECRET)"));
    return false;
  }
  state.markVerified();
  body->erase(0, offset);
  return true;
}

// Hands requests to Python's handler (one GIL acquisition for all); a handler
// that raised finishes its call INTERNAL.
void callPython(
    Server* server,
    std::vector<std::pair<std::shared_ptr<CallState>, std::string>> calls) {
  std::vector<std::pair<std::shared_ptr<CallState>, std::string>> failed;
  {
    GrpcThreadGil gil;
    for (auto& [call, body] : calls) {
      std::string error = server->callHandler(call, body);
      if (!error.empty())
        failed.emplace_back(call, std::move(error));
    }
  }
  for (auto& [call, error] : failed) {
    call->finish(
        grpc::Status(grpc::StatusCode::INTERNAL, "handler failed: " + error));
  }
}

// A Quorum request while the server has a steady round (SteadyQuorum): held,
// answered with its round, or handed to Python (with the held ones it
// releases).
void offerToSteadyRound(
    Server* server,
    SteadyQuorum* steady,
    const std::shared_ptr<CallState>& state,
    std::string body) {
  auto outcome = steady->offer(
      state,
      std::move(body),
      state->arrived(),
      state->timeRemaining());
  server->recordHeartbeats(outcome.heartbeatIds);
  if (!outcome.answered.empty()) {
    grpc::Slice slice(outcome.answer);
    const grpc::ByteBuffer answer(&slice, 1);
    for (const auto& call : outcome.answered)
      call->reply(answer);
  }
  if (outcome.toPython.empty())
    return;
  std::vector<std::pair<std::shared_ptr<CallState>, std::string>> calls;
  calls.reserve(outcome.toPython.size());
  for (auto& held : outcome.toPython)
    calls.emplace_back(held.call, std::move(held.body));
  callPython(server, std::move(calls));
}

// Answers a verified request: a routine heartbeat from the table, a steady
// Quorum round, anything else in Python.
void answerRequest(
    Server* server,
    const std::shared_ptr<CallState>& state,
    std::string body) {
  HeartbeatTable* heartbeats = server->heartbeats();
  if (heartbeats != nullptr && state->method() == heartbeats->method() &&
      heartbeats->recordUnary(body, state->timeRemaining())) {
    grpc::Slice empty;
    state->reply(grpc::ByteBuffer(&empty, 1)); // LighthouseHeartbeatResponse {}
    return;
  }
  SteadyQuorum* steady = server->steady();
  if (steady != nullptr && state->method() == steady->method()) {
    offerToSteadyRound(server, steady, state, std::move(body));
    return;
  }
  std::vector<std::pair<std::shared_ptr<CallState>, std::string>> calls;
  calls.emplace_back(state, std::move(body));
  callPython(server, std::move(calls));
}

// A call that ended unanswered: marked cancelled first (a round that offers it
// from now on does not hold it), dropped from the steady round if held (the
// round goes on without it), and Python's on_cancel told.
void cancelCall(Server* server, const std::shared_ptr<CallState>& state) {
  const bool notify = state->onCancel();
  if (SteadyQuorum* steady = server->steady())
    steady->drop(state.get());
  if (!notify)
    return;
  GrpcThreadGil gil;
  py::object cb = state->takeOnCancel();
  if (cb) {
    try {
      cb();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("ft gRPC server: on_cancel");
    } catch (const std::exception& e) {
      PyErr_WarnEx(PyExc_RuntimeWarning, e.what(), 1);
    }
  }
}

// gRPC is done with the call: its answer can go nowhere any more.
void releaseCall(CallState& state) {
  state.onDone();
  if (state.hasOnCancel()) {
    // Finished by this file, not by Python (e.g. the handler raised): drop it
    // with the GIL.
    GrpcThreadGil gil;
    state.takeOnCancel();
  }
}

// --- CallReactor
// -------------------------------------------------------------------------

CallReactor::CallReactor(
    grpc::GenericCallbackServerContext* ctx,
    Server* server)
    : server_(server),
      ctx_(ctx),
      state_(
          std::make_shared<CallState>(this, ctx->method(), ctx->deadline())) {
  StartRead(&request_);
}

void CallReactor::OnReadDone(bool ok) {
  if (!ok && streaming_) {
    // The client closed its side (or went away: then the answer goes nowhere).
    grpc::Slice empty;
    state_->reply(grpc::ByteBuffer(&empty, 1)); // LighthouseHeartbeatResponse
    return;
  }
  if (!ok) {
    state_->finish(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request message"));
    return;
  }
  bool readable = false;
  std::string body = bufferToString(request_, &readable);
  request_.Clear();
  if (!readable) {
    state_->finish(
        grpc::Status(grpc::StatusCode::INTERNAL, "could not read the request"));
    return;
  }
  if (!verifyRequest(server_, *state_, &body))
    return;
  if (server_->isHeartbeatStream(state_->method())) {
    onStreamedHeartbeat(body);
    return;
  }
  answerRequest(server_, state_, std::move(body));
}

void CallReactor::onStreamedHeartbeat(const std::string& body) {
  HeartbeatTable* heartbeats = server_->heartbeats();
  if (heartbeats == nullptr) {
    // Closed: the lighthouse is shutting down, and Python answers every
    // heartbeat from now on.
    state_->finish(
        grpc::Status(
            grpc::StatusCode::UNAVAILABLE,
            "heartbeat stream closed by the server: send heartbeats unary"));
    return;
  }
  if (!heartbeats->record(body)) {
    state_->finish(
        grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            "heartbeat stream takes only a plain heartbeat (a valid replica "
            "id, not leaving, no other fields): send this one unary"));
    return;
  }
  if (!streaming_) {
    // The stream's headers, sent once its first heartbeat is recorded: the
    // client's confirmation that this server takes the stream (a server
    // without it answers with its status alone), before which it counts no
    // message as delivered.
    streaming_ = true;
    ctx_->AddInitialMetadata(kHeartbeatStreamHeader, "1");
    StartSendInitialMetadata();
  }
  StartRead(&request_);
}

void CallReactor::OnCancel() {
  cancelCall(server_, state_);
}

void CallReactor::OnDone() {
  releaseCall(*state_);
  delete this;
}

// --- CallStreamReactor
// -------------------------------------------------------------------------

void CallStreamReactor::OnReadDone(bool ok) {
  if (!ok) {
    // The client closed its side (or the stream ended: then OnCancel ends
    // it).
    bool end = false;
    {
      std::lock_guard<std::mutex> g(mu_);
      clientClosed_ = true;
      if (!current_)
        end = endLocked(grpc::Status::OK);
    }
    if (end)
      Finish(grpc::Status::OK);
    return;
  }
  bool readable = false;
  const std::string message = bufferToString(in_, &readable);
  in_.Clear();
  ft_call_stream::Request req;
  if (!readable || !ft_call_stream::decodeRequest(message, &req) ||
      req.timeoutMs <= 0) {
    const grpc::Status refused(
        grpc::StatusCode::INVALID_ARGUMENT,
        "call stream: every message must be a CallStreamRequest with "
        "timeout_ms > 0");
    bool end = false;
    {
      std::lock_guard<std::mutex> g(mu_);
      end = endLocked(refused);
    }
    if (end)
      Finish(refused);
    return;
  }
  // A year at most, so that the time point does not overflow.
  const int64_t timeoutMs =
      std::min<int64_t>(req.timeoutMs, int64_t{365} * 24 * 3600 * 1000);
  auto state = std::make_shared<CallState>(
      this,
      carriedMethod_,
      std::chrono::system_clock::now() + std::chrono::milliseconds(timeoutMs),
      /*streamsWrites=*/false,
      self_);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (cancelled_ || ended_)
      return; // nobody to answer
    current_ = state;
  }
  std::string body(req.request);
  if (!verifyRequest(server_, *state, &body))
    return;
  answerRequest(server_, state, std::move(body));
}

void CallStreamReactor::answer(
    const grpc::Status& status,
    const grpc::ByteBuffer* msg) {
  std::string body;
  grpc::Status sent = status;
  if (msg != nullptr) {
    bool readable = false;
    body = bufferToString(*msg, &readable);
    if (!readable) {
      body.clear();
      sent = grpc::Status(
          grpc::StatusCode::INTERNAL,
          "could not read the answer to send it");
    }
  }
  std::string details = sent.error_message();
  if (!ft_wire::validUtf8(details)) {
    // A proto3 string: protobuf refuses invalid UTF-8 (the message would not
    // parse at the client): every non-ASCII byte becomes '?'.
    for (char& c : details)
      if (static_cast<unsigned char>(c) >= 0x80)
        c = '?';
  }
  std::string encoded = ft_call_stream::encodeResponse(
      static_cast<int32_t>(sent.error_code()),
      details,
      body);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (cancelled_ || ended_)
      return; // the stream is gone: the answer goes nowhere
    grpc::Slice slice(std::move(encoded));
    out_ = grpc::ByteBuffer(&slice, 1);
    writing_ = true;
  }
  StartWrite(&out_);
}

void CallStreamReactor::OnWriteDone(bool ok) {
  std::shared_ptr<CallState> answered;
  bool end = false;
  bool readNext = false;
  grpc::Status status;
  {
    std::lock_guard<std::mutex> g(mu_);
    writing_ = false;
    answered = std::move(current_);
    if (endPending_) {
      status = pendingStatus_;
      end = endLocked(status);
    } else if (!ok) {
      status = grpc::Status(grpc::StatusCode::CANCELLED, "the stream broke");
      end = endLocked(status);
    } else if (clientClosed_) {
      status = grpc::Status::OK;
      end = endLocked(status);
    } else {
      readNext = !cancelled_ && !ended_;
    }
  }
  if (answered)
    releaseCall(*answered);
  if (end)
    Finish(status);
  else if (readNext)
    StartRead(&in_);
}

bool CallStreamReactor::endLocked(const grpc::Status& status) {
  if (ended_)
    return false;
  if (writing_) {
    endPending_ = true;
    pendingStatus_ = status;
    return false;
  }
  endPending_ = false;
  ended_ = true;
  return true;
}

void CallStreamReactor::OnCancel() {
  std::shared_ptr<CallState> unanswered;
  bool end = false;
  const grpc::Status cancelled(grpc::StatusCode::CANCELLED, "cancelled");
  {
    std::lock_guard<std::mutex> g(mu_);
    cancelled_ = true;
    if (!writing_)
      unanswered = std::move(current_);
    end = endLocked(cancelled);
  }
  if (unanswered) {
    cancelCall(server_, unanswered);
    releaseCall(*unanswered);
  }
  if (end)
    Finish(cancelled);
}

void CallStreamReactor::OnDone() {
  std::shared_ptr<CallState> last;
  std::shared_ptr<CallStreamReactor> self;
  {
    std::lock_guard<std::mutex> g(mu_);
    last = std::move(current_);
    self = std::move(self_);
  }
  if (last)
    releaseCall(*last);
  // `self` goes here: this is deleted now unless a carried call still holds
  // it.
}

grpc::ByteBuffer toByteBuffer(const py::bytes& data) {
  char* buf = nullptr;
  Py_ssize_t len = 0;
  PyBytes_AsStringAndSize(data.ptr(), &buf, &len);
  grpc::Slice slice(buf, static_cast<size_t>(len));
  return grpc::ByteBuffer(&slice, 1);
}

} // namespace

PYBIND11_MODULE(_grpc_server, m) {
  m.doc() =
      "A generic gRPC server (C++ callback API) whose calls Python answers, "
      "and a unary-call client channel; see ft.coordination.rpc_server and "
      "ft.coordination.clients.";

  // Abseil built without NDEBUG (as some distributions ship it, Debian's
  // among them) checks every mutex acquisition for lock-order cycles, a debug
  // aid that recorded a graph node per lock: 5-8 % of a lighthouse's CPU under
  // heartbeat load. gRPC's own locks are what it checks; ft's code takes
  // none of them. Off, as in a release build of Abseil.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  py::class_<CallState, std::shared_ptr<CallState>>(m, "Call")
      .def_property_readonly("method", &CallState::method)
      .def_property_readonly("verified", &CallState::verified)
      .def_property_readonly("arrived", &CallState::arrived)
      .def_property(
          "on_cancel",
          [](CallState& c) { return c.peekOnCancel(); },
          &CallState::setOnCancel)
      .def("time_remaining", &CallState::timeRemaining)
      .def("is_active", &CallState::isActive)
      .def(
          "write",
          [](CallState& c, const py::bytes& data) {
            return c.write(toByteBuffer(data));
          })
      .def(
          "reply",
          [](CallState& c, const py::bytes& data) {
            bool ok = c.reply(toByteBuffer(data));
            c.takeOnCancel(); // answered: it will not be cancelled unanswered
            return ok;
          })
      .def(
          "finish",
          [](CallState& c, int code, const std::string& details) {
            bool ok = c.finish(
                grpc::Status(static_cast<grpc::StatusCode>(code), details));
            c.takeOnCancel();
            return ok;
          },
          py::arg("code") = 0,
          py::arg("details") = "");

  py::class_<Server>(m, "Server")
      .def(
          py::init(
              [](const std::string& address,
                 py::function handler,
                 int maxMessageBytes,
                 int keepaliveMs,
                 py::object verifier,
                 py::object heartbeat,
                 py::object steadyQuorum,
                 std::unordered_map<std::string, std::string> callStreams) {
                // verifier: (key bytes, skew ms, max remembered nonces,
                // server id) or None. heartbeat: (method path, stream method
                // path or "", max name bytes, no-deadline seconds) or None.
                std::unique_ptr<RequestVerifier> v;
                if (!verifier.is_none()) {
                  auto t = verifier.cast<py::tuple>();
                  v = std::make_unique<RequestVerifier>(
                      t[0].cast<std::string>(),
                      t[1].cast<int64_t>(),
                      t[2].cast<size_t>(),
                      t[3].cast<std::string>());
                }
                std::unique_ptr<HeartbeatTable> h;
                if (!heartbeat.is_none()) {
                  auto t = heartbeat.cast<py::tuple>();
                  h = std::make_unique<HeartbeatTable>(
                      t[0].cast<std::string>(),
                      t[1].cast<std::string>(),
                      t[2].cast<size_t>(),
                      t[3].cast<double>());
                }
                // steady_quorum: (Quorum method path, no-deadline seconds) or
                // None.
                std::unique_ptr<SteadyQuorum> sq;
                if (!steadyQuorum.is_none()) {
                  auto t = steadyQuorum.cast<py::tuple>();
                  sq = std::make_unique<SteadyQuorum>(
                      t[0].cast<std::string>(),
                      t[1].cast<double>());
                }
                return std::make_unique<Server>(
                    address,
                    std::move(handler),
                    maxMessageBytes,
                    keepaliveMs,
                    std::move(v),
                    std::move(h),
                    std::move(sq),
                    std::move(callStreams));
              }),
          py::arg("address"),
          py::arg("handler"),
          py::arg("max_message_bytes"),
          py::arg("keepalive_ms") = 0,
          py::arg("verifier") = py::none(),
          py::arg("heartbeat") = py::none(),
          py::arg("steady_quorum") = py::none(),
          // {call stream method path: the unary method path it carries}
          py::arg("call_streams") =
              std::unordered_map<std::string, std::string>())
      .def_property_readonly("port", &Server::port)
      .def(
          "steady_arm",
          [](Server& s,
             int64_t quorumId,
             std::unordered_map<std::string, py::bytes> identities) {
            if (s.steady() == nullptr)
              return false;
            std::unordered_map<std::string, std::string> ids;
            for (auto& kv : identities)
              ids.emplace(kv.first, std::string(kv.second));
            py::gil_scoped_release nogil;
            return s.steady()->arm(quorumId, std::move(ids));
          })
      .def(
          "steady_take",
          [](Server& s) {
            // Disarms; the held requests as (call, body, arrived), for the
            // caller to register.
            py::list out;
            if (s.steady() == nullptr)
              return out;
            std::vector<SteadyQuorum::Held> held;
            {
              py::gil_scoped_release nogil;
              held = s.steady()->disarm();
            }
            for (auto& h : held) {
              out.append(
                  py::make_tuple(
                      py::cast(h.call),
                      py::bytes(h.body),
                      h.arrived));
            }
            return out;
          })
      .def(
          "steady_held_age",
          [](Server& s) {
            return s.steady() ? s.steady()->oldestHeldAge() : 0.0;
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "steady_armed",
          [](Server& s) { return s.steady() ? s.steady()->armed() : false; },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "steady_rounds",
          [](Server& s) {
            // (the quorum id the last of them repeated, rounds answered in
            // C++ since the last call, their latencies, the last one's members
            // as serialized, its created time in ns).
            SteadyQuorum::Rounds r;
            if (s.steady() != nullptr) {
              py::gil_scoped_release nogil;
              r = s.steady()->takeRounds();
            }
            py::list members;
            for (const auto& m : r.lastMembers)
              members.append(py::bytes(m));
            return py::make_tuple(
                r.quorumId,
                r.count,
                r.latencies,
                members,
                r.lastCreatedUnixNanos);
          })
      .def(
          "take_heartbeats",
          &Server::takeHeartbeats,
          py::call_guard<py::gil_scoped_release>())
      .def("close_heartbeat_fast_path", &Server::closeHeartbeatFastPath)
      .def("shutdown", &Server::shutdown, py::arg("grace") = 0.0);

  // The C++ signature check alone, for the test that holds it to
  // ft.utils.auth.Verifier.
  py::class_<RequestVerifier>(m, "RequestVerifier")
      .def(
          py::init<std::string, int64_t, size_t, std::string>(),
          py::arg("key"),
          py::arg("skew_ms"),
          py::arg("max_nonces"),
          py::arg("server_id"))
      .def(
          "verify",
          [](RequestVerifier& v,
             const std::string& what,
             const std::string& body,
             const std::string& token) {
            return v.verify(what, body.data(), body.size(), token);
          });

  // The C++ signer alone, for the test that holds it to
  // ft.utils.auth.Verifier.
  py::class_<ft_auth::RequestSigner>(m, "RequestSigner")
      .def(py::init<std::string>(), py::arg("key"))
      .def(
          "set_server_id",
          &ft_auth::RequestSigner::setServerId,
          py::arg("server_id"))
      .def(
          "token",
          [](ft_auth::RequestSigner& s,
             const std::string& what,
             const std::string& body) {
            return s.token(what, body.data(), body.size());
          });

  // The C++ parse of a request's leading auth field alone, for the test that
  // holds it to ft.utils.auth.split_signed: (offset of the request, token).
  m.def("split_signed", [](const std::string& data) {
    size_t offset = 0;
    std::string token = ft_auth::splitSigned(data.data(), data.size(), &offset);
    return py::make_tuple(offset, py::bytes(token));
  });

  // SteadyQuorum's rule alone, for the tests that hold it to
  // ft.coordination.quorum: armed with quorum `quorum_id` and `identities`,
  // the outcome of each request in turn, every one with a deadline: ("held",
  // b""), ("answered", the answer for the round it completed), or ("python",
  // b"") (it and the held ones went to Python: disarmed from then on).
  m.def(
      "steady_quorum_rule",
      [](int64_t quorumId,
         std::unordered_map<std::string, py::bytes> identities,
         std::vector<py::bytes> requests) {
        struct RuleCall {
          double timeRemaining() const {
            return 10.0;
          }
          bool isActive() const {
            return true;
          }
        };
        ft_steady::SteadyQuorum<RuleCall> rule("Quorum", 3600.0);
        std::unordered_map<std::string, std::string> ids;
        for (auto& kv : identities)
          ids.emplace(kv.first, std::string(kv.second));
        py::list out;
        if (!rule.arm(quorumId, std::move(ids)))
          return out;
        for (auto& r : requests) {
          auto o = rule.offer(
              std::make_shared<RuleCall>(),
              std::string(r),
              ft_steady::steadySeconds(),
              10.0);
          if (!o.toPython.empty())
            out.append(py::make_tuple("python", py::bytes()));
          else if (!o.answered.empty())
            out.append(py::make_tuple("answered", py::bytes(o.answer)));
          else
            out.append(py::make_tuple("held", py::bytes()));
        }
        return out;
      });
  m.def("steady_identity", [](const std::string& body) -> py::object {
    // (replica id, step, identity) of a Quorum request, or None where the
    // steady round would not take it.
    ft_steady::QuorumRequest r;
    if (!ft_steady::parseQuorumRequest(body, &r))
      return py::none();
    return py::make_tuple(r.replicaId, r.step, py::bytes(r.identity));
  });

  // The client side: ft's coordination clients' unary calls (grpc_client.cpp).
  bindClient(m);
  bindQuorumWire(m);
}
