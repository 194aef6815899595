// decode_quorum_response: a serialized LighthouseQuorumResponse straight into
// ft's Python types (ft.coordination.quorum.QuorumMember), without building
// protobuf objects first.
//
// Why: a client decodes every member of every quorum it gets, every step. The
// protobuf route (parse, then read eight fields of each member into a
// dataclass, ft/coordination/wire.py) cost about 2.5 us per member: 0.65 ms per
// quorum of 256 groups, with the GIL held. This builds the same objects in a
// fraction of that.
//
// Contract:
// - For a well-formed message whose fields all have their declared wire types,
//   the result equals wire.quorum_from_pb of protobuf's parse (the tests hold
//   it to that): proto3 defaults for absent fields, the last value for a
//   repeated scalar field, every value of a repeated string field
//   (reconfigure_handles) in order, unknown fields skipped, `data` through
//   `data_from_wire` (called only for a non-empty string).
// - Anything else (malformed bytes, a known field with another wire type,
//   invalid UTF-8, a timestamp out of range) returns None, and the caller
//   parses with protobuf, which raises with its own message.

#include "quorum_wire.hpp"

#include "proto_wire.hpp"

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

namespace py = pybind11;

namespace {

using ft_wire::kBytes;
using ft_wire::kVarint;
using ft_wire::readField;

// Owned reference, released on scope exit (the C API, for speed: this runs
// once per field of every member of every quorum a client gets).
struct Ref {
  PyObject* p = nullptr;
  Ref() = default;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  Ref& operator=(Ref&& o) noexcept {
    std::swap(p, o.p);
    return *this;
  }
  ~Ref() {
    Py_XDECREF(p);
  }
  PyObject* release() {
    PyObject* o = p;
    p = nullptr;
    return o;
  }
};

// A str from UTF-8 bytes; null (error cleared) when they are not valid UTF-8.
PyObject* utf8(std::string_view b) {
  PyObject* s = PyUnicode_DecodeUTF8(
      b.data(),
      static_cast<Py_ssize_t>(b.size()),
      "strict");
  if (s == nullptr)
    PyErr_Clear();
  return s;
}

struct Keys {
  PyObject* replicaId = PyUnicode_InternFromString("replica_id");
  PyObject* address = PyUnicode_InternFromString("address");
  PyObject* storeAddress = PyUnicode_InternFromString("store_address");
  PyObject* step = PyUnicode_InternFromString("step");
  PyObject* worldSize = PyUnicode_InternFromString("world_size");
  PyObject* shrinkOnly = PyUnicode_InternFromString("shrink_only");
  PyObject* data = PyUnicode_InternFromString("data");
  PyObject* commitFailures = PyUnicode_InternFromString("commit_failures");
  PyObject* reconfigureHandles =
      PyUnicode_InternFromString("reconfigure_handles");
  PyObject* empty = PyUnicode_InternFromString("");
  PyObject* noArgs = PyTuple_New(0);
}; // never freed: one per process

// Why a member could not be decoded here: protobuf decides (kFallBack), or
// Python raised (kRaised: an error is set).
enum class Fail { kNone, kFallBack, kRaised };

// One QuorumMember as an instance of `cls` whose __dict__ holds the fields (as
// wire.member_from_pb builds it). Null with *fail set otherwise.
PyObject* decodeMember(
    std::string_view m,
    PyObject* cls,
    PyObject* dataFromWire,
    const Keys& k,
    Fail* fail) {
  *fail = Fail::kFallBack;
  Ref text[4]; // replica_id, address, store_address, data (last value wins)
  int64_t step = 0, commitFailures = 0;
  uint64_t worldSize = 0;
  bool shrinkOnly = false;
  Ref handles(PyList_New(0)); // reconfigure_handles (9), every occurrence
  if (handles.p == nullptr) {
    *fail = Fail::kRaised;
    return nullptr;
  }
  size_t i = 0;
  while (i < m.size()) {
    uint64_t field = 0, value = 0;
    uint32_t wt = 0;
    std::string_view bytes;
    if (!readField(m, &i, &field, &wt, &value, &bytes))
      return nullptr;
    if (field == 1 || field == 2 || field == 3 || field == 7) {
      if (wt != kBytes)
        return nullptr;
      Ref t(utf8(bytes));
      if (t.p == nullptr)
        return nullptr;
      text[field == 7 ? 3 : field - 1] = std::move(t);
    } else if (field == 9) {
      if (wt != kBytes)
        return nullptr;
      Ref t(utf8(bytes));
      if (t.p == nullptr)
        return nullptr;
      if (PyList_Append(handles.p, t.p) != 0) {
        *fail = Fail::kRaised;
        return nullptr;
      }
    } else if (field == 4 || field == 5 || field == 6 || field == 8) {
      if (wt != kVarint)
        return nullptr;
      if (field == 4)
        step = static_cast<int64_t>(value);
      else if (field == 5)
        worldSize = value;
      else if (field == 6)
        shrinkOnly = value != 0;
      else
        commitFailures = static_cast<int64_t>(value);
    } // else unknown: skipped, as protobuf does
  }
  *fail = Fail::kRaised;
  Ref data;
  if (text[3].p != nullptr && PyUnicode_GET_LENGTH(text[3].p) > 0) {
    data = Ref(PyObject_CallOneArg(dataFromWire, text[3].p));
    if (data.p == nullptr)
      return nullptr;
  } else {
    data = Ref(Py_NewRef(Py_None));
  }
  auto str = [&](int idx) { return text[idx].p ? text[idx].p : k.empty; };
  Ref stepObj(PyLong_FromLongLong(step));
  Ref worldObj(PyLong_FromUnsignedLongLong(worldSize));
  Ref failuresObj(PyLong_FromLongLong(commitFailures));
  Ref handlesObj(PyList_AsTuple(handles.p));
  if (!stepObj.p || !worldObj.p || !failuresObj.p || !handlesObj.p)
    return nullptr;
  auto* type = reinterpret_cast<PyTypeObject*>(cls);
  Ref member(type->tp_new(type, k.noArgs, nullptr)); // object.__new__(cls)
  if (member.p == nullptr)
    return nullptr;
  // Stored as object.__setattr__ stores them (what a frozen dataclass's
  // __init__ does): the instance keeps CPython's compact shared-key layout.
  PyObject* o = member.p;
  if (PyObject_GenericSetAttr(o, k.replicaId, str(0)) != 0 ||
      PyObject_GenericSetAttr(o, k.address, str(1)) != 0 ||
      PyObject_GenericSetAttr(o, k.storeAddress, str(2)) != 0 ||
      PyObject_GenericSetAttr(o, k.step, stepObj.p) != 0 ||
      PyObject_GenericSetAttr(o, k.worldSize, worldObj.p) != 0 ||
      PyObject_GenericSetAttr(
          o,
          k.shrinkOnly,
          shrinkOnly ? Py_True : Py_False) != 0 ||
      PyObject_GenericSetAttr(o, k.data, data.p) != 0 ||
      PyObject_GenericSetAttr(o, k.commitFailures, failuresObj.p) != 0 ||
      PyObject_GenericSetAttr(o, k.reconfigureHandles, handlesObj.p) != 0)
    return nullptr;
  *fail = Fail::kNone;
  return member.release();
}

// (quorum_id, participants tuple, (seconds, nanos) or None), or None.
py::object decodeQuorumResponse(
    std::string_view body,
    py::handle memberCls,
    py::handle dataFromWire) {
  static const Keys* keys = new Keys();
  if (!PyType_Check(memberCls.ptr()))
    throw py::type_error("member_cls must be a class");
  size_t i = 0;
  bool haveQuorum = false;
  std::string_view q;
  while (i < body.size()) {
    uint64_t field = 0, value = 0;
    uint32_t wt = 0;
    std::string_view bytes;
    if (!readField(body, &i, &field, &wt, &value, &bytes))
      return py::none();
    if (field == 1) {
      // Two occurrences of a message field merge in protobuf: rare enough to
      // leave to it.
      if (wt != kBytes || haveQuorum)
        return py::none();
      haveQuorum = true;
      q = bytes;
    }
  }
  int64_t quorumId = 0;
  Ref members(PyList_New(0));
  if (members.p == nullptr)
    throw py::error_already_set();
  bool haveCreated = false;
  int64_t seconds = 0, nanos = 0;
  i = 0;
  while (i < q.size()) {
    uint64_t field = 0, value = 0;
    uint32_t wt = 0;
    std::string_view bytes;
    if (!readField(q, &i, &field, &wt, &value, &bytes))
      return py::none();
    if (field == 1) {
      if (wt != kVarint)
        return py::none();
      quorumId = static_cast<int64_t>(value);
    } else if (field == 2) {
      if (wt != kBytes)
        return py::none();
      Fail fail = Fail::kNone;
      Ref m(decodeMember(
          bytes,
          memberCls.ptr(),
          dataFromWire.ptr(),
          *keys,
          &fail));
      if (fail == Fail::kRaised)
        throw py::error_already_set();
      if (fail == Fail::kFallBack)
        return py::none();
      if (PyList_Append(members.p, m.p) != 0)
        throw py::error_already_set();
    } else if (field == 3) {
      if (wt != kBytes || haveCreated)
        return py::none(); // merging two timestamps: left to protobuf
      haveCreated = true;
      size_t j = 0;
      while (j < bytes.size()) {
        uint64_t f = 0, v = 0;
        uint32_t w = 0;
        std::string_view unused;
        if (!readField(bytes, &j, &f, &w, &v, &unused))
          return py::none();
        if ((f == 1 || f == 2) && w != kVarint)
          return py::none();
        if (f == 1)
          seconds = static_cast<int64_t>(v);
        else if (f == 2)
          nanos = static_cast<int64_t>(static_cast<int32_t>(v));
      }
      // Timestamp's valid range (0001-01-01 .. 9999-12-31); outside it
      // protobuf's conversion decides.
      if (nanos < 0 || nanos > 999999999 || seconds < -62135596800LL ||
          seconds > 253402300799LL)
        return py::none();
    }
  }
  Ref tuple(PyList_AsTuple(members.p));
  if (tuple.p == nullptr)
    throw py::error_already_set();
  py::object created = haveCreated ? py::object(py::make_tuple(seconds, nanos))
                                   : py::object(py::none());
  return py::make_tuple(
      quorumId,
      py::reinterpret_steal<py::object>(tuple.release()),
      created);
}

} // namespace

void bindQuorumWire(py::module_& m) {
  m.def(
      "decode_quorum_response",
      [](py::bytes data, py::handle memberCls, py::handle dataFromWire) {
        return decodeQuorumResponse(std::string(data), memberCls, dataFromWire);
      },
      py::arg("data"),
      py::arg("member_cls"),
      py::arg("data_from_wire"),
      "(quorum_id, members, (seconds, nanos) or None) of a serialized "
      "LighthouseQuorumResponse, or None where protobuf must decide.");
}
