// ft.coordination._grpc_server: a gRPC server in C++ whose calls are answered by Python.
//
// Why: a Python grpcio server spends ~0.5 ms of CPU per request in its own machinery (poller
// thread, thread-pool hand-off, GIL ping-pong), which made the lighthouse's quorum round at 8
// replica groups CPU-bound. Here gRPC's C++ callback API owns the connections, the HTTP/2 work and
// the call lifetimes; Python sees one function call per request (`handler(call, request_bytes)`)
// and answers whenever it likes, from any thread, with `call.reply(...)`, `call.write(...)` or
// `call.finish(...)`. Which service and method a call is for is Python's business (`call.method`,
// e.g. "/torchft.LighthouseService/Quorum"): the server is generic and knows no protobuf types.
//
// Contract:
// - `handler(call, request_bytes)` runs on a gRPC thread with the GIL held, once per call, after
//   the call's single request message arrived. It must not block for long: answer later from
//   another thread if the answer needs waiting for (a quorum does).
// - Call methods never call back into Python and never block on the network: they queue a gRPC
//   operation and return. They may be called from any thread, any number of times; everything
//   after the first finish is ignored (return value false).
// - When a call ends without Python having finished it (the client cancelled, went away or its
//   deadline passed), the call's `on_cancel`, if Python set one, is called once with the GIL
//   held: on a gRPC thread, or at once in the setter if the call was already cancelled. gRPC may
//   run it inline inside a Call method issued by Python, so `on_cancel` must not take locks its
//   caller might hold: hand work to another thread. Once Python answers, it is dropped (a
//   cancellation racing with the answer may still call it once).
// - Every call is finished exactly once (gRPC requires it): by Python, or with CANCELLED here.
// - Server.shutdown(grace) stops accepting calls, cancels those still open after `grace`
//   seconds, and returns once every call is done.

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <deque>
#include <memory>
#include <mutex>
#include <string>

namespace py = pybind11;

namespace {

class CallReactor;

// The GIL, taken from one of gRPC's threads. Those are not Python threads, and pybind11 would
// create and destroy a Python thread state on every acquire (most of the Python-side cost of a
// request); each thread keeps its first one instead. The server is shut down before the
// interpreter finalizes (RpcServer does so at exit), so no gRPC thread uses a stale one.
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

// A slow reader must not make the server buffer without bound: writes beyond this fail.
constexpr size_t kMaxQueuedWrites = 1024;

// State shared by the gRPC reactor (until gRPC is done with the call) and by Python's handle on
// the call (for as long as Python keeps it). `onCancel_` is the one Python object: it is only
// touched with the GIL held, and is empty by the time the reactor lets go (OnDone), so the state
// may die on any thread.
class CallState {
 public:
  CallState(CallReactor* reactor, std::string method,
            std::chrono::system_clock::time_point deadline)
      : reactor_(reactor), method_(std::move(method)), deadline_(deadline) {}

  const std::string& method() const { return method_; }

  // Seconds until the caller's deadline (huge when it set none; negative once passed).
  double timeRemaining() const {
    return std::chrono::duration<double>(deadline_ - std::chrono::system_clock::now()).count();
  }

  bool isActive() {
    std::lock_guard<std::mutex> g(mu_);
    return !cancelled_ && !finishRequested_;
  }

  // Queues one message of a streaming answer. False if the call is over or too far behind.
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
  py::object peekOnCancel() const { return onCancel_ ? onCancel_ : py::object(py::none()); }
  bool hasOnCancel() const { return hasOnCancel_; }

  // Reactor events. onCancel returns whether Python has an on_cancel to be told.
  void onWriteDone(bool ok);
  bool onCancel();
  void onDone();

 private:
  // Starts the next gRPC operation; called with mu_ held, releases it before calling gRPC (which
  // may run reactions inline in this thread).
  void pump(std::unique_lock<std::mutex>& lock);
  // The call can no longer be written to; finish it (CANCELLED, `why`) unless Python did.
  void markCancelledLocked(const char* why);

  std::mutex mu_;
  CallReactor* reactor_;  // valid until onDone
  const std::string method_;
  const std::chrono::system_clock::time_point deadline_;
  std::deque<grpc::ByteBuffer> queued_;
  grpc::ByteBuffer inFlight_;  // the message gRPC is writing; untouched while writing_
  bool writing_ = false;
  bool finishRequested_ = false;
  bool finishStarted_ = false;
  bool cancelled_ = false;
  grpc::Status finalStatus_;
  py::object onCancel_;
  std::atomic<bool> hasOnCancel_{false};
};

class Server;

// One call's reactor: reads the request, hands it to Python, relays writes and the finish.
class CallReactor : public grpc::ServerGenericBidiReactor {
 public:
  CallReactor(grpc::GenericCallbackServerContext* ctx, Server* server);
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override { state_->onWriteDone(ok); }
  void OnCancel() override;
  void OnDone() override;

