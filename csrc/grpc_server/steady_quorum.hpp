// SteadyQuorum: the lighthouse's steady round, answered without Python.
//
// Why: in a running job almost every quorum round is the previous quorum again:
// the same replica groups, each asking with nothing changed but its step. The
// rule (ft/coordination/quorum.py, quorum_compute's fast path) then issues the
// same members at once, under the same quorum id. Taking the GIL, parsing,
// and running the Python rule for every one of those requests made the
// lighthouse's round 2-4x torchft's (docs/benchmarks.md, "Quorum and
// lighthouse"). Here such a round is recognised and answered in C++; everything
// else still goes to Python, which stays the one place where the rule is
// decided.
//
// Contract:
// - Python arms it (`arm`) right after it issued a quorum, while no other
//   replica is waiting, with each member's identity: the member as its request
//   carried it, serialized with `step` cleared. Python disarms it before it
//   registers any Quorum request of its own, so a request that was on its way
//   to Python while it armed is decided there, with the held ones: no round is
//   split between the two.
// - While armed, a Quorum request is held here when it is well-formed, has a
//   deadline, its member's step is >= 0 and everything else is byte-equal to
//   that member's identity, and no other request of that member is held. When
//   every member is held, all are answered with one LighthouseQuorumResponse
//   (the same quorum id; participants sorted by replica id, each exactly as its
//   request carried it), and it stays armed for the next round.
// - Any other request disarms it: that request and every held one go to Python
//   (`offer`'s `toPython`), in arrival order. So does `disarm`, which Python
//   calls when it learns something that changes the rule's answer (a member
//   failed, left, or dropped its subscription; shutdown) and when a round did
//   not complete within a tick.
// - Held requests count as waiting Quorum calls: each arrival and each answer
//   is recorded as its member's heartbeat (`heartbeatIds`), and a cancelled
//   call is dropped (`drop`).
// - Nothing here calls into Python or into gRPC: the caller answers the calls
//   it is handed, outside the lock.
//
// `Call` needs `double timeRemaining() const` and `bool isActive()` (false once
// cancelled; it must not take locks that are held while calling `drop`); it is
// held by shared_ptr. Its owner calls `drop` after marking it cancelled, so
// that a call cancelled while it is offered is never held.

#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "proto_wire.hpp"

