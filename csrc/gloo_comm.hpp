// CPU transport: inner Gloo communicators, one per lane, and the sockets they
// own (a Transport, see transport.hpp).
//
// torch ships no Gloo headers, so the inner ProcessGroupGloo is built through
// torch's own Python binding; bindings.cpp installs that constructor as the
// GlooFactory (the only place that touches Python).
//
// Gloo has no abort: a stuck op lives until Gloo's own timeout, and when a
// stopped peer resumes, its data would still land in the caller's tensor.
// So we note the sockets a generation's construction opened and, on abort,
// shut them down. The stuck op then fails at once (like a dead peer) and no
// more bytes can arrive for it.
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

using GlooFactory = std::function<c10::intrusive_ptr<c10d::Backend>(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout)>;

void setGlooFactory(GlooFactory factory);

// The connected sockets of a generation's Gloo pairs, identified by (fd,
// inode) so a descriptor number reused later by someone else is never touched.
//
// Other threads open sockets while a generation is being built (the TCPStore
// server accepting a peer, gRPC), so "sockets that appeared meanwhile" is not
// enough. Each Gloo communicator creates its own epoll instance and registers
// its pairs there; /proc/self/fdinfo of an epoll fd created during the build
// lists exactly those sockets.
class OwnedSockets {
 public:
  struct Socket {
    int fd;
    unsigned long inode;
  };
  struct FdTable {
    std::vector<Socket> sockets;
    std::vector<int> epolls;
  };

  static FdTable snapshot();
  // The sockets registered in epoll instances that `after` has and `before`
  // had not.
  static OwnedSockets fromNewEpolls(
      const FdTable& before,
      const FdTable& after);

  // shutdown(SHUT_RDWR) on every connected socket that is still the one we
  // recorded. Safe to call more than once, from any thread.
  void sever() const;
  size_t size() const {
    return sockets_.size();
  }

 private:
  std::vector<Socket> sockets_;
};

// The Gloo transport: `numLanes` Gloo communicators under per-lane store
// prefixes ("lane<k>/"), and the sockets they opened, severed on abort.
// Blocks until every peer has connected or `timeout` passes (then throws).
std::shared_ptr<Transport> connectGloo(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    int numLanes,
    std::chrono::milliseconds timeout);

} // namespace ft
