// Python module ft._C: the only file that touches pybind11 or the GIL.
#include <torch/csrc/utils/pybind.h>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include "backend.hpp"
#include "checksum.hpp"
#include "gloo_comm.hpp"
#include "host_staging.hpp"
#include "lane.hpp"
#include "nccl_comm.hpp" // empty unless FT_USE_NCCL
#include "process_memory.hpp"

namespace py = pybind11;

namespace {

// Builds torch's own ProcessGroupGloo through its Python binding (torch ships
// no Gloo headers), by way of ft.process_group._new_gloo, which also names the
// epoll instances of the Gloo devices it built. Called from configure(), on
// the configuring thread; the binding releases the GIL while it waits for
// peers.
ft::GlooLane makeGloo(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout) {
  py::gil_scoped_acquire gil;
  // ft.process_group._new_gloo binds Gloo to the replica's advertised address.
  py::object factory =
      py::module_::import("ft.process_group").attr("_new_gloo");
  // Gloo's own timeout is a backstop: ft's watchdog fires first.
  const auto innerTimeout =
      timeout + std::max(std::chrono::milliseconds(1000), timeout / 10);
  py::tuple made = factory(store, rank, size, innerTimeout);
  ft::GlooLane lane;
  lane.backend = made[0].cast<c10::intrusive_ptr<c10d::Backend>>();
  lane.epolls = made[1].cast<std::vector<int>>();
  made = py::tuple(); // drop the Python wrapper while we hold the GIL
  return lane;
}

const char* kindName(ft::FailureKind kind) {
  switch (kind) {
    case ft::FailureKind::kAborted:
      return "aborted";
    case ft::FailureKind::kDeadline:
      return "deadline";
    case ft::FailureKind::kCommunication:
      return "communication";
    case ft::FailureKind::kShutdown:
      return "shutdown";
    default:
      return "none";
  }
}

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ft's C++ backend (see csrc/backend.hpp for the contract)";
  // c10d::Backend must be registered before we derive from it.
  py::module_::import("torch.distributed");
  ft::setGlooFactory(&makeGloo);
  ft::setBlockingRegion([](const std::function<void()>& fn) {
    if (PyGILState_Check()) {
      py::gil_scoped_release noGil;
      fn();
    } else {
      fn();
    }
  });

#ifdef FT_USE_NCCL
  m.attr("has_nccl") = true;
  m.def(
      "nccl_version",
      []() -> py::object {
        const int code = ft::ncclLinkedVersion(); // calls ncclGetVersion
        // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
        return py::make_tuple(code / 10000, (code % 10000) / 100, code % 100);
      },
      "Version of the linked NCCL library (ncclGetVersion), as a tuple.");
  m.def(
      "nccl_revoke_available",
      &ft::ncclRevokeAvailable,
      "Whether an abort stops a busy NCCL communicator with ncclCommRevoke "
      "(NCCL 2.28.7+, FT_NCCL_REVOKE not 0), leaving its teardown to the "
      "Reaper, instead of ncclCommAbort in place.");
  m.def(
      "_nccl_live_streams",
      &ft::ncclLiveStreams,
      "Lane CUDA streams created and not yet destroyed (leak checks).");
#else
  m.attr("has_nccl") = false;
  m.def(
      "nccl_version",
      []() -> py::object { return py::none(); },
      "None: this build of ft has no NCCL path.");
  m.def(
      "nccl_revoke_available",
      []() { return false; },
      "False: this build of ft has no NCCL path.");
#endif