namespace ft_steady {

using ft_wire::appendBytesField;
using ft_wire::appendVarint;
using ft_wire::readLength;
using ft_wire::readTag;
using ft_wire::readVarint;
using ft_wire::skipValue;

// A LighthouseQuorumRequest as the steady round needs it.
struct QuorumRequest {
  std::string replicaId;
  int64_t step = 0;
  std::string member;   // the requester, as serialized in the request
  std::string identity; // the requester without its step field
};

// Parses `body` (LighthouseQuorumRequest {QuorumMember requester = 1;}):
// exactly one field, the requester; in it, at most one replica_id (1) and at
// most one step (4), a varint >= 0. False for anything else (Python decides
// those, and says what is wrong).
inline bool parseQuorumRequest(const std::string& body, QuorumRequest* out) {
  size_t i = 0;
  uint64_t tag = 0, len = 0;
  if (!readTag(body, &i, &tag) || tag != ((1u << 3) | 2) ||
      !readLength(body, &i, &len) || len != body.size() - i)
    return false;
  out->member.assign(body, i, len);
  const std::string& m = out->member;
  out->identity.clear();
  out->identity.reserve(m.size());
  bool haveId = false, haveStep = false;
  size_t j = 0;
  while (j < m.size()) {
    const size_t start = j;
    if (!readTag(m, &j, &tag))
      return false; // not a valid tag: Python says so
    const uint64_t field = tag >> 3;
    const uint32_t wt = static_cast<uint32_t>(tag & 7);
    if (field == 4 && wt == 0) {
      uint64_t step = 0;
      if (haveStep || !readVarint(m, &j, &step) || step > INT64_MAX)
        return false;
      out->step = static_cast<int64_t>(step);
      haveStep = true;
      continue; // not part of the identity
    }
    if (field == 1 && wt == 2) {
      size_t k = j;
      if (haveId || !readLength(m, &k, &len))
        return false;
      out->replicaId.assign(m, k, len);
      haveId = true;
    }
    if (!skipValue(m, &j, wt))
      return false;
    out->identity.append(m, start, j - start);
  }
  if (!haveStep)
    out->step = 0;
  return haveId && !out->replicaId.empty();
}

// LighthouseQuorumResponse {Quorum quorum = 1;} with Quorum {int64 quorum_id =
// 1; repeated QuorumMember participants = 2; Timestamp created = 3;}.
inline std::string encodeQuorumResponse(
    int64_t quorumId,
    const std::vector<const std::string*>& members,
    int64_t createdUnixNanos) {
  std::string quorum;
  if (quorumId != 0) {
    appendVarint(&quorum, (1u << 3) | 0);
    appendVarint(&quorum, static_cast<uint64_t>(quorumId));
  }
  for (const std::string* m : members)
    appendBytesField(&quorum, 2, *m);
  std::string ts;
  const int64_t seconds = createdUnixNanos / 1000000000;
  const int64_t nanos = createdUnixNanos % 1000000000;
  if (seconds != 0) {
    appendVarint(&ts, (1u << 3) | 0);
    appendVarint(&ts, static_cast<uint64_t>(seconds));
  }
  if (nanos != 0) {
    appendVarint(&ts, (2u << 3) | 0);
    appendVarint(&ts, static_cast<uint64_t>(nanos));
  }
  appendBytesField(&quorum, 3, ts);
  std::string out;
  appendBytesField(&out, 1, quorum);
  return out;
}

inline double steadySeconds() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline int64_t unixNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// --- the steady round
// -----------------------------------------------------------------

template <class Call>
class SteadyQuorum {
 public:
  struct Held {
    std::shared_ptr<Call> call;
    std::string body;
    double arrived; // steady-clock seconds (Python's time.monotonic())
  };

  // What the caller does after `offer`, outside the lock.
  struct Outcome {
    // Hand these to Python, in this order.
    std::vector<Held> toPython;
    // Answer these with `answer` (a round completed).
    std::vector<std::shared_ptr<Call>> answered;
    std::string answer;
    // Record these replica ids as heartbeating now.
    std::vector<std::string> heartbeatIds;
  };

  // Rounds answered here since Python last asked (`takeRounds`).
  struct Rounds {
    int64_t quorumId = 0; // the quorum the last of them repeated
    int64_t count = 0;
    std::vector<double> latencies;        // first arrival -> answer, seconds
    std::vector<std::string> lastMembers; // the last round's, sorted
    int64_t lastCreatedUnixNanos = 0;
  };

  SteadyQuorum(std::string method, double noDeadlineS)
      : method_(std::move(method)), noDeadlineS_(noDeadlineS) {}

  const std::string& method() const {
    return method_;
  }

  // Python, right after issuing quorum `quorumId` to these members (replica id
  // -> identity). False when refused (closed, or no members).
  bool arm(
      int64_t quorumId,
      std::unordered_map<std::string, std::string> identities) {
    std::lock_guard<std::mutex> g(mu_);
    if (identities.empty() || closed_ || !held_.empty())
      return false; // (held requests: Python takes them back before it arms)
    armed_ = true;
    quorumId_ = quorumId;
    identities_ = std::move(identities);
    held_.clear();
    return true;
  }

  // Disarms; the held requests, for Python.
  std::vector<Held> disarm() {
    std::lock_guard<std::mutex> g(mu_);
    return disarmLocked();
  }

  // Disarms for good (the server shuts down): every later request goes to
  // Python.
  std::vector<Held> close() {
    std::lock_guard<std::mutex> g(mu_);
    closed_ = true;
    return disarmLocked();
  }

  bool armed() {
    std::lock_guard<std::mutex> g(mu_);
    return armed_;
  }

