#include "process_memory.hpp"

#include <cerrno>

#if defined(__linux__)
#include <sys/prctl.h>
#include <sys/uio.h>
#endif

namespace ft {

int readProcessMemory(pid_t pid, uint64_t remoteAddress, void* dst, size_t size) {
#if defined(__linux__)
  auto* out = static_cast<char*>(dst);
  size_t done = 0;
  while (done < size) {
    // One call moves at most MAX_RW_COUNT (~2 GiB) and stops early at an unmapped page:
    // loop so that large tensors and partial reads both finish or fail with a reason.
    struct iovec local {
      out + done, size - done
    };
    struct iovec remote {
      reinterpret_cast<void*>(static_cast<uintptr_t>(remoteAddress + done)), size - done
    };
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