  m.def(
      "set_current_lane",
      &ft::setCurrentLane,
      py::arg("lane"),
      "Selects the lane the calling thread's next ops run on.");
  m.def("get_current_lane", &ft::currentLane);
  m.def(
      "_shared_devices",
      &ft::sharedDevices,
      py::arg("device_ids"),
      "The groups of ranks (by index in device_ids) that name the same GPU: "
      "the NCCL lanes' shared-GPU decision, for table tests.");
  m.def(
      "crc32c",
      [](py::object data, uint32_t value) {
        // PyBUF_SIMPLE: contiguous bytes only (a strided view is refused, not
        // misread).
        Py_buffer view;
        if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) {
          throw py::error_already_set();
        }
        uint32_t out;
        {
          py::gil_scoped_release nogil;
          out = ft::crc32c(view.buf, static_cast<size_t>(view.len), value);
        }
        PyBuffer_Release(&view);
        return out;
      },
      py::arg("data"),
      py::arg("value") = 0,
      "CRC-32C of a contiguous buffer, continuing from `value` (GIL "
      "released).");
  m.def(
      "copy_from_process",
      [](int pid, const py::list& ranges) {
        // ranges: [[(remote_address, writable contiguous buffer), ...], ...].
        // Every buffer is pinned (PyBUF_WRITABLE) before the GIL is released
        // for the whole copy: one release per transfer, not one per piece, so a
        // busy training thread cannot slow it down.
        struct Piece {
          uint64_t remote;
          Py_buffer view;
        };
        std::vector<std::vector<Piece>> plan;
        // Every buffer taken is released on every way out (the GIL is held
        // again by then).
        struct ReleaseAll {
          std::vector<std::vector<Piece>>& plan;
          ~ReleaseAll() {
            for (auto& range : plan) {
              for (auto& piece : range) {
                PyBuffer_Release(&piece.view);
              }
            }
          }
        } releaseAll{plan};
        for (const auto& range : ranges) {
          plan.emplace_back();
          for (auto item : range.cast<py::sequence>()) {
            auto pair = item.cast<py::sequence>();
            if (pair.size() != 2) {
              throw py::value_error("each piece is (remote_address, buffer)");
            }
            Piece piece{pair[0].cast<uint64_t>(), {}};
            plan.back().reserve(
                plan.back().size() + 1); // no throw between get and push
            if (PyObject_GetBuffer(
                    pair[1].ptr(),
                    &piece.view,
                    PyBUF_WRITABLE) != 0) {
              throw py::error_already_set();
            }
            plan.back().push_back(piece);
          }
        }
        std::vector<std::vector<ft::RemotePiece>> pieces;
        for (auto& range : plan) {
          pieces.emplace_back();
          for (auto& piece : range) {
            pieces.back().push_back(
                {piece.remote,
                 piece.view.buf,
                 static_cast<size_t>(piece.view.len)});
          }
        }
        std::vector<uint32_t> crcs;
        int err = 0;
        {
          py::gil_scoped_release nogil;
          err = ft::copyAndChecksum(static_cast<pid_t>(pid), pieces, crcs);
        }
        return py::make_tuple(crcs, err);
      },
      py::arg("pid"),
      py::arg("ranges"),
      "Copies each range's pieces (remote_address -> buffer) out of process "
      "`pid` with "
      "process_vm_readv and returns (CRC-32C of each completed range, errno of "
      "the first "
      "failure or 0); the range that failed is the one after the last CRC. GIL "
      "released.");
  m.def(
      "allow_process_to_read",
      [](int pid) { return ft::allowProcessToRead(static_cast<pid_t>(pid)); },
      py::arg("pid"),
      "prctl(PR_SET_PTRACER, pid): lets `pid` read this process under Yama "
      "ptrace_scope 1 "
      "(0: nobody). Returns 0 or the errno (EINVAL where there is no Yama).");
  m.def(
      "_shutdown_all",
      &ft::shutdownAllBackends,
      py::arg("timeout"),
      py::call_guard<py::gil_scoped_release>(),
      "At exit: shut down every backend and wait for their teardown.");
  m.def(
      "_drain_releaser",
      [](bool finalizing) {
        if (finalizing) {
          py::gil_scoped_release noGil;
          ft::quiesceReleaser();
        }
        ft::drainReleaser(finalizing);
      },
      py::arg("finalizing"),
      "At exit: stop the releaser thread and drop queued op references "
      "here, where the GIL is held.");

  py::class_<ft::FtBackend, c10d::Backend, c10::intrusive_ptr<ft::FtBackend>>(
      m,
      "FtBackend")
      .def(
          py::init([](int rank,
                      int size,
                      std::chrono::milliseconds timeout,
                      int numLanes) {
            return c10::make_intrusive<ft::FtBackend>(
                rank,
                size,
                timeout,
                numLanes);
          }),
          py::arg("rank"),
          py::arg("size"),
          py::arg("timeout"),
          py::arg("num_lanes") = 2)
      .def(
          "configure",
          &ft::FtBackend::configure,
          py::arg("store"),
          py::arg("rank"),
          py::arg("world_size"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "abort",
          &ft::FtBackend::abort,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "shutdown",
          &ft::FtBackend::shutdown,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "errored",
          [](const ft::FtBackend& self) -> py::object {
            auto failure = self.errored();
            if (!failure) {
              return py::none();
            }
            return py::make_tuple(kindName(failure->kind), failure->message);
          })
      .def("set_timeout", &ft::FtBackend::setTimeout, py::arg("timeout"))
      .def_property_readonly("timeout", &ft::FtBackend::timeout)
      .def_property(
          "check_agreement",
          &ft::FtBackend::checkAgreement,
          &ft::FtBackend::setCheckAgreement)
      .def_property(
          "host_stage_shared_gpu",
          &ft::FtBackend::hostStageSharedGpu,
          &ft::FtBackend::setHostStageSharedGpu,
          "Ranks of one NCCL lane on one GPU: carry its CUDA ops host-staged "
          "over Gloo (True) or refuse them with a ValueError (False). Read by "
          "the next configure().")
      .def_property(
          "_stage_cpu_ops",
          &ft::FtBackend::stageCpuOps,
          &ft::FtBackend::setStageCpuOps)
      .def_property_readonly(
          "host_staged_ops",
          &ft::FtBackend::hostStagedOps,
          "Ops run host-staged so far (CUDA ops on a lane whose ranks share a "
          "GPU).")
      .def("current_rank", &ft::FtBackend::currentRank)
      .def("current_size", &ft::FtBackend::currentSize)
      .def("generation", &ft::FtBackend::generationId)
      .def("configured", &ft::FtBackend::configured)
      .def_property_readonly("num_lanes", &ft::FtBackend::numLanes)
      .def(
          "set_cuda_device",
          &ft::FtBackend::setCudaDevice,
          py::arg("device"),
          "CUDA device whose NCCL communicators configure() creates "
          "eagerly (-1: connect each lane on its first CUDA op).")
      .def_property_readonly("cuda_device", &ft::FtBackend::cudaDevice)
      .def(
          "last_reconfigure_timings",
          [](const ft::FtBackend& self) {
            const auto t = self.lastReconfigureTimings();
            py::dict d;
            d["generation"] = t.generation;
            d["abort_ms"] = t.abortMs;
            d["gloo_ms"] = t.glooMs;
            d["nccl_ms"] = t.ncclMs;
            d["total_ms"] = t.totalMs;
            return d;
          },
          "Milliseconds each step of the last configure() took: aborting "
          "the old generation (ncclCommAbort included), connecting Gloo, "
          "creating NCCL communicators (eager init), and the total.")
      .def("_generation_socket_count", &ft::FtBackend::generationSocketCount)
      .def("_reaper_pending", &ft::FtBackend::reaperPending);
}
