// workbook/lltm_checks.h: the input checks of the LLTM ops, shared by stages 02, 04 and 05.
//
// Every LLTM implementation takes the same arguments, so it refuses the same bad inputs with the
// same messages, whichever stage or backend it reaches:
//
//   forward(input [B, F], weights [3S, S + F], bias [3S], old_h [B, S], old_cell [B, S])
//   backward(grad_h, grad_cell, new_cell [B, S], gates [B, 3S], input, old_h, weights)
//
// Sizes are checked against each other, and a message says which size disagrees with which:
//   ValueError: lltm: `old_h` must have size 2 in dimension 0 (batch size of `input`), got ...
#pragma once

#include <cstdint>

#include "workbook/checks.h"

namespace workbook::lltm {

inline void check_forward_inputs(const Tensor& input, const Tensor& weights, const Tensor& bias,
                                 const Tensor& old_h, const Tensor& old_cell,
                                 c10::DeviceType device, Memory memory = Memory::kAnyStrides) {
  constexpr const char* op = "lltm";
  const Arg input_arg{op, "input"}, weights_arg{op, "weights"}, bias_arg{op, "bias"},
      h_arg{op, "old_h"}, c_arg{op, "old_cell"};
  check_inputs({{input, input_arg},
                {weights, weights_arg},
                {bias, bias_arg},
                {old_h, h_arg},
                {old_cell, c_arg}},
               device, memory);
  check_dim(input, input_arg, 2, "(batch, features)");
  check_dim(old_h, h_arg, 2, "(batch, state)");
  check_dim(old_cell, c_arg, 2, "(batch, state)");
  check_dim(weights, weights_arg, 2, "(3 * state, state + features)");
  check_dim(bias, bias_arg, 1, "(3 * state)");

  const int64_t batch = input.size(0), features = input.size(1), state = old_h.size(1);
  check_size(old_h, h_arg, 0, batch, "batch size of `input`");
  check_same_shape(old_cell, c_arg, old_h, h_arg);
  check_size(weights, weights_arg, 0, 3 * state, "3 * state size of `old_h`");
  check_size(weights, weights_arg, 1, state + features,
             "state size of `old_h` + features of `input`");
  check_size(bias, bias_arg, 0, 3 * state, "3 * state size of `old_h`");
}

// Autograd calls the backward with what the forward saved, so the shapes agree by construction;
// these checks guard direct calls and the kernels' memory assumptions.
inline void check_backward_inputs(const Tensor& grad_h, const Tensor& grad_cell,
                                  const Tensor& new_cell, const Tensor& gates, const Tensor& input,
                                  const Tensor& old_h, const Tensor& weights,
                                  c10::DeviceType device, Memory memory = Memory::kAnyStrides) {
  constexpr const char* op = "lltm_backward";
  const Arg grad_h_arg{op, "grad_h"}, grad_cell_arg{op, "grad_cell"}, cell_arg{op, "new_cell"},
      gates_arg{op, "gates"}, input_arg{op, "input"}, h_arg{op, "old_h"},
      weights_arg{op, "weights"};
  check_inputs({{grad_h, grad_h_arg},
                {grad_cell, grad_cell_arg},
                {new_cell, cell_arg},
                {gates, gates_arg},
                {input, input_arg},
                {old_h, h_arg},
                {weights, weights_arg}},
               device, memory);
  check_dim(new_cell, cell_arg, 2, "(batch, state)");
  check_dim(gates, gates_arg, 2, "(batch, 3 * state)");
  check_dim(input, input_arg, 2, "(batch, features)");
  check_dim(weights, weights_arg, 2, "(3 * state, state + features)");
  check_same_shape(grad_h, grad_h_arg, new_cell, cell_arg);
  check_same_shape(grad_cell, grad_cell_arg, new_cell, cell_arg);
  check_same_shape(old_h, h_arg, new_cell, cell_arg);

  const int64_t batch = new_cell.size(0), state = new_cell.size(1);
  check_size(gates, gates_arg, 0, batch, "batch size of `new_cell`");
  check_size(gates, gates_arg, 1, 3 * state, "3 * state size of `new_cell`");
  check_size(input, input_arg, 0, batch, "batch size of `new_cell`");
  check_size(weights, weights_arg, 0, 3 * state, "3 * state size of `new_cell`");
  check_size(weights, weights_arg, 1, state + input.size(1),
             "state size of `new_cell` + features of `input`");
}

}  // namespace workbook::lltm
