#pragma once
// CRC-32C (Castagnoli) of checkpoint bytes.
//
// Why not zlib's CRC-32: on these machines zlib.crc32 runs at 1-2 GB/s, as slow
// as the memory copy it protects, and a heal checksums every byte twice (sender
// and receiver). CRC-32C has a CPU instruction (SSE4.2 on x86-64, the CRC
// extension on AArch64): ~8 GB/s here, so the check no longer decides transfer
// speed, on loopback or on a 100 Gb/s NIC. Thread-safe, no state; callers
// release the GIL around it.
#include <cstddef>
#include <cstdint>

namespace ft {

// Extends `crc` (0 to start) over `size` bytes at `data`. crc32c("123456789")
// == 0xE3069283.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

} // namespace ft
