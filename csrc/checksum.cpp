#include "checksum.hpp"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace ft {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u; // CRC-32C, reflected

std::array<uint32_t, 256> makeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) {
      c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    }
    t[i] = c;
  }
  return t;
}

uint32_t softwareCrc(const uint8_t* p, size_t n, uint32_t c) {
  static const std::array<uint32_t, 256> table = makeTable();
  while (n--) {
    c = table[(c ^ *p++) & 0xFF] ^ (c >> 8);
  }
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t hardwareCrc(
    const uint8_t* p,
    size_t n,
    uint32_t c) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c64 = _mm_crc32_u64(c64, word);
    p += 8;
    n -= 8;
  }
  c = static_cast<uint32_t>(c64);
  while (n--) {
    c = _mm_crc32_u8(c, *p++);
  }
  return c;
}

bool haveHardwareCrc() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
uint32_t hardwareCrc(const uint8_t* p, size_t n, uint32_t c) {
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_aarch64_crc32cx(c, word);
    p += 8;
    n -= 8;
  }
  while (n--) {
    c = __builtin_aarch64_crc32cb(c, *p++);
  }
  return c;
}

bool haveHardwareCrc() {
  return true;
}
#else
uint32_t hardwareCrc(const uint8_t* p, size_t n, uint32_t c) {
  return softwareCrc(p, n, c);
}

bool haveHardwareCrc() {
  return false;
}
#endif

} // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  c = haveHardwareCrc() ? hardwareCrc(p, size, c) : softwareCrc(p, size, c);
  return ~c;
}

} // namespace ft