 private:
  Server* server_;
  grpc::ByteBuffer request_;
  std::shared_ptr<CallState> state_;
};

class Service : public grpc::CallbackGenericService {
 public:
  explicit Service(Server* server) : server_(server) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    return new CallReactor(ctx, server_);
  }

 private:
  Server* server_;
};

class Server {
 public:
  Server(const std::string& address, py::function handler, int maxMessageBytes, int keepaliveMs)
      : handler_(std::move(handler)), service_(this) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port_);
    builder.RegisterCallbackGenericService(&service_);
    builder.SetMaxReceiveMessageSize(maxMessageBytes);
    builder.SetMaxSendMessageSize(maxMessageBytes);
    builder.AddChannelArgument("grpc.so_reuseport", 0);
    // Accept clients' keepalive pings every few seconds (ft's clients ping every 5 s so that a
    // partition ends their calls); the default policy answers them with GOAWAY.
    builder.AddChannelArgument("grpc.keepalive_permit_without_calls", 1);
    builder.AddChannelArgument("grpc.http2.min_recv_ping_interval_without_data_ms", 2500);
    builder.AddChannelArgument("grpc.http2.max_ping_strikes", 0);
    if (keepaliveMs > 0) {
      // Ping idle connections, so that the call of a peer that stopped answering ends.
      builder.AddChannelArgument("grpc.keepalive_time_ms", keepaliveMs);
      builder.AddChannelArgument("grpc.keepalive_timeout_ms", keepaliveMs);
    }
    {
      py::gil_scoped_release nogil;
      server_ = builder.BuildAndStart();
    }
    if (!server_ || port_ == 0) {
      throw std::runtime_error("gRPC server could not bind " + address);
    }
  }

  ~Server() { shutdown(0.0); }

  int port() const { return port_; }

  // GIL held on entry. A second caller returns at once (the first one is shutting down).
  void shutdown(double graceSeconds) {
    std::unique_ptr<grpc::Server> server = std::move(server_);
    if (!server) return;
    if (!(graceSeconds > 0)) graceSeconds = 0;  // NaN and negatives
    graceSeconds = std::min(graceSeconds, 3600.0);
    {
      py::gil_scoped_release nogil;  // reactions still running need the GIL to finish
      auto deadline = std::chrono::system_clock::now() +
                      std::chrono::microseconds(static_cast<int64_t>(graceSeconds * 1e6));
      server->Shutdown(deadline);  // returns once every call's OnDone has run
      server.reset();
    }
    // The handler refers back to the Python server object: drop it to break the cycle.
    handler_ = py::function();
  }

  const py::function& handler() const { return handler_; }

 private:
  py::function handler_;
  Service service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// --- CallState ---------------------------------------------------------------------------

bool CallState::write(grpc::ByteBuffer msg) {
  std::unique_lock<std::mutex> lock(mu_);
  if (finishRequested_ || cancelled_ || queued_.size() >= kMaxQueuedWrites) return false;
  queued_.push_back(std::move(msg));
  pump(lock);
  return true;
}

bool CallState::reply(grpc::ByteBuffer msg) {
  std::unique_lock<std::mutex> lock(mu_);
  if (finishRequested_ || cancelled_) return false;
  queued_.push_back(std::move(msg));
  finishRequested_ = true;
  finalStatus_ = grpc::Status::OK;
  pump(lock);
  return true;
}

bool CallState::finish(grpc::Status status) {
  std::unique_lock<std::mutex> lock(mu_);
  if (finishRequested_) return false;
  finishRequested_ = true;
  finalStatus_ = std::move(status);
  if (cancelled_) queued_.clear();
  pump(lock);
  return true;
}

void CallState::pump(std::unique_lock<std::mutex>& lock) {
  if (writing_ || finishStarted_ || reactor_ == nullptr) return;
  if (!queued_.empty()) {
    inFlight_ = std::move(queued_.front());
    queued_.pop_front();
    CallReactor* r = reactor_;
    if (finishRequested_ && queued_.empty()) {
      // The last message and the status in one operation (one round of gRPC work, not two).
      finishStarted_ = true;
      grpc::Status status = finalStatus_;
      lock.unlock();
      r->StartWriteAndFinish(&inFlight_, grpc::WriteOptions(), status);
      return;
    }
    writing_ = true;
    lock.unlock();
    r->StartWrite(&inFlight_);
    return;
  }
  if (finishRequested_) {
    finishStarted_ = true;
    CallReactor* r = reactor_;
    grpc::Status status = finalStatus_;
    lock.unlock();
    r->Finish(status);
  }
}

