// The messages of a call stream (proto/torchft.proto: CallStreamRequest,
// CallStreamResponse; LighthouseService.QuorumStream): unary calls carried as
// messages of one long-lived call, one at a time. Shared by the native server
// (grpc_server.cpp: CallStreamReactor) and client (grpc_client.cpp:
// ClientCallStream).
//
// Contract:
// - encode* writes what protobuf would (fields in number order, defaults
//   left out), so protobuf in Python reads it; decode* takes what protobuf
//   writes, refuses what protobuf would refuse (proto_wire.hpp's readers),
//   skips unknown fields, and returns false on anything malformed.
#pragma once

#include "proto_wire.hpp"

#include <cstdint>
#include <string>
#include <string_view>

namespace ft_call_stream {

struct Request {
  int64_t timeoutMs = 0;
  std::string_view request; // into the decoded buffer
};

struct Response {
  int32_t code = 0;
  std::string details;
  std::string_view response; // into the decoded buffer
};

// A CallStreamRequest whose `request` field is `head` followed by `body`
// (head: the signature's leading field, or empty).
inline std::string
encodeRequest(int64_t timeoutMs, std::string_view head, std::string_view body) {
  std::string out;
  out.reserve(head.size() + body.size() + 16);
  if (timeoutMs != 0) {
    ft_wire::appendVarint(&out, (1u << 3) | 0);
    ft_wire::appendVarint(&out, static_cast<uint64_t>(timeoutMs));
  }
  if (!head.empty() || !body.empty()) {
    ft_wire::appendVarint(&out, (2u << 3) | 2);
    ft_wire::appendVarint(&out, head.size() + body.size());
    out.append(head);
    out.append(body);
  }
  return out;
}

inline std::string
encodeResponse(int32_t code, std::string_view details, std::string_view body) {
  std::string out;
  out.reserve(details.size() + body.size() + 16);
  if (code != 0) {
    ft_wire::appendVarint(&out, (1u << 3) | 0);
    // int32: a negative value is sign-extended to 64 bits, as protobuf does.
    ft_wire::appendVarint(
        &out,
        static_cast<uint64_t>(static_cast<int64_t>(code)));
  }
  if (!details.empty()) {
    ft_wire::appendVarint(&out, (2u << 3) | 2);
    ft_wire::appendVarint(&out, details.size());
    out.append(details);
  }
  if (!body.empty()) {
    ft_wire::appendVarint(&out, (3u << 3) | 2);
    ft_wire::appendVarint(&out, body.size());
    out.append(body);
  }
  return out;
}

inline bool decodeRequest(std::string_view b, Request* r) {
  size_t i = 0;
  while (i < b.size()) {
    uint64_t tag = 0, v = 0;
    if (!ft_wire::readTag(b, &i, &tag))
      return false;
    const uint32_t wt = tag & 7;
    if (tag == ((1u << 3) | 0)) {
      if (!ft_wire::readVarint(b, &i, &v))
        return false;
      r->timeoutMs = static_cast<int64_t>(v);
    } else if (tag == ((2u << 3) | 2)) {
      if (!ft_wire::readLength(b, &i, &v))
        return false;
      r->request = b.substr(i, v);
      i += v;
    } else if (!ft_wire::skipValue(b, &i, wt)) {
      return false;
    }
  }
  return true;
}

inline bool decodeResponse(std::string_view b, Response* r) {
  size_t i = 0;
  while (i < b.size()) {
    uint64_t tag = 0, v = 0;
    if (!ft_wire::readTag(b, &i, &tag))
      return false;
    const uint32_t wt = tag & 7;
    if (tag == ((1u << 3) | 0)) {
      if (!ft_wire::readVarint(b, &i, &v))
        return false;
      r->code = static_cast<int32_t>(v); // int32: protobuf truncates too
    } else if (tag == ((2u << 3) | 2)) {
      if (!ft_wire::readLength(b, &i, &v))
        return false;
      r->details.assign(b.substr(i, v));
      i += v;
    } else if (tag == ((3u << 3) | 2)) {
      if (!ft_wire::readLength(b, &i, &v))
        return false;
      r->response = b.substr(i, v);
      i += v;
    } else if (!ft_wire::skipValue(b, &i, wt)) {
      return false;
    }
  }
  return true;
}

} // namespace ft_call_stream
