#include "gloo_comm.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>

namespace ft {

namespace {
std::mutex factoryMutex;
GlooFactory glooFactory;
} // namespace

void setGlooFactory(GlooFactory factory) {
  std::lock_guard<std::mutex> lock(factoryMutex);
  glooFactory = std::move(factory);
}

std::vector<OwnedSockets::Socket> OwnedSockets::registered() const {
  std::vector<Socket> out;
  for (int epoll : epolls_) {
    std::ifstream info("/proc/self/fdinfo/" + std::to_string(epoll));
    std::string line;
    while (std::getline(info, line)) {
      // "tfd:       20 events:       19 data: ... ino:3db9 sdev:9"
      int fd = -1;
      if (std::sscanf(line.c_str(), "tfd: %d", &fd) != 1) {
        continue;
      }
      auto pos = line.find(" ino:");
      if (pos == std::string::npos) {
        continue;
      }
      const unsigned long inode =
          std::strtoul(line.c_str() + pos + 5, nullptr, 16);
      struct stat st{};
      if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode) ||
          static_cast<unsigned long>(st.st_ino) != inode) {
        continue; // not a socket (Gloo's wakeup fd), or closed meanwhile
      }
      out.push_back({fd, inode});
    }
  }
  return out;
}

void OwnedSockets::sever() const {
  std::vector<Socket> sockets;
  try {
    sockets = registered();
  } catch (...) {
    return; // out of memory reading /proc: nothing we can cut
  }
  for (const auto& s : sockets) {
    struct stat st{};
    if (fstat(s.fd, &st) != 0 || !S_ISSOCK(st.st_mode) ||
        static_cast<unsigned long>(st.st_ino) != s.inode) {
      continue; // closed, or the number now belongs to someone else
    }
    // Leave listening sockets alone: Gloo's listener treats a failed accept()
    // as fatal (it terminates the process). Connected pairs are what carry
    // data into the caller's tensors.
    int listening = 0;
    socklen_t len = sizeof(listening);
    if (getsockopt(s.fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0 &&
        listening) {
      continue;
    }
    ::shutdown(s.fd, SHUT_RDWR);
  }
}

namespace {

class GlooTransport final : public Transport {
 public:
  GlooTransport(
      std::vector<c10::intrusive_ptr<c10d::Backend>> lanes,
      OwnedSockets sockets)
      : lanes_(std::move(lanes)), sockets_(std::move(sockets)) {}

  const char* name() const override {
    return "Gloo";
  }
  bool serves(const c10::Device& device) const override {
    return device.is_cpu();
  }
  void connect(int /*device*/, Clock::time_point /*deadline*/) override {
    // Every lane connected when the transport was built.
  }
  // The deadline is the watchdog's to enforce: Gloo's own timeout is only a
  // backstop past it (see makeGloo in bindings.cpp).
  c10::intrusive_ptr<c10d::Work>
  run(int lane, const Issue& issue, Clock::time_point /*deadline*/) override {
    return issue(*lanes_.at(lane));
  }
  // Gloo refuses a bad op synchronously, before anything is sent; its
  // communication failures arrive through the op's Work.
  bool failedBy(const std::exception_ptr& /*error*/) const override {
    return false;
  }
  // Gloo has no abort: severing the sockets is all of it. A stuck op then
  // fails at once, and nothing more can arrive for a caller's tensor.
  void sever() noexcept override {
    sockets_.sever();
  }
  bool closeIfIdle() noexcept override {
    return true;
  }
  void abort() noexcept override {}
  size_t socketCount() const override {
    return sockets_.size();
  }

 private:
  const std::vector<c10::intrusive_ptr<c10d::Backend>> lanes_;
  const OwnedSockets sockets_;
};

} // namespace

std::shared_ptr<Transport> connectGloo(const TransportSpec& spec) {
  GlooFactory factory;
  {
    std::lock_guard<std::mutex> lock(factoryMutex);
    factory = glooFactory;
  }
  TORCH_CHECK(factory, "ft: no Gloo factory installed (import ft first)");
  std::vector<c10::intrusive_ptr<c10d::Backend>> lanes;
  std::vector<int> epolls;
  lanes.reserve(spec.numLanes);
  for (int i = 0; i < spec.numLanes; ++i) {
    auto laneStore = c10::make_intrusive<c10d::PrefixStore>(
        "lane" + std::to_string(i),
        spec.store);
    auto lane = factory(laneStore, spec.rank, spec.size, spec.timeout);
    TORCH_CHECK(lane.backend, "ft: the Gloo factory returned no backend");
    lanes.push_back(std::move(lane.backend));
    epolls.insert(epolls.end(), lane.epolls.begin(), lane.epolls.end());
  }
  OwnedSockets sockets(std::move(epolls));
  // Gloo's full-mesh connect can return on one rank while its peer is still
  // finishing the handshake. Wait until every rank is done, so that a quick
  // reconfigure (which severs this generation's sockets) cannot break a peer
  // that is still connecting.
  if (spec.store->add("ft_connected", 1) == spec.size) {
    spec.store->set("ft_all_connected", std::vector<uint8_t>{1});
  }
  spec.store->wait({"ft_all_connected"}, spec.timeout);
  return std::make_shared<GlooTransport>(std::move(lanes), std::move(sockets));
}

} // namespace ft