void CallState::setOnCancel(py::object cb) {
  // GIL held. Stored and flagged under mu_, where onCancel() reads the flag: either the
  // cancellation sees the callback, or this sees the cancellation and calls it now.
  if (cb.is_none()) cb = py::object();
  py::object previous;
  bool callNow = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (cancelled_) {
      callNow = static_cast<bool>(cb);  // too late to store: the notice already went out
    } else if (!finishRequested_) {
      previous = std::move(onCancel_);
      onCancel_ = std::move(cb);
      hasOnCancel_ = static_cast<bool>(onCancel_);
    }  // else answered: it can no longer be cancelled unanswered
  }
  if (callNow) cb();
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
    // The stream broke: nothing more can be written; the call still has to be finished.
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
  reactor_ = nullptr;
  cancelled_ = cancelled_ || !finishRequested_;
}

// --- CallReactor -------------------------------------------------------------------------

CallReactor::CallReactor(grpc::GenericCallbackServerContext* ctx, Server* server)
    : server_(server),
      state_(std::make_shared<CallState>(this, ctx->method(), ctx->deadline())) {
  StartRead(&request_);
}

void CallReactor::OnReadDone(bool ok) {
  if (!ok) {
    state_->finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request message"));
    return;
  }
  std::vector<grpc::Slice> slices;
  if (!request_.Dump(&slices).ok()) {
    state_->finish(grpc::Status(grpc::StatusCode::INTERNAL, "could not read the request"));
    return;
  }
  std::string error;
  {
    GrpcThreadGil gil;
    try {
      size_t size = 0;
      for (const auto& s : slices) size += s.size();
      PyObject* raw = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(size));
      if (raw == nullptr) throw py::error_already_set();
      char* out = PyBytes_AS_STRING(raw);
      for (const auto& s : slices) {
        std::memcpy(out, s.begin(), s.size());
        out += s.size();
      }
      auto data = py::reinterpret_steal<py::bytes>(raw);
      server_->handler()(py::cast(state_), data);
    } catch (py::error_already_set& e) {
      error = e.what();
    } catch (const std::exception& e) {  // e.g. bad_alloc: never let it escape into gRPC
      error = e.what();
    }
  }
  request_.Clear();
  if (!error.empty()) {
    state_->finish(grpc::Status(grpc::StatusCode::INTERNAL, "handler failed: " + error));
  }
}

void CallReactor::OnCancel() {
  if (!state_->onCancel()) return;
  GrpcThreadGil gil;
  py::object cb = state_->takeOnCancel();
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

void CallReactor::OnDone() {
  state_->onDone();
  if (state_->hasOnCancel()) {
    // Finished by this file, not by Python (e.g. the handler raised): drop it with the GIL.
    GrpcThreadGil gil;
    state_->takeOnCancel();
  }
  delete this;
}

grpc::ByteBuffer toByteBuffer(const py::bytes& data) {
  char* buf = nullptr;
  Py_ssize_t len = 0;
  PyBytes_AsStringAndSize(data.ptr(), &buf, &len);
  grpc::Slice slice(buf, static_cast<size_t>(len));
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace

PYBIND11_MODULE(_grpc_server, m) {
  m.doc() = "A generic gRPC server (C++ callback API) whose calls Python answers; see "
            "ft.coordination.transport.";

  py::class_<CallState, std::shared_ptr<CallState>>(m, "Call")
      .def_property_readonly("method", &CallState::method)
      .def_property(
          "on_cancel",
          [](CallState& c) { return c.peekOnCancel(); },
          &CallState::setOnCancel)
      .def("time_remaining", &CallState::timeRemaining)
      .def("is_active", &CallState::isActive)
      .def("write", [](CallState& c, const py::bytes& data) { return c.write(toByteBuffer(data)); })
      .def("reply",
           [](CallState& c, const py::bytes& data) {
             bool ok = c.reply(toByteBuffer(data));
             c.takeOnCancel();  // answered: it will not be cancelled unanswered
             return ok;
           })
      .def(
          "finish",
          [](CallState& c, int code, const std::string& details) {
            bool ok = c.finish(grpc::Status(static_cast<grpc::StatusCode>(code), details));
            c.takeOnCancel();
            return ok;
          },
          py::arg("code") = 0, py::arg("details") = "");

  py::class_<Server>(m, "Server")
      .def(py::init<const std::string&, py::function, int, int>(), py::arg("address"),
           py::arg("handler"), py::arg("max_message_bytes"), py::arg("keepalive_ms") = 0)
      .def_property_readonly("port", &Server::port)
      .def("shutdown", &Server::shutdown, py::arg("grace") = 0.0);
}
