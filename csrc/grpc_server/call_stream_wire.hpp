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
    ft_wire::appendVarintField(&out, 1, static_cast<uint64_t>(timeoutMs));
  }
  if (!head.empty() || !body.empty()) {
    ft_wire::appendVarint(&out, (2u << 3) | ft_wire::kBytes);
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
    // int32: a negative value is sign-extended to 64 bits, as protobuf does.
    ft_wire::appendVarintField(
        &out,
        1,
        static_cast<uint64_t>(static_cast<int64_t>(code)));
  }
  if (!details.empty()) {
    ft_wire::appendBytesField(&out, 2, details);
  }
  if (!body.empty()) {
    ft_wire::appendBytesField(&out, 3, body);
  }
  return out;
}

// Each field of `b` in turn, as `onField(number, wireType, value, bytes)`
// (ft_wire::readField's); false on anything malformed.
template <typename OnField>
bool readFields(std::string_view b, OnField&& onField) {
  size_t i = 0;
  while (i < b.size()) {
    uint64_t field = 0, value = 0;
    uint32_t wt = 0;
    std::string_view bytes;
    if (!ft_wire::readField(b, &i, &field, &wt, &value, &bytes))
      return false;
    onField(field, wt, value, bytes);
  }
  return true;
}

inline bool decodeRequest(std::string_view b, Request* r) {
  using ft_wire::kBytes, ft_wire::kVarint;
  return readFields(b, [r](uint64_t field, uint32_t wt, uint64_t v, auto s) {
    if (field == 1 && wt == kVarint)
      r->timeoutMs = static_cast<int64_t>(v);
    else if (field == 2 && wt == kBytes)
      r->request = s;
  });
}

inline bool decodeResponse(std::string_view b, Response* r) {
  using ft_wire::kBytes, ft_wire::kVarint;
  return readFields(b, [r](uint64_t field, uint32_t wt, uint64_t v, auto s) {
    if (field == 1 && wt == kVarint)
      r->code = static_cast<int32_t>(v); // int32: protobuf truncates too
    else if (field == 2 && wt == kBytes)
      r->details.assign(s);
    else if (field == 3 && wt == kBytes)
      r->response = s;
  });
}

} // namespace ft_call_stream
