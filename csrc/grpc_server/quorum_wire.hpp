// Decoding lighthouse answers into ft's Python types (quorum_wire.cpp).
#pragma once

#include <pybind11/pybind11.h>

// Adds decode_quorum_response to the module.
void bindQuorumWire(pybind11::module_& m);
