#pragma once
// Reading another process's memory, for same-host checkpoint transfers.
//
// Why: a replica that restarts on the same host as its healing source would
// otherwise pull the state through loopback TCP, which costs two kernel copies
// plus the socket machinery (about 5x a memcpy on the development machine).
// process_vm_readv copies straight from the source's tensors into the
// receiver's, once. The kernel checks permission (same user, ptrace access
// mode), so this is no wider than what that user could already do; callers fall
// back to the socket path on any error. Thread-safe, no state; callers release
// the GIL around it.
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ft {

// Copies `size` bytes at `remoteAddress` in process `pid` to `dst`. Returns 0,
// or the errno of the first failure (EPERM/EACCES: not permitted; ESRCH: no
// such process; EFAULT: the range is not mapped there; ENOSYS: not supported).
// A short read that makes no progress counts as EFAULT.
int readProcessMemory(
    pid_t pid,
    uint64_t remoteAddress,
    void* dst,
    size_t size);

// One contiguous piece of a range: `size` bytes at `remoteAddress` in the
// source go to `dst`.
struct RemotePiece {
  uint64_t remoteAddress;
  void* dst;
  size_t size;
};

// Copies every range's pieces out of process `pid` and appends to `crcs` the
// CRC-32C of each range that was copied completely, in order. Returns 0, or the
// errno of the first failure (the failed range is the one after the last CRC).
// The checksum of range k runs on a second thread while range k+1 is copied, so
// the kernel copy (the slow part: it pins the source's pages one by one) is the
// only cost on the critical path.
int copyAndChecksum(
    pid_t pid,
    const std::vector<std::vector<RemotePiece>>& ranges,
    std::vector<uint32_t>& crcs);

// Lets process `pid` (0: nobody again) read this process with readProcessMemory
// where Yama's ptrace_scope is 1 (Ubuntu's default), which otherwise allows it
// only to ancestors. Returns 0, or the errno (EINVAL: no Yama here, nothing to
// do). One pid at a time per process.
int allowProcessToRead(pid_t pid);

} // namespace ft