  // A Quorum request (signature already checked).
  Outcome offer(
      std::shared_ptr<Call> call,
      std::string body,
      double arrived,
      double secondsToDeadline) {
    Outcome out;
    QuorumRequest req;
    const bool plain = secondsToDeadline > 0 &&
        secondsToDeadline <= noDeadlineS_ && parseQuorumRequest(body, &req);
    std::lock_guard<std::mutex> g(mu_);
    // Checked under the lock: the owner marks a call cancelled before it drops
    // it, so a cancelled call is either seen here or dropped after.
    if (armed_ && plain && call->isActive()) {
      auto it = identities_.find(req.replicaId);
      if (it != identities_.end() && it->second == req.identity &&
          held_.count(req.replicaId) == 0) {
        out.heartbeatIds.push_back(req.replicaId);
        if (held_.empty())
          firstArrival_ = arrived;
        order_.push_back(req.replicaId);
        held_.emplace(
            req.replicaId,
            HeldRequest{
                Held{std::move(call), std::move(body), arrived},
                std::move(req.member)});
        if (held_.size() == identities_.size())
          completeLocked(&out);
        return out;
      }
    }
    out.toPython = disarmLocked();
    out.toPython.push_back(Held{std::move(call), std::move(body), arrived});
    return out;
  }

  // A held call was cancelled (its client went away or gave up).
  void drop(const Call* call) {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = held_.begin(); it != held_.end(); ++it) {
      if (it->second.held.call.get() == call) {
        order_.erase(std::find(order_.begin(), order_.end(), it->first));
        held_.erase(it);
        return;
      }
    }
  }

  // Seconds the oldest held request has waited (0: none held).
  double oldestHeldAge() {
    std::lock_guard<std::mutex> g(mu_);
    return held_.empty() ? 0.0 : steadySeconds() - firstArrival_;
  }

  Rounds takeRounds() {
    std::lock_guard<std::mutex> g(mu_);
    Rounds r = std::move(rounds_);
    rounds_ = Rounds();
    return r;
  }

 private:
  struct HeldRequest {
    Held held;
    std::string member;
  };

  std::vector<Held> disarmLocked() {
    std::vector<Held> out;
    armed_ = false;
    out.reserve(held_.size());
    for (const std::string& rid : order_) {
      auto it = held_.find(rid);
      out.push_back(std::move(it->second.held));
    }
    held_.clear();
    order_.clear();
    return out;
  }

  void completeLocked(Outcome* out) {
    std::vector<std::pair<const std::string*, const std::string*>> sorted;
    sorted.reserve(held_.size());
    for (const auto& kv : held_)
      sorted.emplace_back(&kv.first, &kv.second.member);
    std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
      return *a.first < *b.first;
    });
    std::vector<const std::string*> members;
    members.reserve(sorted.size());
    for (const auto& p : sorted)
      members.push_back(p.second);
    const int64_t created = unixNanos();
    out->answer = encodeQuorumResponse(quorumId_, members, created);
    rounds_.quorumId = quorumId_; // the last round's (lastMembers)
    rounds_.count += 1;
    rounds_.latencies.push_back(steadySeconds() - firstArrival_);
    if (rounds_.latencies.size() > 1000)
      rounds_.latencies.erase(rounds_.latencies.begin());
    rounds_.lastMembers.clear();
    for (const std::string* m : members)
      rounds_.lastMembers.push_back(*m);
    rounds_.lastCreatedUnixNanos = created;
    out->answered.reserve(held_.size());
    for (auto& kv : held_) {
      out->answered.push_back(std::move(kv.second.held.call));
      out->heartbeatIds.push_back(kv.first);
    }
    held_.clear();
    order_.clear();
  }

  const std::string method_;
  const double noDeadlineS_;
  std::mutex mu_;
  bool armed_ = false;
  bool closed_ = false;
  int64_t quorumId_ = 0;
  std::unordered_map<std::string, std::string> identities_;
  std::unordered_map<std::string, HeldRequest> held_;
  std::vector<std::string> order_; // held replica ids, in arrival order
  double firstArrival_ = 0;
  Rounds rounds_;
};

} // namespace ft_steady
