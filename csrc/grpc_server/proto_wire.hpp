// The protobuf wire format, the little of it that the native lighthouse paths
// need (steady_quorum.hpp, quorum_wire.cpp): varints, length-delimited
// fields, skipping a field. Each reader returns false on malformed input and
// never reads past the end.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ft_wire {

inline bool readVarint(std::string_view b, size_t* i, uint64_t* out) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (*i >= b.size())
      return false;
    const uint8_t c = static_cast<uint8_t>(b[(*i)++]);
    v |= static_cast<uint64_t>(c & 0x7F) << shift;
    if ((c & 0x80) == 0) {
      *out = v;
      return true;
    }
  }
  return false; // longer than 10 bytes
}

inline void appendVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

inline void
appendBytesField(std::string* out, int field, const std::string& v) {
  appendVarint(out, (static_cast<uint64_t>(field) << 3) | 2);
  appendVarint(out, v.size());
  out->append(v);
}

// Skips one field's value of wire type `wt` at `*i`. False: malformed, or a
// group (deprecated; nothing in proto/torchft.proto uses one).
inline bool skipValue(std::string_view b, size_t* i, uint32_t wt) {
  uint64_t v = 0;
  switch (wt) {
    case 0:
      return readVarint(b, i, &v);
    case 1:
      if (b.size() - *i < 8)
        return false;
      *i += 8;
      return true;
    case 2:
      if (!readVarint(b, i, &v) || v > b.size() - *i)
        return false;
      *i += v;
      return true;
    case 5:
      if (b.size() - *i < 4)
        return false;
      *i += 4;
      return true;
    default:
      return false;
  }
}

} // namespace ft_wire
