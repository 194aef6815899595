// CPU transport: inner Gloo communicators, one per lane, and the sockets they
// own (a Transport, see transport.hpp).
//
// torch ships no Gloo headers, so the inner ProcessGroupGloo is built through
// torch's own Python binding; bindings.cpp installs that constructor as the
// GlooFactory (the only place that touches Python).
//
// Gloo has no abort: a stuck op lives until Gloo's own timeout, and when a
// stopped peer resumes, its data would still land in the caller's tensor.
// So, on abort, we shut down the sockets of the generation's Gloo pairs. The
// stuck op then fails at once (like a dead peer) and no more bytes can arrive
// for it. Those sockets, and only those, are the ones registered in the epoll
// instances of the lanes' own Gloo devices: other groups, or other ranks of
// this one, may live in the same process, and cutting their sockets would
// break their ops.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "transport.hpp"

namespace ft {

// One lane's inner communicator, and the epoll instances of the Gloo devices
// it was built with (each device registers its listener and its pairs'
// sockets in its own epoll instance). The factory tells them apart from any
// other epoll instance of the process (ft.process_group._gloo_devices).
struct GlooLane {
  c10::intrusive_ptr<c10d::Backend> backend;
  std::vector<int> epolls;
};

using GlooFactory = std::function<GlooLane(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout)>;

void setGlooFactory(GlooFactory factory);

// The connected sockets of a generation's Gloo pairs: those registered in its
// lanes' epoll instances (read from /proc/self/fdinfo when asked, so a pair
// that connects lazily, after configure(), is included), each identified by
// (fd, inode) so a descriptor number reused by someone else is never touched.
//
// The epoll descriptors stay valid as long as the lanes' Gloo devices live,
// that is, as long as the transport that holds this.
class OwnedSockets {
 public:
  struct Socket {
    int fd;
    unsigned long inode;
  };

  OwnedSockets() = default;
  explicit OwnedSockets(std::vector<int> epolls) : epolls_(std::move(epolls)) {}

  // The sockets registered in the epoll instances now (listeners included).
  std::vector<Socket> registered() const;

  // shutdown(SHUT_RDWR) on every connected socket registered now. Safe to
  // call more than once, from any thread.
  void sever() const;
  size_t size() const {
    return registered().size();
  }

 private:
  std::vector<int> epolls_;
};

// The Gloo transport: `spec.numLanes` Gloo communicators under per-lane store
// prefixes ("lane<k>/"), and the sockets they opened, severed on abort.
// Blocks until every peer has connected or `spec.timeout` passes (then
// throws).
std::shared_ptr<Transport> connectGloo(const TransportSpec& spec);

} // namespace ft
