// The files that register Python classes and functions (each includes <torch/extension.h>, pybind11 and torch's C++
// API: 4x a translation unit's compile time, so no other file includes it) and what each registers.
#pragma once

#include <torch/extension.h>

void register_projection(pybind11::module& m);      // projection.cpp: Projection, RowSchedule, bf16_gemm
void register_step_attention(pybind11::module& m);  // step_attention.cpp
void register_decoder_loop(pybind11::module& m);    // decoder_loop.cpp
void register_quant_gemm(pybind11::module& m);      // quant_projection.cpp
