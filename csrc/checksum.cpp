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

// ---------------------------------------------------------------------------------------------
// Hardware path. The CRC instruction has a latency of ~3 cycles and a
// throughput of one per cycle, so one dependency chain runs at a third of what
// the unit can do (~8 GB/s here). The buffer is therefore cut into blocks of
// three streams of kStream bytes, checksummed as three independent chains in
// one loop, and the three results are combined: the CRC register is linear over
// GF(2), so crc(A || B) = shift(crc(A), |B|) ^ crc0(B), where shift() advances
// a register over |B| zero bytes and crc0 starts from a zero register. shift()
// over a fixed kStream is itself linear in the register: four table lookups.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FT_HW_CRC 1
#if defined(__clang__)
#pragma clang attribute push(          \
    __attribute__((target("sse4.2"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("sse4.2")
#endif
inline uint32_t hwStep8(uint32_t c, uint64_t word) {
  return static_cast<uint32_t>(_mm_crc32_u64(c, word));
}
inline uint32_t hwStep1(uint32_t c, uint8_t byte) {
  return _mm_crc32_u8(c, byte);
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#define FT_HW_CRC 1
inline uint32_t hwStep8(uint32_t c, uint64_t word) {
  return __builtin_aarch64_crc32cx(c, word);
}
inline uint32_t hwStep1(uint32_t c, uint8_t byte) {
  return __builtin_aarch64_crc32cb(c, byte);
}
#endif

#if defined(FT_HW_CRC)
constexpr size_t kStream = 4096; // bytes per stream; a block is 3 * kStream

inline uint64_t load8(const uint8_t* p) {
  uint64_t word;
  std::memcpy(&word, p, 8);
  return word;
}

uint32_t hwLinear(const uint8_t* p, size_t n, uint32_t c) {
  for (; n >= 8; n -= 8, p += 8) {
    c = hwStep8(c, load8(p));
  }
  while (n--) {
    c = hwStep1(c, *p++);
  }
  return c;
}

// shift(c) over kStream zero bytes, as tables[k][byte k of c] XORed over the
// four bytes.
struct ShiftTables {
  uint32_t t[4][256];
  ShiftTables() {
    uint32_t basis[32];
    for (int bit = 0; bit < 32; ++bit) {
      uint32_t c = 1u << bit;
      for (size_t i = 0; i < kStream / 8; ++i) {
        c = hwStep8(c, 0);
      }
      basis[bit] = c;
    }
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) {
        uint32_t v = 0;
        for (int j = 0; j < 8; ++j) {
          if (b & (1u << j)) {
            v ^= basis[8 * k + j];
          }
        }
        t[k][b] = v;
      }
    }
  }
  uint32_t shift(uint32_t c) const {
    return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^
        t[3][c >> 24];
  }
};

uint32_t hardwareCrc(const uint8_t* p, size_t n, uint32_t c) {
  if (n >= 3 * kStream) {
    static const ShiftTables tables; // thread-safe static init
    for (; n >= 3 * kStream; n -= 3 * kStream, p += 3 * kStream) {
      uint32_t a = c, b = 0, d = 0;
      for (size_t i = 0; i < kStream; i += 8) {
        a = hwStep8(a, load8(p + i));
        b = hwStep8(b, load8(p + kStream + i));
        d = hwStep8(d, load8(p + 2 * kStream + i));
      }
      c = tables.shift(tables.shift(a) ^ b) ^ d;
    }
  }
  return hwLinear(p, n, c);
}

#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

// Outside the sse4.2 region: this runs before anyone knows the instruction
// exists.
bool haveHardwareCrc() {
#if defined(__x86_64__)
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
#else
  return true;
#endif
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
