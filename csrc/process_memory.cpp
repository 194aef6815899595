#include "process_memory.hpp"

#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>

#include "checksum.hpp"

#if defined(__linux__)
#include <sys/prctl.h>
#include <sys/uio.h>
#endif

namespace ft {

int readProcessMemory(
    pid_t pid,
    uint64_t remoteAddress,
    void* dst,
    size_t size) {
#if defined(__linux__)
  auto* out = static_cast<char*>(dst);
  size_t done = 0;
  while (done < size) {
    // One call moves at most MAX_RW_COUNT (~2 GiB) and stops early at an
    // unmapped page: loop so that large tensors and partial reads both finish
    // or fail with a reason.
    struct iovec local{out + done, size - done};
    struct iovec remote{
        reinterpret_cast<void*>(static_cast<uintptr_t>(remoteAddress + done)),
        size - done};
    ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      return errno;
    }
    if (n == 0) {
      return EFAULT;
    }
    done += static_cast<size_t>(n);
  }
  return 0;
#else
  (void)pid;
  (void)remoteAddress;
  (void)dst;
  (void)size;
  return ENOSYS;
#endif
}

int copyAndChecksum(
    pid_t pid,
    const std::vector<std::vector<RemotePiece>>& ranges,
    std::vector<uint32_t>& crcs) {
  std::mutex mu;
  std::condition_variable copiedCv;
  size_t copied = 0; // ranges fully copied, guarded by mu
  bool copyEnded =
      false; // no more ranges will be copied (done or failed), guarded by mu
  std::vector<uint32_t> rangeCrcs(ranges.size(), 0);
  auto checksumRange = [&](size_t k) {
    uint32_t crc = 0;
    for (const auto& piece : ranges[k]) {
      crc = crc32c(piece.dst, piece.size, crc);
    }
    rangeCrcs[k] = crc;
  };
  // A single range gains nothing from a second thread; without a thread to
  // spare (EAGAIN under a thread limit) this one checksums each range after
  // copying it.
  bool pipelined = ranges.size() > 1;
  std::thread checksummer;
  if (pipelined) {
    try {
      checksummer = std::thread([&] {
        for (size_t k = 0;; ++k) {
          {
            std::unique_lock<std::mutex> lock(mu);
            copiedCv.wait(lock, [&] { return copied > k || copyEnded; });
            if (copied <= k) {
              return; // range k was never completed
            }
          }
          checksumRange(k);
        }
      });
    } catch (const std::system_error&) {
      pipelined = false;
    }
  }
  int err = 0;
  size_t done = 0;
  for (; done < ranges.size(); ++done) {
    for (const auto& piece : ranges[done]) {
      err = readProcessMemory(pid, piece.remoteAddress, piece.dst, piece.size);
      if (err != 0) {
        break;
      }
    }
    if (err != 0) {
      break;
    }
    if (pipelined) {
      std::lock_guard<std::mutex> lock(mu);
      copied = done + 1;
      copiedCv.notify_one();
    } else {
      checksumRange(done);
    }
  }
  if (pipelined) {
    {
      std::lock_guard<std::mutex> lock(mu);
      copyEnded = true;
      copiedCv.notify_one();
    }
    checksummer.join();
  }
  crcs.insert(crcs.end(), rangeCrcs.begin(), rangeCrcs.begin() + done);
  return err;
}

int allowProcessToRead(pid_t pid) {
#if defined(__linux__) && defined(PR_SET_PTRACER)
  if (prctl(PR_SET_PTRACER, static_cast<unsigned long>(pid), 0, 0, 0) != 0) {
    return errno;
  }
  return 0;
#else
  (void)pid;
  return ENOSYS;
#endif
}

} // namespace ft
