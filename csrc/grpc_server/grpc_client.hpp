// The native client of ft.coordination._grpc_server (grpc_client.cpp): one
// module with the server, so that a process loads gRPC C++ once.
#pragma once

#include <pybind11/pybind11.h>

// Adds Channel, CallError and LoadGenerator to the module.
void bindClient(pybind11::module_& m);
