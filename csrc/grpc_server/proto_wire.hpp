// The protobuf wire format, the little of it that the native lighthouse paths
// need (steady_quorum.hpp, quorum_wire.cpp): varints, tags, length-delimited
// fields, skipping a field. Each reader returns false on malformed input and
// never reads past the end; each is at least as strict as protobuf's parser,
// so that what these take, protobuf takes too (the callers leave the rest to
// protobuf, which says what is wrong).
#pragma once

#include <climits>
#include <cstdint>
#include <string>
#include <string_view>

namespace ft_wire {

// A varint of at most `maxBytes` bytes (10 for a 64-bit value, whose 10th byte
// may only be 0 or 1: anything else is a value protobuf does not take).
inline bool
readVarint(std::string_view b, size_t* i, uint64_t* out, int maxBytes = 10) {
  uint64_t v = 0;
  for (int n = 0; n < maxBytes; ++n) {
    if (*i >= b.size())
      return false;
    const uint8_t c = static_cast<uint8_t>(b[(*i)++]);
    if (n == 9 && c > 1)
      return false;
    v |= static_cast<uint64_t>(c & 0x7F) << (7 * n);
    if ((c & 0x80) == 0) {
      *out = v;
      return true;
    }
  }
  return false; // longer than maxBytes
}

// A field's tag: a varint of at most 5 bytes whose field number is a valid one
// (1 .. 2^29-1), as protobuf requires.
inline bool readTag(std::string_view b, size_t* i, uint64_t* tag) {
  if (!readVarint(b, i, tag, 5) || *tag > UINT32_MAX)
    return false;
  const uint64_t field = *tag >> 3;
  return field >= 1 && field < (1u << 29);
}

// A length-delimited field's length: a varint of at most 5 bytes, below 2 GiB
// (protobuf's limit), that fits in what is left of `b`.
inline bool readLength(std::string_view b, size_t* i, uint64_t* len) {
  return readVarint(b, i, len, 5) && *len <= INT32_MAX && *len <= b.size() - *i;
}

inline void appendVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// Wire types.
constexpr uint32_t kVarint = 0;
constexpr uint32_t kBytes = 2;

inline void appendVarintField(std::string* out, int field, uint64_t v) {
  appendVarint(out, (static_cast<uint64_t>(field) << 3) | kVarint);
  appendVarint(out, v);
}

inline void appendBytesField(std::string* out, int field, std::string_view v) {
  appendVarint(out, (static_cast<uint64_t>(field) << 3) | kBytes);
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
      if (!readLength(b, i, &v))
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

// One field at b[*i]: its number, wire type, and for kVarint its value, for
// kBytes its contents (other wire types are skipped). False when malformed.
inline bool readField(
    std::string_view b,
    size_t* i,
    uint64_t* field,
    uint32_t* wt,
    uint64_t* value,
    std::string_view* bytes) {
  uint64_t tag = 0;
  if (!readTag(b, i, &tag))
    return false; // protobuf refuses it
  *field = tag >> 3;
  *wt = static_cast<uint32_t>(tag & 7);
  if (*wt == kVarint)
    return readVarint(b, i, value);
  if (*wt == kBytes) {
    uint64_t n = 0;
    if (!readLength(b, i, &n))
      return false;
    *bytes = b.substr(*i, static_cast<size_t>(n));
    *i += static_cast<size_t>(n);
    return true;
  }
  return skipValue(b, i, *wt);
}

// Whether protobuf would accept `s` as a string field (valid UTF-8; no
// overlong forms, no surrogates, nothing past U+10FFFF).
inline bool validUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const uint8_t c = static_cast<uint8_t>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size())
      return false;
    for (size_t k = 1; k <= n; ++k) {
      const uint8_t cc = static_cast<uint8_t>(s[i + k]);
      if ((cc & 0xC0) != 0x80)
        return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) ||
        (n == 3 && cp < 0x10000) || (cp >= 0xD800 && cp <= 0xDFFF) ||
        cp > 0x10FFFF)
      return false;
    i += n + 1;
  }
  return true;
}

} // namespace ft_wire
